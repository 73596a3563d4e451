"""Launch sweeps of the LoRA kernels over the four adapted modules of a Llama-2-7B layer (qkv 3 x 4096,
o 4096, gate_up 2 x 11008, down 4096), rank 16, fp16:

- ``--kernel sgmv`` (prefill expand, ``kernels/lora/sgmv.py``): BLOCK_N x num_warps x column steps a
  program, one adapter on a chunk of ``--tokens`` tokens (one segment), from v (the split shrink's
  float32 partials when ``sgmv_split`` splits the chunk, as in a served step);
- ``--kernel sgmv-shrink`` (prefill shrink): BLOCK_K x the split rule's ``min_programs_per_sm``, the
  same chunks; each point times the shrink alone and the shrink then the expand (the expand reads
  the partials the split picks, so a split's cost shows in both);
- ``--kernel mbgmv`` (decode expand, ``kernels/lora/mbgmv.py``): BLOCK_N x num_warps (one row a
  program), ``--rows`` decode rows on one adapter (identical) or one each (distinct), from the MBGMV
  shrink's partials.

Each point times the kernels alone inside a CUDA graph (``common.time_cuda``), µs per layer (the four
modules), with its fraction of the copy bandwidth for the bytes it must move (expand: out read and
written, each distinct adapter's B read once; shrink: x read); every config's result is checked
equal to the first's, from the same out. The configs/launch.json entries are chosen from these tables.

    python3 -m bench.lora_launch_sweep --kernel sgmv [--tokens 32,256,512] [--block-n 64,128,256]
        [--warps 4,8] [--steps 1,2,4,8] [--out DIR]
    python3 -m bench.lora_launch_sweep --kernel sgmv-shrink [--tokens 16,32,...,2048] [--block-k 64,128,256]
        [--programs-per-sm 2,4,8,16] [--out DIR]
    python3 -m bench.lora_launch_sweep --kernel mbgmv [--rows 1,16,64,128] [--block-n 64,128,256]
        [--warps 1,2,4] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.bench_lora import StackPoint  # noqa: E402
from bench.common import LLAMA2_7B_MODULES as MODULES  # noqa: E402
from bench.common import copy_bandwidth, device_name, git_commit, time_cuda, write_result  # noqa: E402
from deltaserve.kernels.lora import mbgmv, sgmv  # noqa: E402

RANK = 16


def chunk_points(tokens: int, device: torch.device) -> dict[str, StackPoint]:
    """The modules' points of one chunk of ``tokens`` tokens on one adapter (one segment)."""
    return {m: StackPoint(i, o, str(RANK), 1, "identical", "prefill", tokens, device) for m, (i, o) in MODULES.items()}


def sgmv_points(tokens: int, device: torch.device) -> tuple[dict, dict]:
    """The modules' points of one chunk and the v each expand reads."""
    points = chunk_points(tokens, device)
    vs = {}
    for m, pt in points.items():
        st, meta = pt.stack, pt.meta
        split = sgmv.sgmv_split(st.in_dim, meta.num_tiles, tokens, st.num_slices, st.r_max, device)
        if split > 1:
            vs[m] = sgmv.sgmv_shrink_partials(pt.x, st, meta, split)
        else:
            vs[m] = torch.empty(st.num_slices, tokens, st.r_max, dtype=pt.x.dtype, device=device)
            sgmv.sgmv_shrink(pt.x, st, meta, vs[m])
    return points, vs


def sweep(
    points: dict, vs: dict, expand: Callable, configs: list[tuple], patch: Callable, nbytes: int, bw: float, label: dict
) -> list[dict]:
    """Times ``expand(v, stack, meta, out)`` over the modules under each config (``patch(config)``: the
    context managers that set it), from the same out for the equality check."""
    rows, want = [], None
    start = [pt.out.clone() for pt in points.values()]
    for cfg in configs:
        with contextlib.ExitStack() as patches:
            for cm in patch(cfg):
                patches.enter_context(cm)

            def layer() -> None:
                for m, pt in points.items():
                    expand(vs[m], pt.stack, pt.meta, pt.out)

            for pt, o in zip(points.values(), start):  # each config's first call from the same out
                pt.out.copy_(o)
            layer()
            got = [pt.out.clone() for pt in points.values()]
            want = got if want is None else want
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            sec = time_cuda(layer, graph=True)
        row = {
            **label,
            **cfg,
            "us_per_layer": sec * 1e6,
            "fraction_of_copy_bw": nbytes / sec / bw,
            "same_as_first": same,
        }
        rows.append(row)
        print(
            "  ".join(f"{k} {v}" for k, v in {**label, **cfg}.items())
            + f":  {sec * 1e6:8.1f} us/layer  {row['fraction_of_copy_bw']:.2f} bw  same {same}",
            flush=True,
        )
    return rows


