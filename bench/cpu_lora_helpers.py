"""Helper scaling: tokens/s of CPU LoRA for 1..N helper processes vs one process with torch threads.

CaraServe §4.2 (Fig. 18): one cold prefill's LoRA on the CPU, its rows split across isolated
processes pinned to one core each, against PyTorch's intra-op threads in one process. The work is
one (layer, module) job as the worker sends it (``deltaserve.helpers``): ``tokens`` rows of ``x``
through q, k and v of a Llama-2-7B layer (hidden 4096) at ``--rank`` (default 64, CaraServe's), i.e.
``scale * (x A^T) B^T`` per slice, float32, repeated ``--reps`` times per point:

- ``helpers``: a ``HelperPool`` of n processes; rows split evenly, one job per helper, waited for
  (the shared-memory copy of ``x`` and of the result into the output included);
- ``torch_threads``: the same math in this process with ``torch.set_num_threads(n)``.

Points beyond the machine's CPUs oversubscribe them (the JSON says how many there are).

    python3 -m bench.cpu_lora_helpers [--max-helpers 8] [--tokens 128] [--rank 64] [--reps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench import script_env

script_env.prepare()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from deltaserve.helpers import protocol as p  # noqa: E402
from deltaserve.helpers.pool import HelperPool  # noqa: E402
from deltaserve.helpers.shm import SharedSegment  # noqa: E402

HIDDEN = 4096
"""Llama-2-7B's hidden size (q, k, v are 4096 -> 4096)."""
PROJS = ("q_proj", "k_proj", "v_proj")


def packed_adapter(arena: SharedSegment, rank: int) -> p.AdapterEntry:
    """A random rank-``rank`` q/k/v adapter (one layer) packed at the arena's start as the LoRA pool
    packs a host copy (``adapters/lora_layout.py``): per projection, its A rows then its B^T rows."""
    per_slice = 2 * rank * HIDDEN
    packed_elems = per_slice * len(PROJS)
    packed = arena.tensor()[: packed_elems * 4].view(torch.float32)
    packed.copy_(torch.randn(packed_elems) / HIDDEN**0.5)
    return p.AdapterEntry(
        1, 0, 0, 1, packed_elems,
        {i: (i * per_slice, rank, HIDDEN, HIDDEN) for i in range(len(PROJS))},
        [[rank] * len(PROJS)], [[1.0] * len(PROJS)],
    )  # fmt: skip


def time_helpers(pool: HelperPool, entry: p.AdapterEntry, n: int, tokens: int, reps: int) -> float:
    """Seconds per job over ``reps``, rows split across helpers 0..n-1."""
    for h in range(n):
        assert pool.send(h, p.frame(b"R", entry.to_json()))
        assert pool.send(h, p.frame(b"S", f"[[1, 0, {tokens}]]"))
    x = torch.randn(tokens, HIDDEN)
    width = HIDDEN * len(PROJS)
    out = torch.zeros(tokens, width)
    x_shm = pool.data.tensor()[: tokens * HIDDEN * 4].view(torch.float32).view(tokens, HIDDEN)
    best = float("inf")
    for rep in range(reps + 1):  # the first one warms up
        t0 = time.perf_counter()
        x_shm.copy_(x)
        jobs = {h: pool.submit(h, 0, 0, tokens * h // n, tokens * (h + 1) // n, tokens, 0) for h in range(n)}
        assert pool.wait(jobs, time.monotonic() + 60) == set()  # type: ignore[arg-type]
        res = pool.data.array(np.float32, tokens * width, pool.layout.out_offset).reshape(tokens, width)
        out += torch.from_numpy(res)
        if rep:
            best = min(best, time.perf_counter() - t0)
    return best


def time_torch(threads: int, rank: int, tokens: int, reps: int) -> float:
    torch.set_num_threads(threads)
    x = torch.randn(tokens, HIDDEN)
    ws = [(torch.randn(rank, HIDDEN), torch.randn(rank, HIDDEN)) for _ in PROJS]
    out = torch.zeros(tokens, HIDDEN * len(PROJS))
    best = float("inf")
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        for j, (a, bt) in enumerate(ws):
            out[:, j * HIDDEN : (j + 1) * HIDDEN] += (x @ a.T) @ bt
        if rep:
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-helpers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    arena = SharedSegment(3 * 2 * a.rank * HIDDEN * 4 + (1 << 20), "bench-arena")
    entry = packed_adapter(arena, a.rank)
    spec = p.ModelSpec(((HIDDEN, tuple((i, i * HIDDEN, HIDDEN) for i in range(len(PROJS)))),), HIDDEN)
    pool = HelperPool(a.max_helpers, arena, spec, p.DataLayout(a.tokens, HIDDEN, HIDDEN * len(PROJS)))
    pool.start()
    assert len(pool.wait_ready(120)) == a.max_helpers
    points = []
    try:
        for n in range(1, a.max_helpers + 1):
            th = time_helpers(pool, entry, n, a.tokens, a.reps)
            tt = time_torch(n, a.rank, a.tokens, a.reps)
            point = {
                "workers": n,
                "helpers_ms": th * 1e3,
                "helpers_tokens_per_s": a.tokens / th,
                "torch_threads_ms": tt * 1e3,
                "torch_threads_tokens_per_s": a.tokens / tt,
                "oversubscribed": n > cpus,
            }
            points.append(point)
            print(
                f"{n} workers: helpers {th * 1e3:7.2f} ms ({a.tokens / th:8.0f} tok/s)   "
                f"torch threads {tt * 1e3:7.2f} ms ({a.tokens / tt:8.0f} tok/s)"
                + ("   [oversubscribed]" if n > cpus else ""),
                flush=True,
            )
        profile = pool.profile_macs_per_ms()
    finally:
        pool.close()
    path = write_result(
        "cpu_lora_helpers",
        {
            "device": "cpu",
            "cpus": cpus,
            "shape": {
                "hidden": HIDDEN,
                "projections": list(PROJS),
                "rank": a.rank,
                "tokens": a.tokens,
                "dtype": "float32",
            },
            "reps": a.reps,
            "helper_profile_macs_per_ms": profile,
            "points": points,
            "note": f"this machine has {cpus} CPUs: points with more workers than that oversubscribe them",
        },
        a.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
