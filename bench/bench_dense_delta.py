"""Dense delta rows (``deltaserve.kernels.dense_delta``): one launch for every row's lm_head delta vs a loop per delta.

The lm_head half of a compressed full fine-tune's dense deltas for Llama-2-7B (``N`` = vocab 32000,
``K`` = hidden 4096, float16): ``out[r] += x[r] @ D_{slot(r)}^T`` for the logits rows of a decode step,
``D`` a ``[num_slots, N, K]`` table (``--num-slots``, default the largest ``--deltas``). Swept over:

    batch       1, 8, 64, 256 logits rows (``DeltaMeta.rows``, every row with a delta)
    popularity  spread: rows round-robin over 1, 8, 32 deltas (``--deltas``; 1 delta = Punica's
                "identical"), in step order, not grouped; distinct: every row its own delta (batch <=
                num_slots); uniform: ceil(sqrt(batch)) deltas; skewed: Zipf-1.5 draws over the slots.
                Points with more deltas than rows, and popularity points of one row, are skipped.

Implementations per point, timed with ``triton.testing.do_bench`` (median, L2 flushed):

    triton            ``dense_delta_rows(..., use_triton=True)``: the one Triton launch
    triton_graph      the same, replayed inside a CUDA graph (``do_bench_cudagraph``: no launch overhead)
    eager             what ``DeltaLmHead`` runs today: per used delta, ``out[rows] += x[rows] @ D^T`` in
                      float16 (index tensors built once per point, as the step holds them; not capturable)
    reference         ``dense_delta_rows_ref``: the same loop in float32 (upcast x and D, round twice),
                      index tensors built per call: the CPU path and the tests' oracle
    masked_all        every slot of the table, ``out.addmm_(x * mask[:, s], D_s^T)``: shape-only (capturable)
                      but reads all ``num_slots`` deltas whatever the step uses
    masked_all_graph  the same inside a CUDA graph

Each row reports the bytes the op must move and its fraction of the device-to-device copy bandwidth
measured in the same run (``common.copy_bandwidth``), 1.0 being the memory floor:

    bytes = 2 * N * K * (distinct deltas the rows use)     each used delta read once
          + 2 * T * K                                       read x
          + 2 * 2 * T * N                                   read + write out

(masked_all's own floor is ``2 * N * K * num_slots``; its rows use the same byte count so the columns
compare times.) The Triton op and masked_all are checked against the reference before they are timed.

    python3 -m bench.bench_dense_delta                    # full sweep: bench/results/dense_delta-<GPU>-<date>.json
    python3 -m bench.bench_dense_delta --batch 8,64 --deltas 8 --popularity spread
    python3 -m bench.bench_dense_delta --smoke            # CPU, Triton interpreter, tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

from bench import script_env

script_env.prepare()  # before triton's first import: --smoke runs the kernels in the CPU interpreter

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import bench_device, device_name, write_result  # noqa: E402
from deltaserve.kernels import dense_delta as dd  # noqa: E402
from deltaserve.kernels.sbmm import DeltaMeta  # noqa: E402

POPULARITY = ("spread", "distinct", "uniform", "skewed")
"""--popularity names (module docstring)."""
DTYPE = torch.float16


def row_slots(popularity: str, batch: int, deltas: int, num_slots: int, seed: int = 0) -> list[int] | None:
    """Slot of each of ``batch`` rows for one point, or None where the point is skipped."""
    rng = np.random.default_rng(seed)
    if popularity == "spread":
        return [i % deltas for i in range(batch)] if deltas <= min(batch, num_slots) else None
    if batch == 1:  # one row: every popularity is one delta, the spread point
        return None
    if popularity == "distinct":
        return [int(s) for s in rng.permutation(num_slots)[:batch]] if batch <= num_slots else None
    if popularity == "uniform":
        k = min(math.ceil(math.sqrt(batch)), num_slots)
        return [int(i) % k for i in rng.permutation(batch)]
    if popularity == "skewed":  # Zipf-1.5 over the slots: a few deltas take most rows
        p = 1.0 / np.arange(1, num_slots + 1) ** 1.5
        return [int(i) for i in rng.choice(num_slots, size=batch, p=p / p.sum())]
    raise AssertionError(popularity)


class Point:
    """One sweep point: inputs, metadata, the implementations and the byte count."""

    def __init__(self, table: torch.Tensor, slots: list[int], seed: int = 0) -> None:
        num_slots, n, k = table.shape
        device = table.device
        g = torch.Generator(device=device).manual_seed(seed)
        t = len(slots)
        self.table, self.meta = table, DeltaMeta.rows(slots, device)
        self.x = torch.randn(t, k, generator=g, device=device).to(DTYPE)
        self.out = torch.randn(t, n, generator=g, device=device).to(DTYPE)
        self.deltas = len(self.meta.slots)
        self.nbytes = 2 * n * k * self.deltas + 2 * t * k + 2 * 2 * t * n
        ids = torch.tensor(slots, device=device)
        self.groups = [(torch.tensor(toks, device=device), s) for s, toks in self.meta.slot_tokens]
        self.mask = (ids[:, None] == torch.arange(num_slots, device=device)[None, :]).to(DTYPE)  # [T, num_slots]

    def triton_fn(self) -> torch.Tensor:
        return dd.dense_delta_rows(self.x, self.out, self.table, self.meta, use_triton=True)

    def ref_fn(self) -> torch.Tensor:
        return dd.dense_delta_rows_ref(self.x, self.out, self.table, self.meta)

    def eager_fn(self) -> torch.Tensor:
        for rows, s in self.groups:
            self.out[rows] += self.x[rows] @ self.table[s].T
        return self.out

    def masked_fn(self) -> torch.Tensor:
        """Every slot: rows of other slots add x * 0 = 0 (exact), one rounding per slot's addmm."""
        for s in range(self.table.shape[0]):
            self.out.addmm_(self.x * self.mask[:, s : s + 1], self.table[s].T)
        return self.out

    def check(self) -> None:
        saved = self.out.clone()
        want = dd.dense_delta_rows_ref(self.x, saved.clone(), self.table, self.meta)
        torch.testing.assert_close(self.triton_fn(), want, rtol=1e-2, atol=1e-2)
        for fn in (self.eager_fn, self.masked_fn):  # masked_all rounds once, not twice
            self.out.copy_(saved)
            torch.testing.assert_close(fn(), want, rtol=1e-2, atol=1e-2)
        self.out.copy_(saved)


