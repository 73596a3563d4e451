"""SBMM per fused module: one CUDA launch for q|k|v (gate|up) vs one launch per HF projection.

The delta-aware linears of a Llama layer (``adapters/delta_layers.py``) hold fused modules: qkv (three
4096-row projections of Llama-2-7B), o, gate_up (two of 11008 rows) and down. ``sbmm_stacked`` runs a
module's slices in one launch of csrc/sbmm.cu; this times that against one launch per slice, per module
and per layer, decode rows (``DeltaMeta.rows``, captured over the step's real work tiles), 4-bit 2:4 group 64,
float16 with integral zeros (the half2 dequantisation), each timed replayed from a CUDA graph
(``triton.testing.do_bench_cudagraph``, median) as decode steps run. Bytes are the packed bytes of the
deltas the step reads; the fraction is of the device-to-device copy bandwidth measured in the same run.
``--variants plain@16,repacked@16,repacked@64`` times the fused launch over pools of each slot layout
(``DeltaWeights.layout``: the format's words, or kernels/sbmm/repack.py's fragment order) with work tiles
of at most that many tokens (``max_block_m``; the worker's captured decode steps use 64, ``GRAPH_TILE``), old against new
in one run.

``--copies-only`` builds the op with its math compiled out (``-DSBMM_NO_COMPUTE``; no result check): what the
memory side of each layout reaches alone.

``--with-base`` puts each module's base matmul (dense fp16 weights of its shape, ``torch.matmul``) before its
launch, as a delta linear runs them, and also times the matmul alone: ``adds_us`` is what the delta adds to the
module. ``--padded`` captures each launch over ``DeltaMeta.rows``' whole tile table (a row per decode row, most
of them padding, as the worker's graphs of a batch bucket hold) instead of the step's real tiles only.

    python3 -m bench.sbmm_fused [--points 64x8,64x1,8x8,16x8,1x1] [--variants repacked@64] [--per-slice]
        [--copies-only] [--with-base] [--padded] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import LLAMA2_7B_MODULES as MODULES  # noqa: E402
from bench.common import copy_bandwidth, device_name, random_packed_linear, write_result  # noqa: E402
from deltaserve.kernels import sbmm as S  # noqa: E402
from deltaserve.kernels.sbmm import DeltaMeta, make_delta_weights  # noqa: E402

SLOTS = 8
"""Delta slots per pool (each its own memory; the first ``deltas`` of a point are read)."""


def unique_deltas(out_f: int, in_f: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [random_packed_linear(out_f, in_f, 4, True, 64, g).to("cuda") for _ in range(4)]


def pool(unique: list, layout: str):
    return make_delta_weights([unique[s % 4] for s in range(SLOTS)], layout=layout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="64x8,64x1,16x8,8x8,1x1", help="ROWSxDELTAS, comma-separated")
    p.add_argument("--variants", default="repacked@64", help="LAYOUT@TILE_CAP, comma-separated (plain / repacked)")
    p.add_argument("--per-slice", action="store_true", help="also time one launch per projection")
    p.add_argument("--copies-only", action="store_true", help="the op built without its math (-DSBMM_NO_COMPUTE)")
    p.add_argument("--with-base", action="store_true", help="each module's base matmul before its launch")
    p.add_argument(
        "--padded", action="store_true", help="capture over DeltaMeta.rows' whole table (a tile row per row)"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import triton.testing

    dev = torch.device("cuda:0")
    bw = copy_bandwidth(dev)
    if args.copies_only:
        S.cuda_ext.NVCC_FLAGS = (*S.cuda_ext.NVCC_FLAGS, "-DSBMM_NO_COMPUTE")
    lib = S.cuda_ext.library("sbmm")
    if lib is None:
        raise SystemExit(f"the CUDA SBMM op is unavailable: {S.cuda_ext.unavailable('sbmm')}")
    variants = [(v.split("@")[0], int(v.split("@")[1])) for v in args.variants.split(",")]
    layouts = sorted({lay for lay, _ in variants})
    uniques = {
        m: [unique_deltas(o, i, 31 * k + j) for j, o in enumerate(outs)]
        for k, (m, (i, outs)) in enumerate(MODULES.items())
    }
    pools = {lay: {m: [pool(u, lay) for u in us] for m, us in uniques.items()} for lay in layouts}
    for lay in layouts:
        assert all(w.layout == lay for ws in pools[lay].values() for w in ws), f"pools did not take layout {lay}"
    base_w = (
        {m: torch.randn(sum(outs), in_f, device=dev).half() * 0.02 for m, (in_f, outs) in MODULES.items()}
        if args.with_base
        else {}
    )
    rows = []
    for point, lay, cap in [(pt, lay, cap) for pt in args.points.split(",") for lay, cap in variants]:
        n_rows, n_deltas = (int(v) for v in point.split("x"))
        meta = DeltaMeta.rows(sorted(i % n_deltas for i in range(n_rows)), dev, max_block_m=cap)
        # Captured with the step's real tiles only, or (--padded) over ``rows``' table of one row per decode
        # row: the worker's graphs hold min(rows, max-deltas + rows / tile) (``DeltaPool.graph_tiles``).
        if not args.padded:
            meta = dataclasses.replace(meta, tiles=meta.tiles[: meta.num_tiles], grid_tiles=meta.num_tiles)
        layer = {"per_slice": 0.0, "fused": 0.0, "base": 0.0}
        for m, (in_f, outs) in MODULES.items():
            ws = pools[lay][m]
            x = torch.randn(n_rows, in_f, device=dev).half()
            out = torch.randn(n_rows, sum(outs), device=dev).half()
            slices = [(w, sum(outs[:j])) for j, w in enumerate(ws)]
            fused = S.sbmm_stacked_cuda(x, out.clone(), slices, meta)
            ref = out.clone()
            for w, c in slices:
                S.sbmm_ref(x, ref[:, c : c + w.out_features], w, meta)
            if not args.copies_only:  # the reference's sum order differs: close, not equal
                torch.testing.assert_close(fused, ref, rtol=2e-3, atol=2e-3)

            def per_slice() -> None:
                for w, c in slices:
                    S.launch_cuda(lib, x, out[:, c : c + w.out_features], [(w, 0)], meta)

            torch.cuda.synchronize()
            t_apart = (
                triton.testing.do_bench_cudagraph(per_slice, rep=60, return_mode="median") * 1e3
                if args.per_slice
                else float("nan")
            )

            def fused() -> None:
                if args.with_base:
                    torch.matmul(x, base_w[m].T, out=out)
                S.launch_cuda(lib, x, out, slices, meta)

            t_fused = triton.testing.do_bench_cudagraph(fused, rep=60, return_mode="median") * 1e3
            t_base = (
                triton.testing.do_bench_cudagraph(
                    lambda: torch.matmul(x, base_w[m].T, out=out), rep=60, return_mode="median"
                )
                * 1e3
                if args.with_base
                else 0.0
            )
            nbytes = (
                n_deltas
                * sum(w.qvalues.numel() * 4 + w.qindices.numel() * 4 + 2 * w.scales.numel() * 2 for w in ws)
                // SLOTS
            )
            row = {
                "layout": lay,
                "tile_cap": cap,
                "module": m,
                "rows": n_rows,
                "deltas": n_deltas,
                "per_slice_us": t_apart,
                "fused_us": t_fused,
                "bytes": nbytes,
                "fused_fraction_of_copy_bw": nbytes / ((t_fused - t_base) * 1e-6) / bw,
            }
            if args.with_base:  # fused_us is the base matmul and the launch; adds_us the launch's share
                row.update(base_us=t_base, adds_us=t_fused - t_base)
            rows.append(row)
            layer["per_slice"] += t_apart
            layer["fused"] += t_fused
            layer["base"] += t_base
            print(
                f"{lay:8s}@{cap:<2d} {m:8s} {n_rows:3d} rows x {n_deltas} deltas: per slice "
                f"{t_apart:7.1f} us, fused {t_fused:7.1f} us"
                + (f" (base {t_base:7.1f} us, adds {t_fused - t_base:6.1f} us)" if args.with_base else "")
                + f" ({row['fused_fraction_of_copy_bw']:.2f} of copy bw)",
                flush=True,
            )
        layer_bytes = sum(r["bytes"] for r in rows[-len(MODULES) :])
        rows.append(
            {
                "layout": lay,
                "tile_cap": cap,
                "module": "layer",
                "rows": n_rows,
                "deltas": n_deltas,
                "per_slice_us": layer["per_slice"],
                "fused_us": layer["fused"],
                "bytes": layer_bytes,
                "fused_fraction_of_copy_bw": layer_bytes / ((layer["fused"] - layer["base"]) * 1e-6) / bw,
            }
        )
        if args.with_base:
            rows[-1].update(base_us=layer["base"], adds_us=layer["fused"] - layer["base"])
        print(
            f"{lay:8s}@{cap:<2d} layer    {n_rows:3d} rows x {n_deltas} deltas: per slice "
            f"{layer['per_slice']:7.1f} us, fused {layer['fused']:7.1f} us"
            + (
                f" (base {layer['base']:7.1f} us, adds {layer['fused'] - layer['base']:6.1f} us)"
                if args.with_base
                else ""
            )
            + f" ({rows[-1]['fused_fraction_of_copy_bw']:.2f} of copy bw)",
            flush=True,
        )
    path = write_result(
        "sbmm_fused",
        {
            "device": device_name(dev),
            "dtype": "float16",
            "bits": 4,
            "sparsity": "2:4",
            "group_size": 64,
            "copy_bandwidth_GBps": bw / 1e9,
            "variants": [f"{lay}@{cap}" for lay, cap in variants],
            "copies_only": args.copies_only,
            "with_base": args.with_base,
            "padded": args.padded,
            "modules": MODULES,
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
