"""Launch configurations of the Triton prefill attention (``kernels.paged_attention.paged_prefill``):
rows per program (``block_q`` x the head group), keys per tile (``block_n``), warps and pipeline
stages, each timed over prompts from an empty cache and checked against the torch reference.

Prefill attention grows with the square of the prompt: at 2,048 tokens the H200 ran it at ~130
TFLOP/s (``bench_paged_attention``), a fraction of the device's matmul peak, so long prompts pay for
it in TTFT. FLOPs count 4·D·H per visible (query, key) pair, as ``bench_paged_attention``.

    python3 -m bench.prefill_attention_sweep [--shape llama-2-7b] [--prompts 1x1024,1x2048,16x512]
        [--rows 64,128] [--block-n 32,64,128] [--warps 4,8] [--stages 1,2,3] [--out DIR]

Needs a CUDA GPU. Writes bench/results/prefill_attention_sweep-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import triton

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.bench_paged_attention import BLOCK_SIZE, HEADS, make_step, time_cuda  # noqa: E402
from bench.common import device_name, write_result  # noqa: E402
from deltaserve.kernels.paged_attention import PREFILL_STAGES, PREFILL_WARPS, paged_prefill  # noqa: E402
from deltaserve.model.attention import attention_metadata, paged_attention_ref  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-2-7b", choices=sorted(HEADS))
    p.add_argument("--prompts", default="1x1024,1x2048,16x512", help="NUMxLEN, comma separated")
    p.add_argument("--rows", default="64,128", help="rows per program (query tokens x head group)")
    p.add_argument("--block-n", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention_sweep needs a CUDA GPU")
    device = torch.device("cuda:0")
    heads, kv_heads, dim = HEADS[args.shape]
    group = triton.next_power_of_2(heads // kv_heads)
    scale = dim**-0.5
    configs = [
        (rows // group, bn, w, st)
        for rows, bn, w, st in itertools.product(
            ints(args.rows), ints(args.block_n), ints(args.warps), ints(args.stages)
        )
        if rows // group >= 1
    ]
    default = (64 // group, 64, PREFILL_WARPS, PREFILL_STAGES)
    results = []
    for spec in args.prompts.split(","):
        n, length = (int(x) for x in spec.split("x"))
        q, ck, cv, batch = make_step([(0, length)] * n, heads, kv_heads, dim, device, seed=length)
        flops = 4 * dim * heads * n * length * (length + 1) // 2
        meta = attention_metadata(batch, BLOCK_SIZE, None, backend="torch")
        ref = paged_attention_ref(q, ck, cv, batch, scale, meta=meta).float()
        args_ = (q, ck, cv, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.max_query_len, scale)
        rows = []
        for bq, bn, w, st in configs:

            def run(bq=bq, bn=bn, w=w, st=st):
                return paged_prefill(*args_, block_q=bq, block_n=bn, num_warps=w, num_stages=st)

            try:
                diff = (run().float() - ref).abs().max().item()
                ms = time_cuda(run, args.iters) * 1e3
            except Exception as exc:  # noqa: BLE001 (a config that does not compile is a row, not a crash)
                rows.append({"block_q": bq, "block_n": bn, "warps": w, "stages": st, "error": f"{type(exc).__name__}"})
                continue
            rows.append({"block_q": bq, "block_n": bn, "warps": w, "stages": st, "ms": ms,
                         "TFLOPs": flops / (ms / 1e3) / 1e12, "max_abs_diff": diff,
                         "default": (bq, bn, w, st) == default})  # fmt: skip
        ok = [r for r in rows if "ms" in r and r["max_abs_diff"] < 1e-2]
        best = min(ok, key=lambda r: r["ms"])
        base = next((r for r in ok if r["default"]), None)
        print(f"{args.shape} {spec}: default {base and round(base['ms'], 3)} ms ({base and round(base['TFLOPs'])} "
              f"TFLOP/s); best {best['ms']:.3f} ms ({best['TFLOPs']:.0f} TFLOP/s) at block_q {best['block_q']} "
              f"block_n {best['block_n']} warps {best['warps']} stages {best['stages']}", flush=True)  # fmt: skip
        for r in sorted(ok, key=lambda r: r["ms"])[:6]:
            print(f"    {r['ms']:.3f} ms {r['TFLOPs']:5.0f} TFLOP/s  bq {r['block_q']} bn {r['block_n']} w {r['warps']} "
                  f"st {r['stages']}")  # fmt: skip
        results.append({"prompts": spec, "flops": flops, "rows": rows})
        del q, ck, cv, batch, ref
        torch.cuda.empty_cache()
    payload = {"device": device_name(device), "shape": args.shape, "heads": [heads, kv_heads, dim],
               "block_size": BLOCK_SIZE, "dtype": "float16", "results": results}  # fmt: skip
    print(write_result("prefill_attention_sweep", payload, args.out))


if __name__ == "__main__":
    main()
