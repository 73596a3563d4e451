"""``deltaserve.child_process.run_child``: a child ignores SIGINT (the router owns shutdown), exits with
its ``main``'s code, runs its ``atexit`` handlers and flushes what it printed, without the
interpreter's teardown; an exception escaping ``main`` still exits 1 with its traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _child(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """Runs ``body`` as a child's ``main`` under ``run_child``, with an atexit handler writing a marker."""
    lines = [
        "import atexit, os, signal, sys",
        "from deltaserve.child_process import run_child",
        f"atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, 'w').write('ran'))",
        "def main():",
        *("    " + line for line in textwrap.dedent(body).strip().splitlines()),
        "run_child(main)",
    ]
    return subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=120)


def test_sigint_is_ignored_and_the_code_atexit_and_output_survive(tmp_path: Path) -> None:
    done = _child(
        tmp_path,
        """
        os.kill(os.getpid(), signal.SIGINT)  # a terminal's Ctrl-C reaches every process of its group
        print("still here", flush=False)
        print("on stderr", file=sys.stderr)
        return 7
        """,
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout == "still here\n" and done.stderr == "on stderr\n"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_an_exception_from_main_exits_1_with_its_traceback(tmp_path: Path) -> None:
    done = _child(tmp_path, 'raise RuntimeError("boom")')
    assert done.returncode == 1 and "RuntimeError: boom" in done.stderr and "Traceback" in done.stderr
