"""``python -m deltaserve.worker --ipc-dir DIR``: read the router's ``WorkerConfig`` and serve.

The command line names only the link; every setting arrives as the router's first frame (see
``config``). Exit codes: 0 after Shutdown, 1 after a fatal error (reported as a fatal WorkerError
first), 2 for a bad command line or configuration (a bad configuration is also reported as a fatal
WorkerError) or a router of another wire schema, 3 when the parent router died.
"""

from __future__ import annotations

import sys

from .config import ConfigError, parse_args


def main(argv: list[str] | None = None) -> int:
    try:
        ipc_dir = parse_args(argv)
    except ConfigError as e:
        print(f"deltaserve.worker: {e}", file=sys.stderr)
        return 2
    from .loop import serve  # torch is imported only once the command line is known to be good

    return serve(ipc_dir)


if __name__ == "__main__":
    from deltaserve.child_process import run_child

    run_child(main)  # SIGINT left to the router, no interpreter teardown (child_process)
