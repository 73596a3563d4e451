"""Prefill throughput through the real worker executor, next to its compute bound.

Llama-2-7B shape, random fp16 weights. Each case sends its prompts as new requests computed in
one step (``Executor.step``: batch building, forward, first sampled token back on the host) and
reports tokens/s. The compute bound is the step's FLOPs (every linear layer on every prompt
token, causal attention, lm_head on the last token of each prompt) divided by the dense fp16
matmul throughput measured in the same run (an 8192^3 ``torch.matmul``).

    python3 -m bench.prefill [--cases 1x2048,16x512]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import device_name, write_random_model_dir, write_result  # noqa: E402
from bench.plans import new_request  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """Dense fp16 matmul throughput of this device, in TFLOP/s."""
    a = torch.randn(n, n, dtype=torch.float16, device=device)
    b = torch.randn(n, n, dtype=torch.float16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def prefill_flops(ex: Executor, num_seqs: int, length: int) -> float:
    """FLOPs of one prefill step of ``num_seqs`` prompts of ``length`` tokens."""
    c = ex.config
    per_token_linear = (
        2
        * c.num_layers
        * (
            c.hidden_size * (c.q_size + 2 * c.kv_size)  # qkv
            + c.q_size * c.hidden_size  # o
            + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
        )
    )
    attention = num_seqs * c.num_layers * 2 * length * length * c.num_heads * c.head_dim  # causal QK^T + PV
    lm_head = 2 * num_seqs * c.hidden_size * c.vocab_size
    return num_seqs * length * per_token_linear + attention + lm_head


def time_prefill(ex: Executor, num_seqs: int, length: int, repeats: int) -> list[float]:
    blocks_per = -(-(length + 1) // ex.block_size)
    g = torch.Generator().manual_seed(length)
    times, step_id = [], 1
    for _ in range(repeats):
        new = [
            new_request(
                step_id * 1000 + i,
                torch.randint(3, ex.config.vocab_size, (length,), generator=g).tolist(),
                range(i * blocks_per, (i + 1) * blocks_per),
            )
            for i in range(num_seqs)
        ]
        torch.cuda.synchronize(ex.device)
        t0 = time.perf_counter()
        ex.step(wire.StepPlan(step_id=step_id, new_requests=new))
        times.append(time.perf_counter() - t0)
        ex.step(wire.StepPlan(step_id=step_id + 1, released=[r.req_id for r in new]))
        step_id += 2
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--cases", default="1x2048,16x512")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cuda:0")
    peak = matmul_tflops(device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model_dir(args.shape, Path(tmp) / args.shape)
        ex = Executor(
            model_dir,
            device="cuda:0",
            dtype="float16",
            kv_cache_bytes=8 << 30,
            max_num_batched_tokens=8192,
            cuda_graph_max_batch=0,
        )
        for case in args.cases.split(","):
            num_seqs, length = (int(x) for x in case.split("x"))
            times = time_prefill(ex, num_seqs, length, args.repeats)[1:]  # first: warm-up
            step = statistics.median(times)
            flops = prefill_flops(ex, num_seqs, length)
            bound = flops / (peak * 1e12)
            row = {
                "case": case,
                "tokens": num_seqs * length,
                "step_ms": step * 1e3,
                "tokens_per_s": num_seqs * length / step,
                "flops": flops,
                "compute_bound_ms": bound * 1e3,
                "ratio_to_compute_bound": step / bound,
                "achieved_TFLOPs": flops / step / 1e12,
            }
            rows.append(row)
            print(
                f"prefill {case}: {row['step_ms']:.2f} ms, {row['tokens_per_s']:.0f} tokens/s, "
                f"{row['achieved_TFLOPs']:.0f} TFLOP/s; compute bound {row['compute_bound_ms']:.2f} ms "
                f"({row['ratio_to_compute_bound']:.2f}x)",
                flush=True,
            )
    path = write_result(
        "prefill",
        {"device": device_name(device), "shape": args.shape, "dtype": "float16", "matmul_TFLOPs": peak, "rows": rows},
        args.out,
    )
    print(f"dense fp16 matmul: {peak:.0f} TFLOP/s; wrote {path}")


if __name__ == "__main__":
    main()
