"""Multi-LoRA serving costs through the real worker executor: decode steps with adapter rows, and
adapter loads host -> GPU pool.

1. Decode step, Llama-2-7B shape, fp16, batch 64, KV length 512, rank 16 on all seven projections:
   base only vs every row on 1 adapter vs 64 distinct adapters (Punica's "distinct"), each replayed
   from CUDA graphs and run eagerly. Target: 64 distinct <= 1.10x the base-only step.
   Each decode path of the LoRA kernels (``--paths``: ``fused``, one launch per module, and ``split``,
   MBGMV shrink then expand) gets its own executors in the same process, so their ratios to the base
   step come from one run (``rows_by_path``; ``rows_graphs`` / ``rows_eager`` are the first path's);
   ``--overlap on,off`` times each path's graphs captured with and without each module's shrinks
   running beside its base matmul (``kernels.lora.set_overlap``).
2. Adapter load time from host memory into pool pages (``to_gpu`` after the host copy is ready) for
   ranks 8..128 on all seven projections, and the disk -> host read for reference.

Adapters are PEFT directories of random weights (bench/common.py) placed through the same
``VariantOp``s the router sends.

    python3 -m bench.lora_decode_step [--batch 64] [--adapters 64] [--rank 16] [--paths fused,split] [--overlap on,off] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import (  # noqa: E402
    SHAPES,
    copy_bandwidth,
    device_name,
    write_random_lora_dir,
    write_random_model_dir,
    write_result,
)
from bench.decode_step import bench_batch  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.adapters.lora import projection_features  # noqa: E402
from deltaserve.kernels import lora as lora_kernels  # noqa: E402
from deltaserve.model.arch import ModelConfig  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402

SEVEN = tuple(projection_features(ModelConfig.from_dict(SHAPES["llama-2-7b"])))
"""Every adaptable projection of a Llama layer (the benchmark adapts all seven)."""


def place(ex: Executor, dirs: dict[int, Path], first_page: int) -> int:
    """Loads every adapter to host and GPU through one plan's ops; returns the next free page."""
    ops, page = [], first_page
    for aid, d in dirs.items():
        info = ex.inspect_variant(str(d))
        assert info.error is None, info.error
        ops.append(wire.VariantOp(aid, wire.TierOp.TO_HOST, str(d), []))
        ops.append(wire.VariantOp(aid, wire.TierOp.TO_GPU, "", list(range(page, page + info.num_blocks))))
        page += info.num_blocks
    ex.step(wire.StepPlan(step_id=999_999, adapter_ops=ops))
    return page


def decode_rows(ex: Executor, args, n_adapters: int, first_page: int) -> dict[str, tuple[float, float]]:
    """Case -> (median step time, median worker step floor), seconds (the floor: ``StepTiming.floor_us``)."""
    cases = {
        "base": [0] * args.batch,
        "1 adapter": [1] * args.batch,
        f"{n_adapters} distinct": [1 + i % n_adapters for i in range(args.batch)],
    }
    out = {}
    for k, (name, ids) in enumerate(cases.items()):
        floors: list[int] = []
        times = bench_batch(
            ex,
            args.batch,
            args.ctx,
            args.steps,
            args.warmup,
            first_id=(k + 1) * 100_000,
            adapter_ids=ids,
            first_block=first_page,
            floors=floors,
        )
        out[name] = (statistics.median(times), statistics.median(floors) / 1e6)
    return out


