"""What a long delta prefill segment costs per slot layout: the dense dequantiser plain vs repacked, in one run.

A delta's prefill segment of ``dense_min_m`` tokens or more (``kernels/sbmm/dequant.py``) writes the delta
once as a dense ``[out, in]`` tensor (``dequantize_slot``) and adds ``x Δ̃^T`` with one cuBLAS matmul. Over a
repacked pool (``kernels/sbmm/repack.py``) csrc/sbmm_dequant.cuh reads the repacked words as they are; before
it, the slot was unpacked first (``DeltaWeights.packed``, timed here as ``unpack``). Per Llama-2-7B linear
shape and delta config, per layout:

    dequant        ``dequantize_slot`` of one slot (CUDA events, median), and its traffic (packed bytes read +
                   dense bytes written) over the device-to-device copy bandwidth measured in the same run
    segment        one dense segment of ``--tokens`` tokens through ``sbmm`` (dequantise + matmul), the op a
                   long prompt's prefill runs per linear
    unpack         (repacked only) ``DeltaWeights.packed``: what the old path paid before its dequantisation

Both layouts' dequantisations are checked equal to ``formats.packed_delta.dequantize`` bit for bit.
``per_7b_delta_ms`` sums a Llama-2-7B delta (32 layers of q, k, v, o, gate, up, down).

    python3 -m bench.sbmm_dequant [--configs 4b-2:4,2b-2:4] [--tokens 400] [--runs 20] [--out DIR]
    python3 -m bench.sbmm_dequant --smoke      # CPU (Triton interpreter), small shapes: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import copy_bandwidth, device_name, random_packed_linear, write_result  # noqa: E402
from bench.sbmm_store import CONFIGS, GROUP, LAYERS, PER_LAYER, SHAPES  # noqa: E402 (one owner of the shapes)
from deltaserve.formats.packed_delta import dequantize  # noqa: E402
from deltaserve.kernels.sbmm import DeltaMeta, dequantize_slot, make_delta_weights, sbmm  # noqa: E402
from deltaserve.worker.step_floor import device_seconds  # noqa: E402

LAYOUTS = ("plain", "repacked")


def timed_ms(fn, dev: torch.device, runs: int) -> float:
    """Median milliseconds per call after 3 warm-ups (``step_floor.device_seconds``: CUDA events on
    CUDA, else the wall clock)."""
    return statistics.median(device_seconds(fn, dev, runs, warmup=3)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="4b-2:4,2b-2:4", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--tokens", type=int, default=400, help="tokens of the dense prefill segment (default 400)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes, 2 runs: checks the script runs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke runs the Triton dequantiser on the CPU: set TRITON_INTERPRET=1")
    dev = torch.device("cpu" if args.smoke else "cuda:0")
    dtype = torch.float32 if args.smoke else torch.float16
    shapes = {k: (256, 512) for k in SHAPES} if args.smoke else SHAPES
    runs = 2 if args.smoke else args.runs
    tokens = 8 if args.smoke else args.tokens
    copy = copy_bandwidth(dev) / 1e9 if dev.type == "cuda" else None  # GB/s, read + write
    rows = []
    for cname in args.configs.split(","):
        bits, sparse = CONFIGS[cname]
        for sname, (out_f, in_f) in shapes.items():
            gen = torch.Generator().manual_seed(out_f + 7 * bits)
            p = random_packed_linear(out_f, in_f, bits, sparse, GROUP, gen).to(dev)
            want = dequantize(p, dtype)
            x = torch.randn(tokens, in_f, generator=gen).to(dtype).to(dev)
            meta = DeltaMeta.segments([tokens], [0], dev, dense_min_m=1)
            row: dict = {"config": cname, "group": GROUP, "linear": sname, "out": out_f, "in": in_f,
                         "tokens": tokens, "linear_bytes": p.nbytes()}  # fmt: skip
            traffic = p.nbytes() + out_f * in_f * want.element_size()
            for lay in LAYOUTS:
                w = make_delta_weights([p], dev, layout=lay)
                assert w.layout == lay, f"the pool did not take layout {lay}"
                scratch = torch.empty(out_f, in_f, dtype=dtype, device=dev)
                row[f"{lay}_exact"] = torch.equal(dequantize_slot(w, 0, dtype, out=scratch), want)
                ms = timed_ms(lambda w=w, s=scratch: dequantize_slot(w, 0, dtype, out=s), dev, runs)
                row[f"{lay}_dequant_ms"] = ms
                row[f"{lay}_dequant_copy_fraction"] = traffic / (ms * 1e-3) / 1e9 / copy if copy else None
                out = torch.zeros(tokens, out_f, dtype=dtype, device=dev)
                row[f"{lay}_segment_ms"] = timed_ms(lambda w=w, o=out: sbmm(x, o, w, meta), dev, runs)
                if lay == "repacked":
                    row["unpack_ms"] = timed_ms(lambda w=w: w.packed(0), dev, runs)
            row["repacked_over_plain_dequant"] = row["repacked_dequant_ms"] / row["plain_dequant_ms"]
            print(f"{cname:7s} {sname:8s} [{out_f}x{in_f}] dequant plain {row['plain_dequant_ms']:.3f} ms / repacked "
                  f"{row['repacked_dequant_ms']:.3f} ({row['repacked_over_plain_dequant']:.2f}x)  segment of {tokens}: "
                  f"{row['plain_segment_ms']:.3f} / {row['repacked_segment_ms']:.3f} ms  unpack {row['unpack_ms']:.3f} ms"
                  f"  exact {row['plain_exact']} / {row['repacked_exact']}", flush=True)  # fmt: skip
            rows.append(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    per_delta = {}
    for cname in args.configs.split(","):
        by = {r["linear"]: r for r in rows if r["config"] == cname}
        keys = [f"{lay}_{what}_ms" for lay in LAYOUTS for what in ("dequant", "segment")] + ["unpack_ms"]
        per_delta[cname] = {k: LAYERS * sum(n * by[s][k] for s, n in PER_LAYER.items()) for k in keys}
        print(f"{cname}: per 7B delta (ms) {per_delta[cname]}")
    if not all(r["plain_exact"] and r["repacked_exact"] for r in rows):
        raise SystemExit("a dequantisation differs from formats.packed_delta.dequantize")
    payload = {"device": device_name(dev), "runs": runs, "dtype": str(dtype), "copy_gbps": copy,
               "torch": torch.__version__, "rows": rows, "per_7b_delta_ms": per_delta}  # fmt: skip
    if not args.smoke:
        print(write_result("sbmm_dequant", payload, args.out))


if __name__ == "__main__":
    main()
