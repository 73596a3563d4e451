"""Multi-LoRA delta kernels (``deltaserve.kernels.lora``): SGMV / MBGMV vs gather+bmm vs the torch reference.

One LoRA-adapted projection of Llama-2-7B, float16, ``out += scale_a * (x A_a^T) B_a^T`` per
token (shrink + expand, ``lora_delta`` with one slice), adapter rows at element offsets in flat
pools (``make_weights``: scattered rows, ``offset_align`` 16). Swept over:

    dims        in x out of the projection: 4096x4096 (q/k/v/o, the default), 4096x11008 (gate/up),
                11008x4096 (down)

    rank        8, 16, 32, 64, 128, and "mixed" (ranks 8..128 cycled over the adapters, r_max 128:
                MBGMV loops to each row's own rank, the gather+bmm baseline pads to r_max)
    batch       1, 16, 64, 256 requests
    popularity  identical (one adapter), distinct (one each), uniform (ceil(sqrt(n)) adapters),
                skewed (Zipf-1.5 draws), as in Punica's tests (STYLE #21)
    mode        decode (one token per request: MBGMV) and prefill (``--prefill-len`` tokens per
                request, requests grouped by adapter into segments: SGMV)

Three implementations per point, timed with ``triton.testing.do_bench`` (median, L2 flushed):

    triton      ``lora_delta(..., use_triton=True)``: the two Triton launches (decode: the expand
                reads the shrink's float32 partials directly)
    gather_bmm  Punica's baseline: gather each token's padded A [r_max, 4096] and B [4096, r_max]
                from a dense stack, then two ``torch.bmm`` (skipped when the gathered copies would
                exceed ``--bmm-max-gb``)
    reference   ``lora_delta(..., use_triton=False)``: the torch reference (a loop per adapter)

Each row reports the bytes the op must move and its fraction of the device-to-device copy
bandwidth measured in the same run (``common.copy_bandwidth``), 1.0 being the memory floor:

    bytes = 2 * (T * in            read x
                 + 2 * T * out     read + write out
                 + sum over the distinct adapters a in the batch of rank_a * (in + out))   weights

(float16 = 2 bytes; the small rank-wide intermediate v is not counted). The Triton result is
checked against the reference before it is timed. ``--cudagraph`` adds the Triton path timed
inside a CUDA graph (no launch overhead; the decode step runs under graphs; the graph replays do
not flush L2, so points whose weights fit in L2 read partly from it: judge bandwidth on points
far above the L2 size, e.g. distinct batches of 64+). ``--parts`` adds the shrink
(``lora_shrink_triton``, bytes ``2 * (T * in + sum r_a * in)``) and the expand
(``lora_expand_triton``, bytes ``2 * (2 * T * out + sum r_a * out)``) timed alone, graphed when
``--cudagraph`` is given. ``--offset-align 1`` drops make_weights' alignment promise (the kernels
then use scalar loads, as for a pool whose row offsets may be odd).

``--stacked OUTS`` times one fused module instead of one projection: slices of widths ``OUTS``
(``4096,4096,4096``: Llama-2-7B qkv; ``11008,11008``: gate_up) over an input of each ``--dims``
entry's IN width, every slice with its own adapters (same ranks and popularity), all rows in ONE
flat pool with stacked tables (``LoraStack``). Implementations:

    stacked     ``lora_delta_stacked(..., use_triton=True)``: the default decode path (fused: 1 launch
                for the module, ``kernels/lora/fused.py``; prefill: 2)
    split       decode only: the same on the split decode path (MBGMV shrink + expand, 2 launches)
    per_slice   ``lora_delta(x, out, stack.as_slices(), ...)``: 2 launches per slice, same tables
    reference   ``lora_delta_stacked(..., use_triton=False)`` (per-slice torch references)

(``_graph`` variants with ``--cudagraph``; bytes as above summed over the slices with x counted
once.) The stacked result is checked against the per-slice path and the reference first.

    python3 -m bench.bench_lora                                    # full sweep, writes bench/results/lora-<GPU>-<date>.json
    python3 -m bench.bench_lora --ranks 16 --batch 64 --modes decode --cudagraph
    python3 -m bench.bench_lora --modes decode --popularity distinct --dims 4096x4096,11008x4096 \
        --cudagraph --parts --no-reference                         # decode bandwidth per kernel
    python3 -m bench.bench_lora --stacked 4096,4096,4096 --ranks 16 --batch 1,16,64 --modes decode \
        --popularity distinct --cudagraph --no-reference      # qkv module: stacked vs per-slice launches
    python3 -m bench.bench_lora --smoke     # CPU, Triton interpreter, tiny shapes: checks the script only
    python3 -m bench.bench_lora --smoke --stacked 4096,4096,4096   # the same for the stacked mode
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

from bench import script_env

script_env.prepare()  # before triton's first import: --smoke runs the kernels in the CPU interpreter

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import bench_device, device_name, write_result  # noqa: E402
from deltaserve.kernels.lora import (  # noqa: E402
    LoraMeta,
    LoraSlice,
    LoraStack,
    lora_delta,
    lora_delta_stacked,
    lora_expand_triton,
    lora_shrink_triton,
    make_weights,
    set_decode_path,
)

POPULARITY = ("identical", "distinct", "uniform", "skewed")
MIXED_RANKS = (8, 16, 32, 64, 128)
"""Ranks cycled over the adapters for ``--ranks mixed``."""


def request_adapters(popularity: str, n: int, rng: np.random.Generator) -> list[int]:
    """Adapter slot (0 .. n - 1) of each of ``n`` requests."""
    if popularity == "identical":
        return [0] * n
    if popularity == "distinct":
        return list(range(n))
    if popularity == "uniform":
        k = math.ceil(math.sqrt(n))
        return [i % k for i in range(n)]
    if popularity == "skewed":
        p = 1.0 / np.arange(1, n + 1) ** 1.5
        return [int(a) for a in rng.choice(n, size=n, p=p / p.sum())]
    raise ValueError(f"popularity {popularity!r}: want one of {', '.join(POPULARITY)}")


class Point:
    """One sweep point: inputs, the implementations and their byte counts."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        rank: str,
        batch: int,
        popularity: str,
        mode: str,
        prefill_len: int,
        bmm_max_bytes: float,
        offset_align: int | None,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        dtype = torch.float16
        rng = np.random.default_rng(seed)
        g = torch.Generator(device=device).manual_seed(seed)
        ranks = [int(rank)] * batch if rank != "mixed" else [MIXED_RANKS[i % len(MIXED_RANKS)] for i in range(batch)]
        r_max = max(ranks)
        req = request_adapters(popularity, batch, rng)
        used = sorted(set(req))
        adapters: list = [None] * batch
        for a in used:
            A = (torch.randn(ranks[a], in_dim, generator=g, device=device) / math.sqrt(in_dim)).to(dtype)
            B = (0.01 * torch.randn(out_dim, ranks[a], generator=g, device=device)).to(dtype)
            adapters[a] = (A, B, 2.0)
        total = sum(ranks[a] for a in used)
        self.weights = make_weights(adapters, r_max, total, perm=torch.randperm(total))
        if offset_align is not None:
            self.weights = dataclasses.replace(self.weights, offset_align=offset_align)
        if mode == "decode":
            self.meta = LoraMeta.mbgmv(req, device)
            token_adapter = req
        else:  # the scheduler groups a step's requests by adapter: one segment per adapter
            order = sorted(range(batch), key=lambda i: req[i])
            seg_adapter = [req[i] for i in order]
            self.meta = LoraMeta.sgmv([prefill_len] * batch, seg_adapter, device)
            token_adapter = [a for a in seg_adapter for _ in range(prefill_len)]
        t = self.meta.num_tokens
        self.tokens = t
        self.x = torch.randn(t, in_dim, generator=g, device=device).to(dtype)
        self.out = torch.randn(t, out_dim, generator=g, device=device).to(dtype)
        self.v = lora_shrink_triton(self.x, self.weights, self.meta)
        self.slices = [LoraSlice(0, out_dim, self.weights)]
        weight_rows = sum(ranks[a] for a in used)
        self.shrink_bytes = 2 * (t * in_dim + weight_rows * in_dim)
        self.expand_bytes = 2 * (2 * t * out_dim + weight_rows * out_dim)
        self.nbytes = self.shrink_bytes + self.expand_bytes

        # gather+bmm baseline: dense padded stacks, gathered per token.
        gathered = 2 * t * r_max * (in_dim + out_dim)
        self.bmm_fn: Callable[[], object] | None = None
        if gathered <= bmm_max_bytes:
            a_dense = torch.zeros(batch, r_max, in_dim, dtype=dtype, device=device)
            b_dense = torch.zeros(batch, out_dim, r_max, dtype=dtype, device=device)
            for a in used:
                A, B, _ = adapters[a]
                a_dense[a, : ranks[a]] = A
                b_dense[a, :, : ranks[a]] = B
            idx = torch.tensor(token_adapter, dtype=torch.long, device=device)
            scale = torch.full((t, 1, 1), 2.0, dtype=dtype, device=device)
            x, out = self.x, self.out

            def bmm() -> torch.Tensor:
                v = torch.bmm(x[:, None, :], a_dense[idx].transpose(1, 2))  # [T, 1, r_max]
                delta = torch.bmm(v, b_dense[idx].transpose(1, 2))  # [T, 1, out]
                return out.add_((scale * delta)[:, 0])

            self.bmm_fn = bmm

    def triton_fn(self) -> torch.Tensor:
        return lora_delta(self.x, self.out, self.slices, self.meta, use_triton=True)

    def shrink_fn(self) -> torch.Tensor:
        return lora_shrink_triton(self.x, self.weights, self.meta)

    def expand_fn(self) -> torch.Tensor:
        return lora_expand_triton(self.v, self.weights, self.meta, self.out)

    def ref_fn(self) -> torch.Tensor:
        return lora_delta(self.x, self.out, self.slices, self.meta, use_triton=False)

    def check(self) -> None:
        got = lora_delta(self.x, self.out.clone(), self.slices, self.meta, use_triton=True)
        want = lora_delta(self.x, self.out.clone(), self.slices, self.meta, use_triton=False)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        if self.bmm_fn is not None:
            saved = self.out.clone()
            base = self.bmm_fn()
            torch.testing.assert_close(base, want, rtol=2e-2, atol=2e-2)  # fp16 bmm rounds v
            self.out.copy_(saved)


