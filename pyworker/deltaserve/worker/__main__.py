"""``python -m deltaserve.worker``: parse the command line (``WorkerConfig``) and serve.

Exit codes: 0 after Shutdown, 1 after a fatal error (reported as a fatal WorkerError first),
2 for bad command-line settings, 3 when the parent router died.

``DELTASERVE_WORKER_PROFILE=PATH`` runs the worker under ``cProfile`` and writes its stats to
``PATH.<pid>`` every ``DELTASERVE_WORKER_PROFILE_EVERY`` seconds (default 10) and when it exits
(read them with ``python -m pstats``): where a worker's host time goes in a real serving run,
which the per-step timings only total. The router kills a worker right after Shutdown, so the
last periodic file is usually what is left; functions still running (the loop itself) appear
only through what they called.
"""

from __future__ import annotations

import os
import sys

from .config import ConfigError, WorkerConfig


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = WorkerConfig.from_args(argv)
    except ConfigError as e:
        print(f"deltaserve.worker: {e}", file=sys.stderr)
        return 2
    from .loop import serve  # torch is imported only once the settings are known to be good

    profile_to = os.environ.get("DELTASERVE_WORKER_PROFILE")
    if not profile_to:
        return serve(cfg)
    return _serve_profiled(cfg, f"{profile_to}.{os.getpid()}")


PROFILE_DUMP_SECONDS = float(os.environ.get("DELTASERVE_WORKER_PROFILE_EVERY", "10"))
"""How often (seconds) a profiled worker rewrites its stats file."""


def _serve_profiled(cfg: WorkerConfig, path: str) -> int:
    """``serve`` under cProfile; the stats go to ``path`` every ``PROFILE_DUMP_SECONDS`` (written
    whole, then renamed) and at exit."""
    import cProfile
    import time

    from .loop import serve

    prof = cProfile.Profile()
    last = time.monotonic()

    def write() -> None:  # whole or not at all: the router may kill us while it writes
        prof.dump_stats(path + ".tmp")
        os.replace(path + ".tmp", path)

    def dump() -> None:
        prof.disable()
        try:
            write()
        finally:
            prof.enable()

    def maybe_dump() -> None:
        nonlocal last
        if time.monotonic() - last >= PROFILE_DUMP_SECONDS:
            dump()
            last = time.monotonic()

    prof.enable()
    try:
        return serve(cfg, on_iteration=maybe_dump)
    finally:
        prof.disable()
        write()


if __name__ == "__main__":
    sys.exit(main())
