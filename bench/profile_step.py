"""Where a decode step's time goes: torch.profiler over ``Executor.step`` (Llama-2-7B shape,
random weights, KV length 512), printing the top operators by host and device time.

    python3 -m bench.profile_step [--batch 1] [--steps 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import write_random_model_dir  # noqa: E402
from bench.decode_step import bench_batch  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model_dir(args.shape, Path(tmp) / args.shape)
        ex = Executor(model_dir, device="cuda:0", dtype="float16", kv_cache_bytes=args.kv_cache_bytes)
        bench_batch(ex, args.batch, 512, 5, 3, first_id=1)  # warm up
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            times = bench_batch(ex, args.batch, 512, args.steps, 0, first_id=100000)
    print(f"batch {args.batch}: step ms {[round(t * 1e3, 2) for t in times]}")
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=25))
    print(table.table(sort_by="self_device_time_total", row_limit=12))


if __name__ == "__main__":
    main()