def load_times(ex: Executor, cfg: dict, root: Path, ranks: list[int], first_page: int) -> list[dict]:
    rows = []
    for j, r in enumerate(ranks):
        d = write_random_lora_dir(root / f"load-r{r}", cfg, r, SEVEN, seed=r)
        info = ex.inspect_variant(str(d))
        assert info.error is None, info.error
        aid = 10_000 + j
        pool = ex.lora_pool
        t0 = time.perf_counter()
        pool.to_host(aid, d)
        host = pool.wait_host(aid)
        t1 = time.perf_counter()
        pages = list(range(first_page, first_page + info.num_blocks))
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            pool.to_gpu(aid, pages)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t2)
            pool.drop_gpu(aid)
        pool.drop_host(aid)
        rows.append(
            {
                "rank": r,
                "bytes": host.nbytes,
                "num_blocks": info.num_blocks,
                "disk_to_host_ms": (t1 - t0) * 1e3,
                "host_to_gpu_ms": best * 1e3,
                "host_to_gpu_GBps": host.nbytes / best / 1e9,
            }
        )
        print(
            f"load rank {r:3d}: {host.nbytes / 2**20:7.1f} MiB  disk->host {rows[-1]['disk_to_host_ms']:7.1f} ms  "
            f"host->GPU {rows[-1]['host_to_gpu_ms']:6.2f} ms ({rows[-1]['host_to_gpu_GBps']:.1f} GB/s)",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--distinct-weights", type=int, default=8, help="weight files the adapters share (disk)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--load-ranks", default="8,16,32,64,128")
    p.add_argument("--max-lora-rank", type=int, default=128)
    p.add_argument("--paths", default="fused,split", help="LoRA decode paths to time, the first one also loads")
    p.add_argument(
        "--overlap",
        default="on",
        help="on / off / on,off (repeats allowed: on,off,on,off): graphs captured with each module's shrinks "
        "beside its base matmul (kernels.lora.set_overlap); each path is timed with each setting",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    paths = args.paths.split(",")
    for path in paths:
        if path not in lora_kernels.DECODE_PATHS:
            p.error(f"--paths: {path!r} is not one of {', '.join(lora_kernels.DECODE_PATHS)}")
    overlaps = []
    for word in args.overlap.split(","):
        if word not in ("on", "off"):
            p.error(f"--overlap: {word!r} is not on or off")
        overlaps.append(word == "on")
    device = torch.device("cuda:0")
    bw = copy_bandwidth(device)
    cfg = SHAPES[args.shape]
    results: dict = {}
    by_path: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = write_random_model_dir(args.shape, tmp / args.shape)
        weights = [
            write_random_lora_dir(tmp / "w" / f"{k}", cfg, args.rank, SEVEN, seed=k) / "adapter_model.safetensors"
            for k in range(args.distinct_weights)
        ]
        dirs = {
            aid: write_random_lora_dir(
                tmp / "loras" / f"a{aid}", cfg, args.rank, SEVEN, weights=weights[aid % len(weights)]
            )
            for aid in range(1, args.adapters + 1)
        }
        # Eager steps never overlap (kernels.lora.lora_linear_stacked): timed once per path.
        runs = [(path, ov, "graphs", args.batch) for path in paths for ov in overlaps]
        runs += [(path, overlaps[0], "eager", 0) for path in paths]
        repeats: collections.Counter[str] = collections.Counter()
        for path, ov, mode, graph_batch in runs:
            lora_kernels.set_decode_path(path)  # graphs are captured with it, in the Executor
            lora_kernels.set_overlap(ov)
            label = f"{path}, overlap {'on' if ov else 'off'}" if mode == "graphs" else path
            repeats[label] += 1
            label += f" #{repeats[label]}" if repeats[label] > 1 else ""  # a repeated setting
            ex = Executor(
                model_dir,
                device="cuda:0",
                dtype="float16",
                block_size=16,
                kv_cache_bytes=0,
                gpu_memory_utilization=0.92,
                cuda_graph_max_batch=graph_batch,
                max_lora_rank=args.max_lora_rank,
                max_loras_per_step=max(args.adapters, 1),
                max_deltas=0,
            )  # LoRA only: no delta slots reserved or wrappers
            first_page = place(ex, dirs, 0)
            times = decode_rows(ex, args, args.adapters, first_page)
            base = times["base"][0]
            rows = by_path.setdefault(label, {})[mode] = [
                {
                    "case": k,
                    "step_ms": v * 1e3,
                    "ratio_to_base": v / base,
                    "step_floor_ms": f * 1e3,
                    "ratio_to_step_floor": v / f,
                }
                for k, (v, f) in times.items()
            ]
            if mode not in results:
                results[mode] = rows
            for row in rows:
                print(
                    f"{label:18s} {mode:6s} batch {args.batch} {row['case']:12s}: {row['step_ms']:7.2f} ms "
                    f"({row['ratio_to_base']:.3f}x base, {row['ratio_to_step_floor']:.2f}x its floor "
                    f"{row['step_floor_ms']:.2f} ms)",
                    flush=True,
                )
            if "load" not in results:
                results["load"] = load_times(
                    ex, cfg, tmp, [int(r) for r in args.load_ranks.split(",")], first_page + 64
                )
            del ex
            torch.cuda.empty_cache()
    path = write_result(
        "lora_decode_step",
        {
            "device": device_name(device),
            "shape": args.shape,
            "dtype": "float16",
            "kv_len": args.ctx,
            "batch": args.batch,
            "adapters": args.adapters,
            "rank": args.rank,
            "targets": list(SEVEN),
            "max_lora_rank": args.max_lora_rank,
            "copy_bandwidth_GBps": bw / 1e9,
            "timed_steps": args.steps,
            "decode_paths": paths,
            "overlap": [("on" if ov else "off") for ov in overlaps],
            "rows_by_path": by_path,
            "rows_graphs": results["graphs"],
            "rows_eager": results["eager"],
            "load_rows": results["load"],
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
