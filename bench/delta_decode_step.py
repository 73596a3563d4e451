"""Compressed-delta serving costs through the real worker executor: decode steps with delta rows, and a
delta's load host -> GPU slot (DeltaZip's decoupled forward: the base once, plus each row's delta).

1. Decode step, Llama-2-7B shape, fp16, batch 64, KV length 512, deltas 4-bit 2:4 (group 64) on every
   block linear plus dense fp16 embedding / lm_head / norm deltas (what ``deltaserve compress``
   writes): base only vs every row on 1 delta vs the batch spread over 8 deltas (row i on delta
   i % 8), each run eagerly (an executor without graphs) and replayed from CUDA graphs (a second
   executor; delta decode steps replay the delta graphs, captured when the delta is inspected).
   Target: 8 deltas <= 1.6x the base-only step, both eager (``target.ratio``: the cost the deltas
   add to the same execution path), and the same with both from graphs (``target.ratio_graphs``:
   what serving deltas costs against serving the base alone, as the worker runs decode).
2. Load of one delta from host memory into a free GPU slot (``to_gpu`` once the host copy is
   ready, best of 5), and the disk -> host read + validation + pinning for reference.

Deltas are random packed codes (``common.write_random_delta_dir``: a valid delta directory, no
compressor run); the base is a random fp16 checkpoint on disk (``common.write_random_checkpoint``;
a delta's lineage check reads the base's safetensors). Step times do not depend on the values.
Delta directories beyond ``--distinct-weights`` link to the same payload (disk); the executor runs
with ``DELTASERVE_DELTA_PIECE_SHARING=off``, so each delta id still gets its own host copy, its own
GPU slot and its own SBMM group (with sharing on, 8 ids over 2 payloads ran as 2 deltas: the results
before 2026-11-26 17:00 that name ``distinct_weights`` 2 and no ``piece_sharing`` measured that). Ops go through ``Executor.step`` as the
router sends them (``VariantOp`` to_host / to_gpu). LoRA is off (``--max-lora-rank 0``) unless asked.

    python3 -m bench.delta_decode_step [--shape llama-2-7b] [--batch 64] [--deltas 8] [--ctx 512]
        [--bits 4] [--sparsity 2:4] [--no-graphs] [--graph-tile N] [--workdir DIR] [--out DIR]
    python3 -m bench.delta_decode_step --smoke [--out DIR]    # tiny shape on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import (  # noqa: E402
    SMOKE_SHAPE,
    copy_bandwidth,
    device_name,
    shape_config,
    write_random_checkpoint,
    write_random_delta_dir,
    write_result,
)
from bench.decode_step import bench_batch  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.adapters import delta_pool  # noqa: E402
from deltaserve.adapters.delta_blocks import SHARING_ENV  # noqa: E402
from deltaserve.adapters.delta_pool import delta_gpu_bytes  # noqa: E402
from deltaserve.compress.delta_dir import MANIFEST, read_manifest  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402

TARGET_RATIO = 1.6
"""Target: the step with the batch spread over ``--deltas`` deltas <= this x the base-only step (eager)."""
SMOKE = {"batch": 4, "deltas": 2, "ctx": 16, "steps": 2, "warmup": 1}
"""``--smoke`` overrides (with ``SMOKE_SHAPE``, float32 on the CPU)."""


def make_delta_dirs(
    base: Path, root: Path, n: int, distinct: int, bits: int, sparse: bool, group_size: int
) -> dict[int, Path]:
    """Delta id (1..n) -> its directory; ``distinct`` of them hold their own random payload, the others
    a copy of one's manifest and a link to its payload."""
    dirs: dict[int, Path] = {}
    originals: list[Path] = []
    for k in range(min(distinct, n)):
        t0 = time.perf_counter()
        originals.append(write_random_delta_dir(base, root / f"w{k}", bits, sparse, group_size, seed=100 + k))
        print(f"random delta {k}: written in {time.perf_counter() - t0:.1f} s", flush=True)
    for aid in range(1, n + 1):
        src = originals[(aid - 1) % len(originals)]
        d = root / f"d{aid}"
        d.mkdir(parents=True)
        shutil.copyfile(src / MANIFEST, d / MANIFEST)
        payload = read_manifest(src)["payload"]["file"]
        (d / payload).symlink_to(src / payload)
        dirs[aid] = d
    return dirs


