"""``python -m deltaserve.worker``: parse the command line (``WorkerConfig``) and serve.

Exit codes: 0 after Shutdown, 1 after a fatal error (reported as a fatal WorkerError first),
2 for bad command-line settings, 3 when the parent router died.
"""

from __future__ import annotations

import sys

from .config import ConfigError, WorkerConfig


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = WorkerConfig.from_args(argv)
    except ConfigError as e:
        print(f"deltaserve.worker: {e}", file=sys.stderr)
        return 2
    from .loop import serve  # torch is imported only once the settings are known to be good

    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
