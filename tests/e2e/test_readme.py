"""The README's commands work as printed, in a fresh shell after `make setup`: no activated venv,
the venv's bin directory off PATH, the working directory the repository. The daemon they talk to
serves the demo model on a free port (the printed commands say 8000; only the port is rewritten,
and the client reads it from $DELTASERVE_URL)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from .daemon import REPO, free_port
from .test_cli import clean_env

pytestmark = pytest.mark.demo


def section_commands(heading: str) -> list[str]:
    """The shell commands of the first ```sh block under ``## heading`` (continuation lines
    joined, comments kept: bash ignores them)."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {heading}\n")
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block, f"no ```sh block under ## {heading}"
    return [c.strip() for c in block.group(1).replace("\\\n", " ").splitlines() if c.strip()]


def run(command: str, port: int, timeout: float = 300) -> subprocess.CompletedProcess:
    command = command.replace("localhost:8000", f"localhost:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    env = clean_env(DELTASERVE_URL=f"http://127.0.0.1:{port}")
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_using_the_api_commands_work_as_printed(demo_daemon):
    port = int(demo_daemon.url.rsplit(":", 1)[1])
    commands = section_commands("Using the API")
    assert len(commands) == 3 and shutil.which("curl")
    for cmd in commands:
        out = run(cmd, port)
        assert out.returncode == 0, (cmd, out.stdout, out.stderr)
        assert out.stdout.strip(), (cmd, out.stderr)
        if "/v1/chat/completions" in cmd:
            body = json.loads(out.stdout)
            assert body["choices"][0]["message"]["content"].strip(), body
        elif "/v1/completions" in cmd:  # SSE: data lines, the last one [DONE]
            events = [line[5:].strip() for line in out.stdout.splitlines() if line.startswith("data:")]
            assert events[-1] == "[DONE]" and len(events) > 2, out.stdout
        else:
            assert "assistant:" in out.stdout and "Tokyo" in out.stdout, out.stdout


def test_first_screen_commands_are_make_targets():
    """The first screen's commands: `make demo` runs here (after `make setup`, only its daemon
    and requests run); `make test` is what CI runs, so it is walked there, not from inside itself."""
    text = (REPO / "README.md").read_text()
    first = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    targets = [line.split()[1] for line in first.splitlines() if line.startswith("make ")]
    assert targets == ["demo", "test"], first
    port = free_port()
    out = subprocess.run(["make", "demo", f"PORT={port}"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "[SmolLM2-135M-Instruct] assistant: The capital of France is Paris." in out.stdout, out.stdout
    assert '[SmolLM2-135M-Instruct:json] assistant: {"word": "apple"}' in out.stdout, out.stdout
    assert "[SmolLM2-135M-Instruct:shout] assistant: [APPLE]" in out.stdout, out.stdout
