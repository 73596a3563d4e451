"""Running the worker under cProfile (``WorkerConfig.profile_path``, the router's ``--worker-profile``).

The stats go to ``<profile_path>.<pid>`` every ``profile_every_s`` seconds (written whole, then
renamed) and when the worker exits; read them with ``python -m pstats``. They show where a
worker's host time goes in a real serving run, which the per-step timings only total. The router
kills a worker right after Shutdown, so the last periodic file is usually what is left; functions
still running (the loop itself) appear only through what they called.
"""

from __future__ import annotations

import cProfile
import os
import time
from collections.abc import Callable


def run_profiled(run: Callable[[Callable[[], None]], int], path: str, every_s: float) -> int:
    """``run(on_iteration)`` under cProfile; ``on_iteration`` (called by the serving loop at the top
    of every iteration) rewrites the stats at ``path`` once ``every_s`` seconds have passed."""
    prof = cProfile.Profile()
    last = time.monotonic()

    def write() -> None:  # whole or not at all: the router may kill us while it writes
        prof.dump_stats(path + ".tmp")
        os.replace(path + ".tmp", path)

    def maybe_dump() -> None:
        nonlocal last
        if time.monotonic() - last >= every_s:
            prof.disable()
            try:
                write()
            finally:
                prof.enable()
            last = time.monotonic()

    prof.enable()
    try:
        return run(maybe_dump)
    finally:
        prof.disable()
        write()
