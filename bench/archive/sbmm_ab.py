"""SBMM CUDA op A/B in one run on one device: this tree's kernel against csrc/sbmm.cu of commit 2c40788.

2c40788's kernel (its C ABI: one pool per launch, a separate split-K reduction launch) is built from a
copy of that file beside this tree's, and both run the four fused modules of a Llama-2-7B layer (qkv, o,
gate_up, down): the old kernel one launch per HF projection, the new one per projection and fused
(``sbmm_stacked``), decode rows with the worker's 16-token tiles, 4-bit 2:4 group 64, float16 with
integral zeros (half2), each timed replayed from a CUDA graph (``do_bench_cudagraph``, median).

    git show 2c40788:pyworker/deltaserve/csrc/sbmm.cu > /tmp/sbmm_2c40788.cu
    python3 -m bench.archive.sbmm_ab --old-source /tmp/sbmm_2c40788.cu [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
from pathlib import Path

import torch
import triton
import triton.testing

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import copy_bandwidth, device_name, random_packed_linear, write_result  # noqa: E402
from deltaserve.kernels import sbmm as S  # noqa: E402
from deltaserve.kernels.sbmm import DeltaMeta, make_delta_weights  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--old-source", type=Path, required=True, help="2c40788's csrc/sbmm.cu")
p.add_argument("--out", type=Path, default=None)
args = p.parse_args()
dev = torch.device("cuda:0")
bw = copy_bandwidth(dev)
print(f"copy bw {bw / 1e9:.0f} GB/s", flush=True)
cap = torch.cuda.get_device_capability()
old_so = "/tmp/old_sbmm.so"
subprocess.run(
    [
        "nvcc",
        "-O3",
        "-std=c++17",
        "-shared",
        "-Xcompiler",
        "-fPIC",
        f"-arch=sm_{cap[0]}{cap[1]}",
        "-o",
        old_so,
        str(args.old_source),
    ],
    check=True,
)
old = ctypes.CDLL(old_so)
old.deltaserve_sbmm.argtypes = (
    [ctypes.c_void_p] * 12 + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 8 + [ctypes.c_void_p]
)
new = S.cuda_ext.library("sbmm")
assert new is not None, S.cuda_ext.unavailable("sbmm")
SMS = torch.cuda.get_device_properties(dev).multi_processor_count


def old_split(meta, w):
    blocks = meta.num_tiles * triton.cdiv(w.out_features, 128)
    stages, want = w.in_features // 256, 4 * SMS
    split = 1
    while split < 16 and blocks * split < want and stages >= 4 * split:
        split *= 2
    return split


def old_launch(x, out, w, meta):
    split = old_split(meta, w)
    rows = meta.order.shape[0]
    ws = torch.empty((split, rows, w.out_features), dtype=torch.float32, device=dev) if split > 1 else None
    code = old.deltaserve_sbmm(
        x.data_ptr(),
        out.data_ptr(),
        None if ws is None else ws.data_ptr(),
        meta.order.data_ptr(),
        meta.tiles.data_ptr(),
        w.qvalues.data_ptr(),
        w.qindices.data_ptr(),
        w.scales.data_ptr(),
        w.zeros.data_ptr(),
        w.qvalues_offsets.data_ptr(),
        w.qindices_offsets.data_ptr(),
        w.group_offsets.data_ptr(),
        w.out_features,
        w.in_features,
        64,
        x.stride(0),
        out.stride(0),
        4,
        1,
        0,
        1,
        meta.tile_tokens,
        meta.grid_tiles,
        split,
        rows,
        torch.cuda.current_stream().cuda_stream,
    )
    assert code == 0, code


def pool(out_f, in_f, n, seed):
    g = torch.Generator().manual_seed(seed)
    uniq = [random_packed_linear(out_f, in_f, 4, True, 64, g) for _ in range(min(n, 4))]
    return make_delta_weights([uniq[s % len(uniq)].to(dev) for s in range(n)])


def timed(fn):
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


NSLOT = 8
MODULES = {
    "qkv": (4096, (4096, 4096, 4096)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (11008, 11008)),
    "down": (11008, (4096,)),
}
pools = {
    m: [pool(o, i, NSLOT, 31 * k + j) for j, o in enumerate(outs)] for k, (m, (i, outs)) in enumerate(MODULES.items())
}
rows = []
for rows_n, ndelta in ((64, 8), (64, 1), (8, 8), (1, 1), (16, 8)):
    req = sorted(i % ndelta for i in range(rows_n))
    meta = DeltaMeta.rows(req, dev, max_block_m=16)
    layer = {"old": 0.0, "new_per_slice": 0.0, "new_fused": 0.0}
    for m, (in_f, outs) in MODULES.items():
        ws = pools[m]
        x = torch.randn(rows_n, in_f, device=dev).half()
        out = torch.randn(rows_n, sum(outs), device=dev).half()
        cols = [sum(outs[:j]) for j in range(len(outs))]
        slices = list(zip(ws, cols))
        # correctness: fused == per-slice old kernel (same math; splits may differ -> tolerance)
        a = out.clone()
        S.launch_cuda(new, x, a, slices, meta)
        b = out.clone()
        for w, c in slices:
            old_launch(x, b[:, c : c + w.out_features], w, meta)
        err = (a.float() - b.float()).abs().max().item()
        t_old = timed(lambda: [old_launch(x, out[:, c : c + w.out_features], w, meta) for w, c in slices])
        t_ps = timed(lambda: [S.launch_cuda(new, x, out[:, c : c + w.out_features], [(w, 0)], meta) for w, c in slices])
        t_f = timed(lambda: S.launch_cuda(new, x, out, slices, meta))
        nbytes = sum(
            w.qvalues.numel() * 4 // NSLOT * ndelta
            + w.qindices.numel() * 4 // NSLOT * ndelta
            + 2 * w.scales.numel() * 2 // NSLOT * ndelta
            for w in ws
        )
        r = {
            "module": m,
            "rows": rows_n,
            "deltas": ndelta,
            "old_us": t_old,
            "new_per_slice_us": t_ps,
            "new_fused_us": t_f,
            "bytes": nbytes,
            "fused_frac_bw": nbytes / (t_f * 1e-6) / bw,
            "max_abs_diff": err,
        }
        rows.append(r)
        layer["old"] += t_old
        layer["new_per_slice"] += t_ps
        layer["new_fused"] += t_f
        print(
            f"{m:8s} {rows_n:3d}x{ndelta}: old {t_old:7.1f}  new/slice {t_ps:7.1f}  new fused {t_f:7.1f} us "
            f"({r['fused_frac_bw']:.2f} bw)  diff {err:.2e}",
            flush=True,
        )
    print(
        f"LAYER {rows_n}x{ndelta}: old {layer['old']:.1f}  new/slice {layer['new_per_slice']:.1f}  "
        f"new fused {layer['new_fused']:.1f} us",
        flush=True,
    )
path = write_result(
    "sbmm_ab",
    {
        "device": device_name(dev),
        "old": "2c40788",
        "dtype": "float16",
        "bits": 4,
        "sparsity": "2:4",
        "group_size": 64,
        "copy_bandwidth_GBps": bw / 1e9,
        "rows": rows,
    },
    args.out,
)
print(f"wrote {path}")