def random_table(num_slots: int, n: int, k: int, device: torch.device) -> torch.Tensor:
    """[num_slots, N, K] float16 deltas ~ N(0, 0.02), drawn one slot at a time (no float32 copy of it all)."""
    table = torch.empty(num_slots, n, k, dtype=DTYPE, device=device)
    g = torch.Generator(device=device).manual_seed(1)
    for s in range(num_slots):
        table[s] = torch.randn(n, k, generator=g, device=device).mul_(0.02).to(DTYPE)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--vocab", type=int, default=32000, help="N: lm_head rows (Llama-2-7B: 32000)")
    p.add_argument("--hidden", type=int, default=4096, help="K: hidden size (Llama-2-7B: 4096)")
    p.add_argument("--batch", default="1,8,64,256", help="comma-separated logits-row counts")
    p.add_argument("--deltas", default="1,8,32", help="comma-separated distinct-delta counts (spread points)")
    p.add_argument("--popularity", default=",".join(POPULARITY), help=f"comma-separated, of {', '.join(POPULARITY)}")
    p.add_argument("--num-slots", type=int, default=None, help="slots of the table (default: the largest --deltas)")
    p.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    p.add_argument("--no-masked", action="store_true", help="skip the masked-all-slots baseline")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes, no bandwidth")
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",") if b]
    delta_counts = [int(d) for d in args.deltas.split(",") if d]
    pops = [s for s in args.popularity.split(",") if s]
    for s in pops:
        if s not in POPULARITY:
            sys.exit(f"--popularity: {s!r}: want one of {', '.join(POPULARITY)}")
    if any(d < 1 for d in delta_counts) or any(b < 1 for b in batches) or min(args.vocab, args.hidden) < 1:
        sys.exit("--batch, --deltas, --vocab and --hidden take positive integers")

    device, bw, timer = bench_device(args.smoke, args.device, "bench_dense_delta.py")
    n, k = args.vocab, args.hidden
    graph = not args.smoke
    if args.smoke:
        n, k, batches, delta_counts = 100, 72, [1, 4], [1, 2, 4]
    num_slots = args.num_slots or max(delta_counts)

    print(f"N = {n}, K = {k}, {num_slots} slots, float16, launch by BLOCK_M {dd.LAUNCH}", flush=True)
    print(
        f"{'batch':>5} {'popularity':>10} {'deltas':>6} {'impl':>16} {'MB':>9} {'us':>9} {'GB/s':>8} {'x copy bw':>9}",
        flush=True,
    )
    rows = []
    table = random_table(num_slots, n, k, device)
    with torch.no_grad():
        for batch in batches:
            for pop in pops:
                for nd in delta_counts if pop == "spread" else [None]:
                    slots = row_slots(pop, batch, nd or 0, num_slots)
                    if slots is None:
                        continue
                    pt = Point(table, slots)
                    pt.check()
                    impls: list[tuple[str, Callable[[], object], bool]] = [("triton", pt.triton_fn, False)]
                    if graph:
                        impls.append(("triton_graph", pt.triton_fn, True))
                    impls.append(("eager", pt.eager_fn, False))
                    if not args.no_reference:
                        impls.append(("reference", pt.ref_fn, False))
                    if not args.no_masked:
                        impls.append(("masked_all", pt.masked_fn, False))
                        if graph:
                            impls.append(("masked_all_graph", pt.masked_fn, True))
                    for impl, fn, in_graph in impls:
                        sec = timer(fn, in_graph)
                        row = {"batch": batch, "popularity": pop, "deltas": pt.deltas, "impl": impl,
                               "block_m": pt.meta.block_m, "launch": dd.launch_config(pt.meta), "bytes": pt.nbytes,
                               "us": sec * 1e6,
                               "GBps": pt.nbytes / sec / 1e9,
                               "fraction_of_copy_bw": None if bw is None else pt.nbytes / sec / bw}  # fmt: skip
                        rows.append(row)
                        print(
                            f"{batch:>5} {pop:>10} {pt.deltas:>6} {impl:>16} {pt.nbytes / 1e6:>9.2f} "
                            f"{row['us']:>9.1f} {row['GBps']:>8.1f} {row['fraction_of_copy_bw'] or 0:>9.2f}",
                            flush=True,
                        )
                    del pt
    path = write_result("dense_delta", {
        "device": device_name(device), "shape": "smoke" if args.smoke else "llama-2-7b lm_head",
        "N": n, "K": k, "num_slots": num_slots, "dtype": "float16",
        "launch": {str(bm): cfg for bm, cfg in dd.LAUNCH.items()},
        "copy_bandwidth_GBps": None if bw is None else bw / 1e9,
        "timer": "host wall clock (smoke)" if args.smoke else "triton.testing.do_bench median, L2 flushed "
                 "(*_graph: do_bench_cudagraph median)",
        "rows": rows,
    }, args.out)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
