"""How long a full garbage collection of a worker's start-up heap takes, before and after ``gc.freeze``.

The worker freezes what its load left alive before serving (``worker/loop.py``
``freeze_loaded_objects``): an H200 S-LoRA S2 recording showed 0.11-0.18 s stalls every 48-60 steps at
~250 running requests, the size of a full collection of that heap. This imports what a worker imports
(torch, triton, transformers, the worker's modules), then times ``gc.collect()`` ``--runs`` times, then
``freeze_loaded_objects()`` and the same again. Host only: the figure depends on the CPU, not the GPU.

    python3 -m bench.gc_pause [--runs 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import write_result  # noqa: E402


def collect_ms(runs: int) -> list[float]:
    """Milliseconds of each of ``runs`` full collections."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch  # noqa: F401 - what a worker holds
    import transformers  # noqa: F401
    import triton  # noqa: F401

    from deltaserve.worker import executor, loop  # noqa: F401

    objects = len(gc.get_objects())
    before = collect_ms(args.runs)
    loop.freeze_loaded_objects()
    frozen = gc.get_freeze_count()
    after = collect_ms(args.runs)
    gc.unfreeze()
    print(f"{objects} objects tracked; full collection {statistics.median(before):.1f} ms (median of {args.runs}, "
          f"{min(before):.1f}-{max(before):.1f}); after freezing {frozen}: {statistics.median(after):.2f} ms")  # fmt: skip
    payload = {"device": "cpu", "objects": objects, "frozen": frozen, "runs": args.runs,
               "collect_ms": before, "collect_after_freeze_ms": after}  # fmt: skip
    print(write_result("gc_pause", payload, args.out))


if __name__ == "__main__":
    main()
