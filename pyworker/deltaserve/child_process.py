"""How a process the router starts (the worker) or the worker starts (a CPU LoRA helper) begins and
ends: ``run_child(main)``.

- **SIGINT is ignored.** A terminal's Ctrl-C signals the whole foreground process group: the router
  and every process under it. The router owns shutdown: it drains, then stops its worker (Shutdown, or
  the worker sees its parent die and exits with 3), and the worker stops its helpers. A child that took
  the signal itself died mid-step with a ``KeyboardInterrupt`` traceback in the router's log.
- **The interpreter's teardown is skipped.** After ``main`` returns, the ``atexit`` handlers run (the
  helper pool's close, ``multiprocessing``'s), logging and stdio are flushed, and the process exits
  with ``os._exit``. The teardown would only free memory the OS takes back anyway, while native
  extensions report the objects alive at teardown (Triton's nanobind module: ~30 lines of "leaked"
  types and functions) into the router's log at every exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


def run_child(main: Callable[[], int]) -> NoReturn:
    """Runs a child process's ``main`` with SIGINT ignored, then exits with its code (module docstring).
    An exception escaping ``main`` is reported and exits as the interpreter would (code 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = main()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say there
            pass
    os._exit(code)
