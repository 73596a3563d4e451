"""Does running the LoRA kernels on a second stream, beside the base matmul, hide their cost at decode?

One Llama-2-7B layer's four adapted modules (qkv, o, gate_up, down), batch 64, rank 16 on all seven
projections (r_max 128, as the worker's pool), adapter rows at scattered offsets (``make_weights``),
8 layers of distinct weights replayed from one CUDA graph; µs per layer. Variants:

    base       the four base matmuls alone
    lora       the MBGMV shrink + expand of each module alone
    serial     base, then shrink + expand in place (what ``LoraLinear`` does)
    ov_shrink  the shrink on a side stream while the base matmul runs; the expand after both
               (bit for bit the serial result)
    ov_full    shrink + expand into a zeroed buffer on the side stream while the base matmul runs, then
               one add (an upper bound on what overlap can hide; rounds differently)

for Punica's distinct (64 adapters) and identical (one adapter) popularity. The worker's adapted
linears run ``ov_shrink`` in their CUDA graphs (``kernels.lora.lora_linear_stacked``); whole steps
gain more from it than this layer does (bench/README.md).

    python3 -m bench.lora_overlap [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import copy_bandwidth, device_name, write_result  # noqa: E402
from deltaserve.kernels import lora as L  # noqa: E402

HIDDEN, INTER, ROWS, RANK, LAYERS = 4096, 11008, 64, 16, 8
MODULES = [
    ("qkv", HIDDEN, (HIDDEN,) * 3),
    ("o", HIDDEN, (HIDDEN,)),
    ("gate_up", HIDDEN, (INTER, INTER)),
    ("down", INTER, (HIDDEN,)),
]
VARIANTS = ("base", "lora", "serial", "ov_shrink", "ov_full")


def stack_for(in_dim: int, outs: tuple[int, ...], req: list[int], g: torch.Generator, dev: torch.device) -> L.LoraStack:
    """One module's slices, every adapter of ``req`` in each, all rows in one flat pool (the worker's layout)."""
    used = sorted(set(req))
    total = RANK * len(used)
    per = []
    for out_dim in outs:
        adapters: list = [None] * len(req)
        for a in used:
            A = (torch.randn(RANK, in_dim, generator=g, device=dev) / math.sqrt(in_dim)).half()
            B = (0.01 * torch.randn(out_dim, RANK, generator=g, device=dev)).half()
            adapters[a] = (A, B, 2.0)
        per.append(L.make_weights(adapters, 128, total, perm=torch.randperm(total)))
    pools = [w.a_pool for w in per] + [w.b_pool for w in per]
    starts = list(itertools.accumulate([0] + [p.numel() for p in pools[:-1]]))
    n, pool = len(outs), torch.cat(pools)
    return L.LoraStack(pool, pool, torch.stack([w.a_offsets + starts[i] for i, w in enumerate(per)]),
                       torch.stack([w.b_offsets + starts[n + i] for i, w in enumerate(per)]),
                       torch.stack([w.rank for w in per]), torch.stack([w.scale for w in per]), in_dim, outs,
                       tuple(itertools.accumulate([0] + list(outs[:-1]))),
                       offset_align=min(w.offset_align for w in per))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import triton.testing

    dev = torch.device("cuda:0")
    bw = copy_bandwidth(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    side = torch.cuda.Stream(dev)
    results = []
    for popularity in ("distinct", "identical"):
        req = list(range(ROWS)) if popularity == "distinct" else [0] * ROWS
        meta = L.LoraMeta.mbgmv(req, dev)
        layers = [
            [
                (
                    (torch.randn(sum(outs), ind, generator=g, device=dev) * 0.02).half(),
                    torch.randn(ROWS, ind, generator=g, device=dev).half(),
                    torch.empty(ROWS, sum(outs), device=dev, dtype=torch.float16),
                    torch.zeros(ROWS, sum(outs), device=dev, dtype=torch.float16),
                    stack_for(ind, outs, req, g, dev),
                )
                for _, ind, outs in MODULES
            ]
            for _ in range(LAYERS)
        ]

        def run(variant: str) -> None:
            cur = torch.cuda.current_stream()
            for mods in layers:
                for w, x, out, d, st in mods:
                    if variant in ("base", "serial"):
                        torch.mm(x, w.t(), out=out)
                    if variant in ("lora", "serial"):
                        L.mbgmv_expand(L.mbgmv_shrink_partials(x, st, meta), st, meta, out)
                    elif variant == "ov_shrink":
                        side.wait_stream(cur)
                        with torch.cuda.stream(side):
                            part = L.mbgmv_shrink_partials(x, st, meta)
                        torch.mm(x, w.t(), out=out)
                        cur.wait_stream(side)
                        L.mbgmv_expand(part, st, meta, out)
                    elif variant == "ov_full":
                        side.wait_stream(cur)
                        with torch.cuda.stream(side):
                            d.zero_()
                            L.mbgmv_expand(L.mbgmv_shrink_partials(x, st, meta), st, meta, d)
                        torch.mm(x, w.t(), out=out)
                        cur.wait_stream(side)
                        out.add_(d)

        outputs = {}
        for variant in VARIANTS:
            run(variant)
            torch.cuda.synchronize()
            outputs[variant] = torch.cat([m[2].clone() for mods in layers for m in mods], dim=1)
            graph = torch.cuda.CUDAGraph()
            capture = torch.cuda.Stream(dev)
            capture.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(capture):
                with torch.cuda.graph(graph, stream=capture):
                    run(variant)
            torch.cuda.synchronize()
            us = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") * 1e3 / LAYERS
            results.append({"popularity": popularity, "variant": variant, "us_per_layer": us})
            print(f"{popularity:9s} {variant:9s} {us:7.1f} us / layer", flush=True)
        assert torch.equal(outputs["ov_shrink"], outputs["serial"]), "the overlapped shrink must give the same bits"
    path = write_result(
        "lora_overlap",
        {
            "device": device_name(dev),
            "dtype": "float16",
            "batch": ROWS,
            "rank": RANK,
            "r_max": 128,
            "layers_per_graph": LAYERS,
            "copy_bandwidth_GBps": bw / 1e9,
            "rows": results,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
