"""The ``deltaserve`` console script of the wheel (``[project.scripts]``, installed into the venv by
``maturin develop``): it is the Rust daemon's command line, run inside Python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "deltaserve"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not SCRIPT.is_file(), reason="no console script: run `maturin develop`")
def test_console_script_is_the_daemons_command_line():
    assert not SCRIPT.is_symlink(), "the venv's deltaserve must be the console script, not a link"
    help = run("--help")
    assert help.returncode == 0, help.stderr
    assert "Serve a base model" in help.stdout and "--max-num-seqs" in help.stdout
    bad = run("--no-such-flag")
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr
    compress = run("compress", "--help")
    assert compress.returncode == 0 and "--finetuned" in compress.stdout


def test_a_bad_model_exits_1_with_the_reason(tmp_path):
    from deltaserve.cli import main

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from deltaserve.cli import main; sys.exit(main(sys.argv))",
            "--model",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert main is not None
    assert out.returncode == 1 and "config.json" in out.stderr
