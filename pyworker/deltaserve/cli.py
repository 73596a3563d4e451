"""``deltaserve``: the wheel's console script. The command line itself is the Rust daemon's
(``deltaserve_server::cli``, through ``_native.run_cli``), so the installed command and the
standalone binary take the same flags and behave alike; this shim only hands it ``sys.argv``
and this interpreter, which then runs the workers and the offline tools.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    """Runs ``deltaserve`` with ``argv`` (default ``sys.argv``, program name first) and returns
    its exit code. Ctrl-C and SIGTERM go to the Rust side as in the binary: they shut the
    server down cleanly, not through ``KeyboardInterrupt``."""
    from deltaserve import _native

    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = "deltaserve"
    # Python's own handlers would turn the signals into exceptions it never gets to raise while
    # the daemon runs; the defaults let the daemon's handlers act alone, as in the binary.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    return _native.run_cli(argv, sys.executable)


if __name__ == "__main__":
    sys.exit(main())