def place(ex: Executor, dirs: dict[int, Path], step_id: int) -> None:
    """Loads every delta to host and into a GPU slot through one plan's ops (what the router sends)."""
    ops = []
    for slot, (aid, d) in enumerate(dirs.items()):
        info = ex.inspect_variant(str(d), wire.VariantKind.DELTA)
        if info.error is not None:
            raise SystemExit(f"delta {aid} refused by the executor: {info.error}")
        ops.append(wire.VariantOp(aid, wire.TierOp.TO_HOST, str(d), [], wire.VariantKind.DELTA))
        ops.append(wire.VariantOp(aid, wire.TierOp.TO_GPU, "", [], wire.VariantKind.DELTA, slot))
    ex.step(wire.StepPlan(step_id=step_id, adapter_ops=ops))


def time_case(ex: Executor, args, ids: list[int], first_id: int) -> tuple[list[float], float]:
    """The timed steps (seconds) and their median worker floor (``StepTiming.floor_us``, seconds)."""
    floors: list[int] = []
    times = bench_batch(
        ex, args.batch, args.ctx, args.steps, args.warmup, first_id=first_id, adapter_ids=ids, floors=floors
    )
    return times, statistics.median(floors) / 1e6


def load_time(ex: Executor, path: Path, delta_id: int, sync) -> dict:
    """Disk -> host (read, validate, pin) once, then host -> a free GPU slot best of 5: until the copies
    have run (synchronised), and until ``to_gpu`` returns to the launching thread (``launch``: it queues
    the copies behind the stream's work and does not wait for them)."""
    pool = ex.delta_pool
    assert pool is not None
    t0 = time.perf_counter()
    pool.to_host(delta_id, path)
    host = pool.wait_host(delta_id)
    disk = time.perf_counter() - t0
    best = launch = float("inf")
    slot = min(set(range(pool.max_deltas)) - set(pool.slot_of.values()))  # the spare slot (the router picks it)
    for _ in range(5):
        sync()
        t1 = time.perf_counter()
        pool.to_gpu(delta_id, slot)
        launch = min(launch, time.perf_counter() - t1)
        sync()
        best = min(best, time.perf_counter() - t1)
        pool.drop_gpu(delta_id)
    pool.drop_host(delta_id)
    row = {
        "bytes": host.nbytes,
        "disk_to_host_ms": disk * 1e3,
        "host_to_gpu_ms": best * 1e3,
        "host_to_gpu_GBps": host.nbytes / best / 1e9,
        "host_to_gpu_launch_ms": launch * 1e3,
    }
    print(
        f"delta load: {host.nbytes / 2**20:.1f} MiB  disk->host {row['disk_to_host_ms']:.1f} ms  "
        f"host->GPU {row['host_to_gpu_ms']:.2f} ms ({row['host_to_gpu_GBps']:.1f} GB/s), "
        f"the launching thread's share {row['host_to_gpu_launch_ms']:.2f} ms",
        flush=True,
    )
    return row


def release(ex: Executor) -> None:
    """Stops the executor's loader threads; the caller drops its last reference, then ``free_device``."""
    for pool in (ex.delta_pool, ex.lora_pool):
        if pool is not None:
            pool.close()