def shrink_sweep(tokens: int, configs: list[dict], bw: float, device: torch.device) -> list[dict]:
    """Times the SGMV shrink alone and shrink + expand over the modules under each (BLOCK_K,
    min_programs_per_sm), each from the same out for the equality check."""
    points = chunk_points(tokens, device)
    start = [pt.out.clone() for pt in points.values()]
    nbytes = 2 * tokens * sum(i for i, _ in MODULES.values())
    rows, want = [], None
    for cfg in configs:
        with (
            mock.patch.dict(sgmv._SHRINK, {"BLOCK_K": cfg["BLOCK_K"]}),
            mock.patch.dict(sgmv.SGMV_SPLIT, {"min_programs_per_sm": cfg["min_programs_per_sm"]}),
        ):

            def shrink() -> None:
                for pt in points.values():
                    sgmv.sgmv_delta_shrink(pt.x, pt.stack, pt.meta)

            def both() -> None:
                for pt in points.values():
                    sgmv.sgmv_expand(sgmv.sgmv_delta_shrink(pt.x, pt.stack, pt.meta), pt.stack, pt.meta, pt.out)

            for pt, o in zip(points.values(), start):
                pt.out.copy_(o)
            both()
            got = [pt.out.clone() for pt in points.values()]
            want = got if want is None else want
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            splits = [
                sgmv.sgmv_split(pt.stack.in_dim, pt.meta.num_tiles, tokens, pt.stack.num_slices, pt.stack.r_max, device)
                for pt in points.values()
            ]
            sec, both_sec = time_cuda(shrink, graph=True), time_cuda(both, graph=True)
        row = {
            "tokens": tokens,
            **cfg,
            "splits": dict(zip(points, splits)),
            "shrink_us_per_layer": sec * 1e6,
            "shrink_fraction_of_copy_bw": nbytes / sec / bw,
            "shrink_expand_us_per_layer": both_sec * 1e6,
            "same_as_first": same,
        }
        rows.append(row)
        print(
            f"tokens {tokens} BLOCK_K {cfg['BLOCK_K']} programs/SM {cfg['min_programs_per_sm']} splits {splits}:  "
            f"shrink {sec * 1e6:7.1f} us/layer ({row['shrink_fraction_of_copy_bw']:.2f} bw)  "
            f"shrink + expand {both_sec * 1e6:7.1f}  same {same}",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=("sgmv", "sgmv-shrink", "mbgmv"), default="sgmv")
    p.add_argument("--tokens", default=None, help="sgmv: chunk lengths (default 32,256,512; shrink 16 to 2048)")
    p.add_argument("--rows", default="1,16,64,128", help="mbgmv: decode rows")
    p.add_argument("--popularity", default="identical,distinct", help="mbgmv: one adapter or one a row")
    p.add_argument("--block-n", default="64,128,256")
    p.add_argument("--warps", default=None, help="default 4,8 (sgmv) or 1,2,4 (mbgmv)")
    p.add_argument("--steps", default="1,2,4,8", help="sgmv: column steps a program")
    p.add_argument("--block-k", default="64,128,256", help="sgmv-shrink: input columns a reduction step")
    p.add_argument("--programs-per-sm", default="2,4,8,16", help="sgmv-shrink: the split rule's min_programs_per_sm")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    warps = ints(args.warps or ("4,8" if args.kernel == "sgmv" else "1,2,4"))
    device = torch.device("cuda:0")
    bw = copy_bandwidth(device)
    widths = sum(sum(o) for _, o in MODULES.values())
    rows: list[dict] = []
    if args.kernel == "sgmv-shrink":
        configs = [
            {"BLOCK_K": k, "min_programs_per_sm": p}
            for k, p in itertools.product(ints(args.block_k), ints(args.programs_per_sm))
        ]
        for tokens in ints(args.tokens or "16,32,64,128,256,512,1024,2048"):
            rows += shrink_sweep(tokens, configs, bw, device)
    elif args.kernel == "sgmv":
        for tokens in ints(args.tokens or "32,256,512"):
            points, vs = sgmv_points(tokens, device)
            configs = [
                {"BLOCK_N": n, "num_warps": w, "col_steps": s}
                for n, w, s in itertools.product(ints(args.block_n), warps, ints(args.steps))
            ]

            def patch(cfg: dict) -> list:
                launch = {**sgmv._EXPAND, "BLOCK_N": cfg["BLOCK_N"], "num_warps": cfg["num_warps"]}
                steps = cfg["col_steps"]
                return [
                    mock.patch.dict(sgmv._EXPAND, launch),
                    mock.patch.object(sgmv, "sgmv_col_steps", lambda *_: steps),
                ]

            nbytes = 2 * (2 * tokens * widths + RANK * widths)
            rows += sweep(points, vs, sgmv.sgmv_expand, configs, patch, nbytes, bw, {"tokens": tokens})
    else:
        for n_rows, pop in itertools.product(ints(args.rows), args.popularity.split(",")):
            points = {m: StackPoint(i, o, str(RANK), n_rows, pop, "decode", 1, device) for m, (i, o) in MODULES.items()}
            vs = {m: mbgmv.mbgmv_shrink_partials(pt.x, pt.stack, pt.meta) for m, pt in points.items()}
            adapters = n_rows if pop == "distinct" else 1
            configs = [{"BLOCK_N": n, "num_warps": w} for n, w in itertools.product(ints(args.block_n), warps)]

            def patch(cfg: dict) -> list:
                table = ((1 << 30, (1, 16, cfg["BLOCK_N"], cfg["num_warps"])),)
                return [mock.patch.object(mbgmv, "MB_EXPAND_LAUNCH", table)]

            nbytes = 2 * (2 * n_rows * widths + adapters * RANK * widths)
            rows += sweep(
                points, vs, mbgmv.mbgmv_expand, configs, patch, nbytes, bw, {"rows": n_rows, "popularity": pop}
            )
    path = write_result(
        "sgmv_shrink_sweep" if args.kernel == "sgmv-shrink" else f"{args.kernel}_expand_sweep",
        {
            "device": device_name(device),
            "commit": git_commit(),
            "copy_bw": bw,
            "modules": MODULES,
            "rank": RANK,
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
