"""The daemon binary's command line outside the Makefile: it finds the interpreter that has the
package by itself, names the interpreter and quotes its own error when that one lacks the package,
and prints `deltaserve compress --help` without any working Python (the embedded copy,
pyworker/deltaserve/compress/help.txt, is kept current here)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from deltaserve.compress.__main__ import HELP_FILE, help_text

from .daemon import daemon_binary


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any hint of the interpreter: no DELTASERVE_PYTHON, no active venv,
    the venv's bin directory off PATH."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("DELTASERVE_PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    return {**env, **extra}


def test_embedded_compress_help_is_current():
    assert HELP_FILE.read_text() == help_text(), (
        "pyworker/deltaserve/compress/help.txt is stale: run `python -m deltaserve.compress --write-help`"
    )


def test_compress_help_needs_no_python():
    for flag in ("--help", "-h"):
        out = subprocess.run([str(daemon_binary()), "compress", flag], capture_output=True, text=True, timeout=30,
                             env=clean_env(DELTASERVE_PYTHON="/nonexistent/python"))  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout == HELP_FILE.read_text()


def test_finds_the_interpreter_with_the_package_by_itself():
    """No --python and no active venv: the tool still runs under an interpreter that imports the
    package (argparse's own usage error proves `deltaserve.compress` was imported)."""
    out = subprocess.run([str(daemon_binary()), "compress", "--bits", "3"], capture_output=True, text=True,
                         timeout=120, env=clean_env())  # fmt: skip
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "usage: deltaserve compress" in out.stderr and "No module named" not in out.stderr, out.stderr


def test_interpreter_without_the_package_is_named_with_its_own_error(tmp_path):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # a real interpreter that lacks deltaserve
    python = bare / "bin" / "python"
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    out = subprocess.run([str(daemon_binary()), "--python", str(python), "--port", "0"], capture_output=True,
                         text=True, timeout=120, env=env)  # fmt: skip
    assert out.returncode != 0
    err = out.stderr
    assert str(python) in err, err
    assert "No module named 'deltaserve'" in err, err
    assert "preparing the demo model" in err and "--python .venv/bin/python" in err, err


@pytest.mark.parametrize(
    "tool,args,expect",
    [
        ("zoo", ["ls", "--zoo", "{tmp}/no-zoo"], "deltaserve zoo ls: "),
        ("zoo", ["--help"], "usage: deltaserve zoo"),
        ("sim", ["--help"], "usage: deltaserve sim"),
        ("profile", ["--model", "{tmp}/no-model", "--out", "{tmp}/p.json"], "deltaserve profile: --model"),
    ],
)
def test_zoo_and_sim_are_subcommands(tmp_path, tool, args, expect):
    """`deltaserve zoo ...` and `deltaserve sim ...` run the package's tools with their own
    arguments and exit codes (an absent zoo is a clear error, not a traceback)."""
    argv = [a.format(tmp=tmp_path) for a in args]
    out = subprocess.run([str(daemon_binary()), tool, *argv], capture_output=True, text=True, timeout=120,
                         env=clean_env())  # fmt: skip
    assert expect in out.stdout + out.stderr, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == (0 if "--help" in argv else 2), (out.returncode, out.stderr)
