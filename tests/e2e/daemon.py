"""Starts and stops a real ``deltaserve`` daemon for end-to-end tests.

The binary comes from ``$DELTASERVE_BIN`` (``make test`` sets it) or ``target/release/deltaserve``
(what ``make setup`` builds);
workers run with this interpreter, so they import the package under test, on the devices in
``$DELTASERVE_TEST_DEVICES`` (default ``cpu``; ``make test-gpu`` sets a CUDA id).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def daemon_binary() -> Path:
    path = Path(os.environ.get("DELTASERVE_BIN", REPO / "target" / "release" / "deltaserve"))
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `make setup` (or set DELTASERVE_BIN)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One daemon process on a free port; ``url`` is its base URL."""

    def __init__(self, model_dir: Path | None, *extra: str, python: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="deltaserve-", suffix=".log", delete=False)
        cmd = [str(daemon_binary()), "--port", str(self.port), "--python", python or sys.executable, *extra]
        if "--devices" not in extra:  # `make test-gpu` runs the same tests on a GPU worker
            cmd += ["--devices", os.environ.get("DELTASERVE_TEST_DEVICES", "cpu")]
        if model_dir is not None:
            cmd += ["--model", str(model_dir)]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "info", **(env or {})},
            start_new_session=True,
        )

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 300) -> Daemon:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"daemon not ready after {timeout_s} s:\n{self.logs()[-4000:]}")

    def wait_exit(self, timeout_s: float = 60) -> int:
        return self.proc.wait(timeout=timeout_s)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Daemon:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
