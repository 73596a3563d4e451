"""The first eager steps of a fresh worker: does a served step wait for a Triton compile?

A step that runs eagerly (with a compressed delta's prompt: beyond the delta buckets of the mixed-step
graphs, ``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS``) launches attention kernels with compile-time arguments the captured graphs
do not (``worker/eager_warmup.py``). This builds the executor as the worker does (Llama-2-7B shape,
random weights, one 4-bit 2:4 delta, decode graphs on), its mixed-step graphs off so that the cases'
prompt steps run eagerly whatever their size (with them on, those of at most 512 tokens would replay a
graph, captured when the delta is registered: that is not what this measures), with an empty
Triton cache (``--warm-cache``: the machine's), reports its start-up time (the eager warm-up
included), then runs each case (``<decodes>x<prompt tokens>``: the decodes on the delta, beside a
new prompt on the delta every step) for a few steps and reports each step's wall time and the Triton
kernels compiled during the case (new entries in the cache directory). A first step far above the
later ones, with kernels compiled, is a compile inside a served step.

    python3 -m bench.eager_first_steps [--cases 0x8,0x48,0x159,3x48,8x159,0x300] [--steps 4] [--warm-cache]
    python3 -m bench.eager_first_steps --smoke     # tiny shape on the CPU: checks the script (nothing compiles)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

DEFAULT_CASES = "0x8,0x48,0x159,3x48,8x159,0x300"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated <decodes>x<prompt tokens>")
    p.add_argument("--steps", type=int, default=4, help="steps per case (the first may compile)")
    p.add_argument("--ctx", type=int, default=512, help="KV length of the decodes")
    p.add_argument("--warm-cache", action="store_true", help="keep the machine's Triton cache (default: an empty one)")
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (checks the script)")
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench/results)")
    p.add_argument("--suffix", default="", help="appended to the result's experiment name")
    return p.parse_args(argv)


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for spec in text.split(","):
        try:
            decodes, prompt = (int(x) for x in spec.split("x"))
        except ValueError:
            raise SystemExit(f"--cases: {spec!r} is not <decodes>x<prompt tokens>") from None
        if decodes < 0 or prompt < 2:
            raise SystemExit(f"--cases: {spec!r} needs decodes >= 0 and a prompt of at least 2 tokens")
        cases.append((decodes, prompt))
    return cases


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    cases = parse_cases(args.cases)
    cache = None
    if not args.warm_cache:  # before anything imports triton
        cache = Path(tempfile.mkdtemp(prefix="triton-cache-"))
        os.environ["TRITON_CACHE_DIR"] = str(cache)
    from bench import script_env

    script_env.prepare()  # deltaserve importable from pyworker/
    import torch

    from bench.common import SMOKE_SHAPE, device_name, shape_config, write_random_checkpoint, write_result
    from bench.decode_step import bench_batch
    from bench.delta_decode_step import make_delta_dirs
    from bench.delta_decode_step import place as place_deltas
    from bench.profile_step import DELTA_CONFIG
    from deltaserve.worker.executor import Executor

    if args.smoke:
        device, dtype, shape, ctx, kv_bytes = torch.device("cpu"), "float32", SMOKE_SHAPE, 16, 64 << 20
    else:
        if not torch.cuda.is_available():
            raise SystemExit("eager_first_steps.py needs a CUDA device (or --smoke)")
        device, dtype, shape, ctx, kv_bytes = torch.device("cuda:0"), "float16", "llama-2-7b", args.ctx, 0

    def entries() -> dict[str, list[str]]:  # cache entry -> the kernels it holds
        if cache is None or not cache.exists():
            return {}
        return {
            d.name: sorted(f.stem for f in d.glob("*.json") if not f.name.startswith("__")) for d in cache.iterdir()
        }

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = write_random_checkpoint(shape_config(shape), root / shape, seed=0, device=device.type)
        dirs = make_delta_dirs(base, root / "deltas", 1, 1, DELTA_CONFIG["bits"], True, DELTA_CONFIG["group_size"])
        batch = max(d + 1 for d, _ in cases)
        t0 = time.perf_counter()
        ex = Executor(base, device=str(device), dtype=dtype, block_size=16, kv_cache_bytes=kv_bytes,
                      gpu_memory_utilization=0.92, cuda_graph_max_batch=batch if device.type == "cuda" else 0,
                      cuda_graph_max_tokens=0, max_lora_rank=0, max_deltas=1)  # fmt: skip
        start_s = time.perf_counter() - t0
        place_deltas(ex, dirs, step_id=999_998)
        at_start = entries()
        print(f"executor started in {start_s:.1f} s; {len(at_start)} Triton cache entries", flush=True)
        for k, (decodes, prompt) in enumerate(cases):
            before = entries()
            times = bench_batch(ex, decodes, ctx, args.steps, 0, first_id=(k + 1) * 100_000,
                                adapter_ids=[1] * decodes, chunk=prompt, chunk_adapter=1)  # fmt: skip
            new = sorted(name for key, names in entries().items() if key not in before for name in names)
            rows.append({"decodes": decodes, "prompt": prompt, "step_ms": [t * 1e3 for t in times], "compiled": new})
            print(f"{decodes}x{prompt}: steps {[round(t * 1e3, 1) for t in times]} ms, compiled {new}", flush=True)
        if ex.delta_pool is not None:
            ex.delta_pool.close()
    payload = {
        "device": device_name(device),
        "shape": shape,
        "dtype": dtype,
        "kv_len": ctx,
        "delta_config": DELTA_CONFIG,
        "triton_cache": "machine's" if cache is None else "empty at start",
        "executor_start_s": start_s,
        "triton_entries_after_start": len(at_start),
        "cases": rows,
    }
    return write_result("eager_first_steps" + args.suffix, payload, args.out)


if __name__ == "__main__":
    main()
