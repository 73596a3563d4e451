"""Launch sweep of the SGMV expand (``kernels/lora/sgmv.py``): BLOCK_N x num_warps x column steps a
program, over the four adapted modules of a Llama-2-7B layer (qkv 3 x 4096, o 4096, gate_up 2 x 11008,
down 4096), one adapter of rank 16 on a prefill chunk of ``--tokens`` tokens (one segment), fp16.

Each point times ``sgmv_expand`` alone from v (the split shrink's float32 partials when the chunk is
short enough for ``sgmv_split`` to split it, as in a served step) inside a CUDA graph
(``common.time_cuda``), µs per layer (the four modules), and its fraction of the copy bandwidth for the
bytes it must move: out read and written, B read once. The configs/launch.json entry is chosen from
this table.

    python3 -m bench.sgmv_expand_sweep [--tokens 32,256,512] [--block-n 64,128,256] [--warps 4,8]
        [--steps 1,2,4,8] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from unittest import mock

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.bench_lora import StackPoint  # noqa: E402
from bench.common import copy_bandwidth, device_name, git_commit, time_cuda, write_result  # noqa: E402
from deltaserve.kernels.lora import sgmv  # noqa: E402

MODULES = {
    "qkv": (4096, (4096, 4096, 4096)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (11008, 11008)),
    "down": (11008, (4096,)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="32,256,512")
    p.add_argument("--block-n", default="64,128,256")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--steps", default="1,2,4,8")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    device = torch.device("cuda:0")
    bw = copy_bandwidth(device)
    rows = []
    for tokens in ints(args.tokens):
        points = {m: StackPoint(i, o, "16", 1, "identical", "prefill", tokens, device) for m, (i, o) in MODULES.items()}
        vs = {}
        for m, pt in points.items():
            st, meta = pt.stack, pt.meta
            split = sgmv.sgmv_split(st.in_dim, meta.num_tiles, tokens, st.num_slices, st.r_max, device)
            if split > 1:
                vs[m] = sgmv.sgmv_shrink_partials(pt.x, st, meta, split)
            else:
                vs[m] = torch.empty(st.num_slices, tokens, st.r_max, dtype=pt.x.dtype, device=device)
                sgmv.sgmv_shrink(pt.x, st, meta, vs[m])
        nbytes = sum(2 * (2 * tokens * sum(pt.stack.out_dims) + 16 * sum(pt.stack.out_dims)) for pt in points.values())
        want = None
        start = [pt.out.clone() for pt in points.values()]
        for block_n, warps, steps in itertools.product(ints(args.block_n), ints(args.warps), ints(args.steps)):
            cfg = {**sgmv._EXPAND, "BLOCK_N": block_n, "num_warps": warps}
            with mock.patch.dict(sgmv._EXPAND, cfg), mock.patch.object(sgmv, "sgmv_col_steps", lambda *_, n=steps: n):

                def layer() -> None:
                    for m, pt in points.items():
                        sgmv.sgmv_expand(vs[m], pt.stack, pt.meta, pt.out)

                for pt, o in zip(points.values(), start):  # each config's first call from the same out
                    pt.out.copy_(o)
                layer()
                got = [pt.out.clone() for pt in points.values()]
                if want is None:
                    want = got
                same = all(torch.equal(a, b) for a, b in zip(got, want))
                sec = time_cuda(layer, graph=True)
            row = {"tokens": tokens, "BLOCK_N": block_n, "num_warps": warps, "col_steps": steps, "us_per_layer": sec * 1e6,
                   "fraction_of_copy_bw": nbytes / sec / bw, "same_as_first": same}  # fmt: skip
            rows.append(row)
            print(f"{tokens:5d} tokens  BLOCK_N {block_n:4d}  warps {warps}  steps {steps}:  {sec * 1e6:8.1f} us/layer"
                  f"  {row['fraction_of_copy_bw']:.2f} bw  same {same}", flush=True)  # fmt: skip
    path = write_result(
        "sgmv_expand_sweep",
        {
            "device": device_name(device),
            "commit": git_commit(),
            "copy_bw": bw,
            "modules": MODULES,
            "rank": 16,
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