def free_device(device: torch.device) -> None:
    """Collects released executors (their modules reference each other) and returns their GPU memory, so
    the next executor's automatic KV budget sees it free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--deltas", type=int, default=8, help="deltas the spread case uses (row i on delta i %% N)")
    p.add_argument("--distinct-weights", type=int, default=2, help="random payloads written (the rest link)")
    p.add_argument("--bits", type=int, choices=(2, 4), default=4)
    p.add_argument("--sparsity", choices=("2:4", "none"), default="2:4")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-lora-rank", type=int, default=0, help="0: LoRA off (the worker's LoRA pool not built)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--no-graphs", action="store_true", help="skip the steps replayed from CUDA graphs")
    p.add_argument(
        "--graph-tile", type=int, default=None,
        help="captured decode steps' SBMM tile cap (default: the worker's delta_pool.GRAPH_TILE): tilings compared",
    )  # fmt: skip
    p.add_argument(
        "--workdir", type=Path, default=None, help="where the checkpoint and deltas go (default: a temp dir)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny shape and batch on the CPU (checks the script runs)")
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape = SMOKE_SHAPE
        for k, v in SMOKE.items():
            setattr(args, k, v)
    if args.deltas < 1 or args.distinct_weights < 1 or args.batch < 1:
        raise SystemExit("--deltas, --distinct-weights and --batch must be >= 1")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    # Linked payloads save disk only: every delta id is its own delta, for this run alone (a test runs
    # main in its process, whose later tests must keep the default).
    tile = delta_pool.GRAPH_TILE if args.graph_tile is None else args.graph_tile
    with mock.patch.dict(os.environ, {SHARING_ENV: "off"}), mock.patch.object(delta_pool, "GRAPH_TILE", tile):
        return run(args)


def run(args: argparse.Namespace) -> Path:
    """The benchmark (module docstring) with parsed ``args``; returns the result file."""
    if args.smoke:
        device, dtype, bw = torch.device("cpu"), "float32", None
        sync = lambda: None  # noqa: E731
    else:
        if not torch.cuda.is_available():
            raise SystemExit("delta_decode_step.py needs a CUDA device (or --smoke for a CPU check of the script)")
        device, dtype = torch.device("cuda:0"), "float16"
        bw = copy_bandwidth(device)
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    config = shape_config(args.shape)
    sparse = args.sparsity == "2:4"
    spread = f"{args.deltas} deltas"
    cases = {
        "base": [0] * args.batch,
        "1 delta": [1] * args.batch,
        spread: [1 + i % args.deltas for i in range(args.batch)],
    }
    blocks_per_req = (args.ctx + args.steps + args.warmup + 1 + 15) // 16
    kv_bytes = 0
    if args.smoke:  # CPU: an explicit pool with room for one batch
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        block_bytes = config["num_hidden_layers"] * 2 * 16 * config["num_key_value_heads"] * head_dim * 4  # K+V fp32
        kv_bytes = (args.batch * blocks_per_req + 2) * block_bytes
    rows: list[dict] = []
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        base = write_random_checkpoint(
            config, root / args.shape, seed=0, device="cuda" if device.type == "cuda" else "cpu"
        )
        print(f"random {args.shape} checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
        dirs = make_delta_dirs(
            base, root / "deltas", args.deltas + 1, args.distinct_weights, args.bits, sparse, args.group_size
        )
        load_dir = dirs.pop(args.deltas + 1)  # the load timing's delta, in the spare slot

        ex = Executor(
            base,
            device=str(device),
            dtype=dtype,
            block_size=16,
            kv_cache_bytes=kv_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cuda_graph_max_batch=0,
            max_lora_rank=args.max_lora_rank,
            max_loras_per_step=max(args.batch, 1),
            max_deltas=args.deltas + 1,
        )
        if args.batch * blocks_per_req > ex.num_blocks:
            raise SystemExit(f"KV pool of {ex.num_blocks} blocks cannot hold batch {args.batch} x {blocks_per_req}")
        slot_bytes = delta_gpu_bytes(ex.config, ex.dtype, args.bits, sparse, args.group_size)
        t0 = time.perf_counter()
        place(ex, dirs, step_id=999_999)
        print(f"{len(dirs)} deltas placed (host + GPU) in {time.perf_counter() - t0:.1f} s", flush=True)
        for k, (name, ids) in enumerate(cases.items()):
            times, floor = time_case(ex, args, ids, first_id=(k + 1) * 100_000)
            rows.append(
                {
                    "case": name,
                    "mode": "eager",
                    "step_ms": statistics.median(times) * 1e3,
                    "step_ms_min": min(times) * 1e3,
                    "step_floor_ms": floor * 1e3,
                    "ratio_to_step_floor": statistics.median(times) / floor,
                }
            )
        load_row = load_time(ex, load_dir, args.deltas + 1, sync)
        delta_payload_bytes = int(read_manifest(load_dir)["payload"]["bytes"])
        release(ex)
        del ex
        free_device(device)

        if not args.no_graphs and device.type == "cuda":
            ex = Executor(
                base,
                device=str(device),
                dtype=dtype,
                block_size=16,
                kv_cache_bytes=0,
                gpu_memory_utilization=args.gpu_memory_utilization,
                cuda_graph_max_batch=args.batch,
                max_lora_rank=args.max_lora_rank,
                max_loras_per_step=max(args.batch, 1),
                max_deltas=args.deltas + 1,
            )
            place(ex, dirs, step_id=999_998)
            for k, (name, ids) in enumerate(cases.items()):
                replays = ex.graphs.replays if ex.graphs is not None else 0
                times, floor = time_case(ex, args, ids, first_id=(k + 11) * 100_000)
                replayed = (ex.graphs.replays if ex.graphs is not None else 0) - replays
                rows.append(
                    {
                        "case": name,
                        "mode": "graphs",
                        "step_ms": statistics.median(times) * 1e3,
                        "step_ms_min": min(times) * 1e3,
                        "step_floor_ms": floor * 1e3,
                        "ratio_to_step_floor": statistics.median(times) / floor,
                        "graph_replays": replayed,
                    }
                )
            release(ex)
            del ex
            free_device(device)

    base_eager = next(r["step_ms"] for r in rows if r["case"] == "base" and r["mode"] == "eager")
    base_graphs = next((r["step_ms"] for r in rows if r["case"] == "base" and r["mode"] == "graphs"), None)
    for r in rows:
        r["ratio_to_base"] = r["step_ms"] / base_eager
        r["ratio_to_base_graphs"] = None if base_graphs is None else r["step_ms"] / base_graphs
        vs_graphs = "" if base_graphs is None else f", {r['ratio_to_base_graphs']:.3f}x base with graphs"
        print(
            f"{r['mode']:6s} batch {args.batch} {r['case']:10s}: {r['step_ms']:8.2f} ms "
            f"({r['ratio_to_base']:.3f}x base eager{vs_graphs}; {r['ratio_to_step_floor']:.2f}x its floor "
            f"{r['step_floor_ms']:.2f} ms)",
            flush=True,
        )
    spread_row = next(r for r in rows if r["case"] == spread and r["mode"] == "eager")
    spread_graphs = next((r for r in rows if r["case"] == spread and r["mode"] == "graphs"), None)
    target = {
        "case": spread,
        "against": "base eager",
        "max_ratio": TARGET_RATIO,
        "ratio": spread_row["ratio_to_base"],
        "met": spread_row["ratio_to_base"] <= TARGET_RATIO,
        "ratio_to_base_graphs": spread_row["ratio_to_base_graphs"],
        "ratio_graphs": None if spread_graphs is None else spread_graphs["ratio_to_base_graphs"],
    }
    target["met_graphs"] = None if target["ratio_graphs"] is None else target["ratio_graphs"] <= TARGET_RATIO
    print(
        f"target {spread} <= {TARGET_RATIO}x base: eager {target['ratio']:.3f}x -> "
        f"{'met' if target['met'] else 'NOT met'}"
        + (
            ""
            if spread_graphs is None
            else f"; graphs {target['ratio_graphs']:.3f}x -> {'met' if target['met_graphs'] else 'NOT met'}"
        ),
        flush=True,
    )
    path = write_result(
        "delta_decode_step",
        {
            "device": device_name(device),
            "shape": args.shape,
            "dtype": dtype,
            "smoke": args.smoke,
            "kv_len": args.ctx,
            "batch": args.batch,
            "deltas": args.deltas,
            "distinct_weights": args.distinct_weights,
            "piece_sharing": os.environ[SHARING_ENV],
            "graph_tile": delta_pool.GRAPH_TILE,
            "bits": args.bits,
            "sparsity": args.sparsity,
            "group_size": args.group_size,
            "max_lora_rank": args.max_lora_rank,
            "copy_bandwidth_GBps": None if bw is None else bw / 1e9,
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
            "delta_payload_bytes": delta_payload_bytes,
            "delta_slot_gpu_bytes": slot_bytes,
            "rows": rows,
            "target": target,
            "load": load_row,
        },
        args.out,
    )
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