class StackPoint:
    """One ``--stacked`` sweep point: a fused module of slices ``outs`` over one shared pool."""

    def __init__(
        self,
        in_dim: int,
        outs: tuple[int, ...],
        rank: str,
        batch: int,
        popularity: str,
        mode: str,
        prefill_len: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        dtype = torch.float16
        rng = np.random.default_rng(seed)
        g = torch.Generator(device=device).manual_seed(seed)
        ranks = [int(rank)] * batch if rank != "mixed" else [MIXED_RANKS[i % len(MIXED_RANKS)] for i in range(batch)]
        r_max = max(ranks)
        req = request_adapters(popularity, batch, rng)
        used = sorted(set(req))
        total = sum(ranks[a] for a in used)
        per_slice = []
        for out_dim in outs:  # each slice: its own adapters, rows scattered over its own pools
            adapters: list = [None] * batch
            for a in used:
                A = (torch.randn(ranks[a], in_dim, generator=g, device=device) / math.sqrt(in_dim)).to(dtype)
                B = (0.01 * torch.randn(out_dim, ranks[a], generator=g, device=device)).to(dtype)
                adapters[a] = (A, B, 2.0)
            per_slice.append(make_weights(adapters, r_max, total, perm=torch.randperm(total)))
        # ONE flat pool: every slice's A rows, then every slice's B^T rows; offsets shifted to match.
        pools = [w.a_pool for w in per_slice] + [w.b_pool for w in per_slice]
        starts = list(itertools.accumulate([0] + [p.numel() for p in pools[:-1]]))
        n = len(outs)
        pool = torch.cat(pools)
        self.stack = LoraStack(
            pool, pool, torch.stack([w.a_offsets + starts[i] for i, w in enumerate(per_slice)]),
            torch.stack([w.b_offsets + starts[n + i] for i, w in enumerate(per_slice)]),
            torch.stack([w.rank for w in per_slice]), torch.stack([w.scale for w in per_slice]),
            in_dim, tuple(outs), tuple(itertools.accumulate([0] + list(outs[:-1]))),
            offset_align=min(w.offset_align for w in per_slice))  # fmt: skip
        self.slices = self.stack.as_slices()
        if mode == "decode":
            self.meta = LoraMeta.mbgmv(req, device)
        else:  # the scheduler groups a step's requests by adapter: one segment per adapter
            self.meta = LoraMeta.sgmv([prefill_len] * batch, sorted(req), device)
        t = self.meta.num_tokens
        self.tokens = t
        self.x = torch.randn(t, in_dim, generator=g, device=device).to(dtype)
        self.out = torch.randn(t, sum(outs), generator=g, device=device).to(dtype)
        rows = sum(ranks[a] for a in used)
        self.nbytes = 2 * (t * in_dim + 2 * t * sum(outs) + rows * (n * in_dim + sum(outs)))

    def stacked_fn(self) -> torch.Tensor:
        return lora_delta_stacked(self.x, self.out, self.stack, self.meta, use_triton=True)

    def split_fn(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The stack on the split decode path (into ``out``, default the point's output)."""
        previous = set_decode_path("split")
        try:
            return lora_delta_stacked(self.x, self.out if out is None else out, self.stack, self.meta, use_triton=True)
        finally:
            set_decode_path(previous)

    def per_slice_fn(self) -> torch.Tensor:
        return lora_delta(self.x, self.out, self.slices, self.meta, use_triton=True)

    def ref_fn(self) -> torch.Tensor:
        return lora_delta_stacked(self.x, self.out, self.stack, self.meta, use_triton=False)

    def check(self) -> None:
        got = lora_delta_stacked(self.x, self.out.clone(), self.stack, self.meta, use_triton=True)
        per_slice = lora_delta(self.x, self.out.clone(), self.slices, self.meta, use_triton=True)
        want = lora_delta_stacked(self.x, self.out.clone(), self.stack, self.meta, use_triton=False)
        torch.testing.assert_close(got, per_slice, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        if self.meta.decode:
            torch.testing.assert_close(got, self.split_fn(self.out.clone()), rtol=2e-3, atol=2e-3)


def parse_dims(text: str) -> list[tuple[int, int]]:
    """``--dims``: comma-separated ``INxOUT`` pairs."""
    dims = []
    for item in (d for d in text.split(",") if d):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            sys.exit(f"--dims: {item!r}: want INxOUT with positive integers, e.g. 4096x11008")
        dims.append((int(parts[0]), int(parts[1])))
    return dims


def run_stacked(
    pt: StackPoint,
    mode: str,
    rank: str,
    batch: int,
    pop: str,
    args: argparse.Namespace,
    timer: Callable[[Callable[[], object], bool], float],
    bw: float | None,
) -> list[dict]:
    """Checks and times one ``--stacked`` point; prints and returns its rows."""
    pt.check()
    impls: list[tuple[str, Callable[[], object], bool]] = [
        ("stacked", pt.stacked_fn, False),
        ("per_slice", pt.per_slice_fn, False),
    ]
    if mode == "decode":
        impls.append(("split", pt.split_fn, False))
    if args.cudagraph:
        impls += [("stacked_graph", pt.stacked_fn, True), ("per_slice_graph", pt.per_slice_fn, True)]
        if mode == "decode":
            impls.append(("split_graph", pt.split_fn, True))
    if not args.no_reference:
        impls.append(("reference", pt.ref_fn, False))
    st = pt.stack
    shape = f"{st.in_dim}x" + "+".join(str(d) for d in st.out_dims)
    rows = []
    for impl, fn, graph in impls:
        sec = timer(fn, graph)
        row = {
            "in_dim": st.in_dim,
            "out_dims": list(st.out_dims),
            "mode": mode,
            "rank": rank,
            "batch": batch,
            "popularity": pop,
            "impl": impl,
            "graph": graph,
            "tokens": pt.tokens,
            "bytes": pt.nbytes,
            "us": sec * 1e6,
            "GBps": pt.nbytes / sec / 1e9,
            "fraction_of_copy_bw": None if bw is None else pt.nbytes / sec / bw,
        }
        rows.append(row)
        print(
            f"{shape:>10} {mode:>7} {rank:>5} {batch:>5} {pop:>10} {impl:>15} {pt.nbytes / 1e6:>8.2f} "
            f"{row['us']:>9.1f} {row['GBps']:>8.1f} {row['fraction_of_copy_bw'] or 0:>9.2f}",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--dims", default="4096x4096", help="comma-separated INxOUT projection shapes")
    p.add_argument("--ranks", default="8,16,32,64,128,mixed", help="comma-separated ranks, or 'mixed'")
    p.add_argument("--batch", default="1,16,64,256", help="comma-separated request counts")
    p.add_argument("--popularity", default=",".join(POPULARITY))
    p.add_argument("--modes", default="decode,prefill", help="decode (MBGMV) and/or prefill (SGMV)")
    p.add_argument("--prefill-len", type=int, default=16, help="tokens per request in prefill mode")
    p.add_argument("--bmm-max-gb", type=float, default=4.0, help="skip gather_bmm above this gathered size")
    p.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    p.add_argument("--cudagraph", action="store_true", help="also time the Triton path inside a CUDA graph")
    p.add_argument("--parts", action="store_true", help="also time the shrink and the expand kernels alone")
    p.add_argument(
        "--offset-align",
        type=int,
        default=None,
        help="override the weights' offset_align (1: no alignment promise, scalar loads)",
    )
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes, no bandwidth")
    p.add_argument(
        "--stacked",
        default=None,
        metavar="OUTS",
        help="time a fused module of slices OUTS (e.g. 4096,4096,4096) over each --dims IN: "
        "lora_delta_stacked vs the per-slice loop",
    )
    args = p.parse_args()
    ranks = [r for r in args.ranks.split(",") if r]
    batches = [int(b) for b in args.batch.split(",") if b]
    pops = [q for q in args.popularity.split(",") if q]
    modes = [m for m in args.modes.split(",") if m]
    dims = parse_dims(args.dims)
    for r in ranks:
        if r != "mixed" and not (r.isdigit() and int(r) >= 1):
            sys.exit(f"--ranks: {r!r} is neither a positive integer nor 'mixed'")
    for m in modes:
        if m not in ("decode", "prefill"):
            sys.exit(f"--modes: {m!r}: want decode and/or prefill")
    outs: tuple[int, ...] | None = None
    if args.stacked is not None:
        items = [o for o in args.stacked.split(",") if o]
        if not items or not all(o.isdigit() and int(o) >= 1 for o in items):
            sys.exit(f"--stacked: {args.stacked!r}: want comma-separated positive slice widths, e.g. 4096,4096,4096")
        outs = tuple(int(o) for o in items)

    device, bw, timer = bench_device(args.smoke, args.device, "bench_lora.py")
    if args.smoke:
        dims = [(64, 96)]
        ranks = [r for r in ranks if r != "mixed" and int(r) <= 16][:2] + ["mixed"] * ("mixed" in ranks)
        batches = [1, 4]
        args.prefill_len, args.cudagraph = min(args.prefill_len, 4), False
        if outs is not None:
            outs = tuple(min(o, 96 // (1 + i)) for i, o in enumerate(outs))  # unequal widths, as GQA qkv

    header = (
        f"{'dims':>10} {'mode':>7} {'rank':>5} {'batch':>5} {'popularity':>10} {'impl':>13} {'MB':>8} "
        f"{'us':>9} {'GB/s':>8} {'x copy bw':>9}"
    )
    print(header, flush=True)
    rows = []
    with torch.no_grad():
        for (in_dim, out_dim), mode, rank, batch, pop in itertools.product(dims, modes, ranks, batches, pops):
            if outs is not None:
                rows += run_stacked(
                    StackPoint(in_dim, outs, rank, batch, pop, mode, args.prefill_len, device),
                    mode,
                    rank,
                    batch,
                    pop,
                    args,
                    timer,
                    bw,
                )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            pt = Point(
                in_dim,
                out_dim,
                rank,
                batch,
                pop,
                mode,
                args.prefill_len,
                args.bmm_max_gb * 1e9,
                args.offset_align,
                device,
            )
            pt.check()
            impls: list[tuple[str, Callable[[], object] | None, bool, int]] = [
                ("triton", pt.triton_fn, False, pt.nbytes)
            ]
            if args.cudagraph:
                impls.append(("triton_graph", pt.triton_fn, True, pt.nbytes))
            if args.parts:
                impls += [
                    ("shrink", pt.shrink_fn, args.cudagraph, pt.shrink_bytes),
                    ("expand", pt.expand_fn, args.cudagraph, pt.expand_bytes),
                ]
            impls.append(("gather_bmm", pt.bmm_fn, False, pt.nbytes))
            if not args.no_reference:
                impls.append(("reference", pt.ref_fn, False, pt.nbytes))
            where = f"{in_dim}x{out_dim:<5} {mode:>7} {rank:>5} {batch:>5} {pop:>10}"
            for impl, fn, graph, nbytes in impls:
                row = {
                    "in_dim": in_dim,
                    "out_dim": out_dim,
                    "mode": mode,
                    "rank": rank,
                    "batch": batch,
                    "popularity": pop,
                    "impl": impl,
                    "graph": graph,
                    "tokens": pt.tokens,
                    "bytes": nbytes,
                }
                if fn is None:
                    row.update(us=None, GBps=None, fraction_of_copy_bw=None, skipped="gathered copy too big")
                    print(f"{where} {impl:>13}   skipped (--bmm-max-gb)")
                    rows.append(row)
                    continue
                sec = timer(fn, graph)
                row.update(
                    us=sec * 1e6, GBps=nbytes / sec / 1e9, fraction_of_copy_bw=None if bw is None else nbytes / sec / bw
                )
                rows.append(row)
                print(
                    f"{where} {impl:>13} {nbytes / 1e6:>8.2f} {row['us']:>9.1f} {row['GBps']:>8.1f} "
                    f"{row['fraction_of_copy_bw'] or 0:>9.2f}",
                    flush=True,
                )
            del pt
            if device.type == "cuda":
                torch.cuda.empty_cache()
    path = write_result("lora", {
        "device": device_name(device), "shape": "smoke" if args.smoke else "llama-2-7b", "dims": dims,
        "dtype": "float16", "prefill_len": args.prefill_len, "offset_align": args.offset_align, "stacked": outs,
        "copy_bandwidth_GBps": None if bw is None else bw / 1e9,
        "timer": "host wall clock (smoke)" if args.smoke else "triton.testing.do_bench median, L2 flushed",
        "rows": rows,
    }, args.out)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
