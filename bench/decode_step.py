"""Decode-step time through the real worker executor, next to its memory floor.

Llama-2-7B shape, random fp16 weights, KV length 512 per request. For each batch size the
executor gets the StepPlans the router would send: B requests whose first 512 tokens are already
in the KV cache (``num_computed_tokens = 512``, so no prefill is needed to reach that length),
then decode steps of one token each. Timed: ``Executor.step`` (batch building, forward, sampling,
results back on the host), median of the timed steps. Overlapped (as the worker loop runs when
the router sends step N+1 ahead): ``Executor.launch`` of step N+1 before ``Executor.finish`` of
step N, timed from one finish to the next, so the host work of N+1 hides behind the device's N.

Each batch size runs with decode steps replayed from CUDA graphs, then eagerly; each both one
step at a time and overlapped. Where the pool cannot hold every request's context (batch 256 on
an 80 GB card), requests far apart in the batch read the same context pages (``kv_page_sets``),
each writing its decode tokens to pages of its own.

Floors, each from the device-to-device copy bandwidth measured in the same run:
  weight floor = weight bytes / bandwidth
  memory floor = (weight bytes + KV bytes the step reads) / bandwidth
  step floor = the worker's own floor of the timed steps (``StepTiming.floor_us``: the roofline of
    ``deltaserve.worker.step_floor`` with the ceilings the executor measured at start-up), the same
    number the served-step efficiency of the serving benchmarks divides by

    python3 -m bench.decode_step [--batches 1,8,32,64,128,256] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import copy_bandwidth, device_name, write_random_model_dir, write_result  # noqa: E402
from bench.plans import new_request  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402


def kv_page_sets(batch: int, ctx: int, blocks_per_req: int, block_size: int, pages: int) -> int:
    """How many distinct sets of context pages ``batch`` requests can have in ``pages`` pages: one
    each when they fit, else the most that fit with every request's tail pages (where its decode
    steps write) its own. Request i reads set ``i % sets``, so requests sharing a set are ``sets``
    apart in the batch: between two reads of a set's pages the step reads ``sets - 1`` other
    requests' contexts (gigabytes at 7B shapes, far beyond L2), so sharing saves memory without
    making the reads cheaper. Batch 256 at KV 512 needs ~68 GB of distinct KV at the Llama-2-7B
    shape: more than an 80 GB card holds beside the weights."""
    shared = ctx // block_size
    tail = blocks_per_req - shared
    if batch * blocks_per_req <= pages:
        return batch
    if shared == 0 or pages < batch * tail + shared:
        raise ValueError(f"KV pool of {pages} pages too small for batch {batch} even with shared context pages")
    return max(1, min(batch, (pages - batch * tail) // shared))


def bench_batch(
    ex: Executor,
    batch: int,
    ctx: int,
    steps: int,
    warmup: int,
    first_id: int,
    adapter_ids: list[int] | None = None,
    first_block: int = 0,
    overlap: bool = False,
    floors: list[int] | None = None,
    stats: dict | None = None,
    after_step: Callable[[int], None] | None = None,
    chunk: int = 0,
    chunk_adapter: int = 0,
    chunk_cached: int = 0,
) -> list[float]:
    """Times decode steps of ``batch`` requests at KV length ``ctx``; request i uses LoRA adapter
    ``adapter_ids[i]`` (already GPU-resident; 0 or None: the base). KV pages from ``first_block``.
    ``overlap``: each step is launched before the previous one is finished (see the module doc).
    ``floors``: gets the worker's floor of each timed step (``StepTiming.floor_us``, from
    ``deltaserve.worker.step_floor``), microseconds. ``stats["kv_sets"]``: how many distinct
    context page sets the requests read (see ``kv_page_sets``). ``after_step(i)``: called after the
    i-th step (0 admits the requests, then ``warmup`` steps, then the timed ones; one at a time only).
    ``chunk``: every step after the first also prefills a new ``chunk``-token prompt on adapter
    ``chunk_adapter`` beside the decodes (a mixed step, as continuous batching forms them), and the next
    step releases it (one at a time only). ``chunk_cached``: that prompt's first ``chunk_cached`` tokens
    are already computed (a prefix-cache hit: the chunk attends to their pages, which hold whatever KV
    is there), so the step computes its last ``chunk`` tokens."""
    bs = ex.block_size
    chunk_pages = -(-(chunk_cached + chunk + 1) // bs) if chunk else 0
    chunk_first, first_block = first_block, first_block + 2 * chunk_pages  # two chunk page ranges, taken in turn
    blocks_per_req = (ctx + steps + warmup + 1 + bs - 1) // bs
    kv_sets = kv_page_sets(batch, ctx, blocks_per_req, bs, ex.num_blocks - first_block)
    shared = ctx // bs  # whole pages of context: read, never written (decode writes from ctx on)
    tail = blocks_per_req - shared
    if stats is not None:
        stats["kv_sets"] = kv_sets
    g = torch.Generator().manual_seed(batch)
    new = []
    for i in range(batch):
        tokens = torch.randint(3, ex.config.vocab_size, (ctx + 1,), generator=g).tolist()
        context = first_block + (i % kv_sets) * shared
        own = first_block + kv_sets * shared + i * tail
        blocks = list(range(context, context + shared)) + list(range(own, own + tail))
        new.append(new_request(first_id + i, tokens, blocks, ctx, 1, adapter_ids[i] if adapter_ids else 0))
    ids = [r.req_id for r in new]
    step_id = first_id * 1000
    if overlap and (after_step is not None or chunk):
        raise ValueError("bench_batch: after_step and chunk need steps run one at a time")
    ex.step(wire.StepPlan(step_id=step_id, new_requests=new, running=[], released=[]))
    if after_step is not None:
        after_step(0)
    times = []
    plans = [
        wire.StepPlan(
            step_id=step_id + s + 1,
            new_requests=[],
            running=[wire.RunningRequest(req_id=r, num_scheduled_tokens=1, new_block_ids=[]) for r in ids],
            released=[],
        )
        for s in range(warmup + steps)
    ]
    for s, plan in enumerate(plans if chunk else []):
        pages = chunk_first + (s % 2) * chunk_pages
        tokens = torch.randint(3, ex.config.vocab_size, (chunk_cached + chunk,), generator=g).tolist()
        pages_of_chunk = range(pages, pages + chunk_pages)
        plan.new_requests = [
            new_request(first_id + batch + s, tokens, pages_of_chunk, chunk_cached, chunk, chunk_adapter)
        ]
        plan.released = [first_id + batch + s - 1] if s else []
    if overlap:
        in_flight, last_finish = None, None
        for s, plan in enumerate(plans):
            launched = ex.launch(plan, in_flight)
            if in_flight is not None:
                out = ex.finish(in_flight)  # waits for step s-1's tokens; step s is queued behind it
                now = time.perf_counter()
                if s > warmup:
                    times.append(now - last_finish)
                    if floors is not None:
                        floors.append(out.timing.floor_us)
                last_finish = now
            in_flight = launched
        ex.finish(in_flight)
        plans = []
    for s, plan in enumerate(plans):
        if ex.device.type == "cuda":
            torch.cuda.synchronize(ex.device)
        t0 = time.perf_counter()
        out = ex.step(plan)  # returns host-side token ids: the step is complete when it returns
        t1 = time.perf_counter()
        if s >= warmup:
            times.append(t1 - t0)
            if floors is not None:
                floors.append(out.timing.floor_us)
            if stats is not None:
                stats.setdefault("outputs_per_step", []).append(len(out.outputs))
        if after_step is not None:
            after_step(s + 1)
    last_chunk = [first_id + batch + warmup + steps - 1] if chunk else []
    ex.step(wire.StepPlan(step_id=step_id + warmup + steps + 1, new_requests=[], running=[], released=ids + last_chunk))
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda:0")
    bw = copy_bandwidth(device)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model_dir(args.shape, Path(tmp) / args.shape)
        for mode, graph_batch in (("graphs", max(batches)), ("eager", 0)):
            ex = Executor(
                model_dir,
                device="cuda:0",
                dtype="float16",
                block_size=16,
                kv_cache_bytes=0,
                gpu_memory_utilization=0.92,
                cuda_graph_max_batch=graph_batch,
                max_deltas=0,
            )  # base path only: no delta slots reserved or wrappers
            c = ex.config
            kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2  # K and V, fp16
            weight_bytes = sum(p.numel() * p.element_size() for p in ex.model.parameters())
            rows = []
            for b in batches:
                floors: list[int] = []
                stats: dict = {}
                times = bench_batch(
                    ex,
                    b,
                    args.ctx,
                    args.steps,
                    args.warmup,
                    first_id=len(rows) * 10000 + 1,
                    floors=floors,
                    stats=stats,
                )
                overlapped = statistics.median(
                    bench_batch(
                        ex, b, args.ctx, args.steps, args.warmup, first_id=len(rows) * 10000 + 5001, overlap=True
                    )
                )
                step = statistics.median(times)
                kv_bytes = b * (args.ctx + 1) * kv_per_token
                weight_floor = weight_bytes / bw
                mem_floor = (weight_bytes + kv_bytes) / bw
                step_floor = statistics.median(floors) / 1e6  # the worker's roofline floor of these steps
                row = {
                    "batch": b,
                    "kv_page_sets": stats["kv_sets"],
                    "step_ms": step * 1e3,
                    "step_ms_min": min(times) * 1e3,
                    "weight_floor_ms": weight_floor * 1e3,
                    "memory_floor_ms": mem_floor * 1e3,
                    "ratio_to_weight_floor": step / weight_floor,
                    "ratio_to_memory_floor": step / mem_floor,
                    "tokens_per_s": b / step,
                    "overlapped_step_ms": overlapped * 1e3,
                    "overlapped_ratio_to_memory_floor": overlapped / mem_floor,
                    "step_floor_ms": step_floor * 1e3,
                    "ratio_to_step_floor": step / step_floor,
                    "overlapped_ratio_to_step_floor": overlapped / step_floor,
                }
                rows.append(row)
                print(
                    f"{mode} batch {b:4d}: {row['step_ms']:8.2f} ms  weight floor {row['weight_floor_ms']:.2f} ms "
                    f"({row['ratio_to_weight_floor']:.2f}x)  memory floor {row['memory_floor_ms']:.2f} ms "
                    f"({row['ratio_to_memory_floor']:.2f}x); overlapped {row['overlapped_step_ms']:.2f} ms "
                    f"({row['overlapped_ratio_to_memory_floor']:.2f}x); worker's step floor "
                    f"{row['step_floor_ms']:.2f} ms ({row['ratio_to_step_floor']:.2f}x, overlapped "
                    f"{row['overlapped_ratio_to_step_floor']:.2f}x)",
                    flush=True,
                )
            if ex.graphs is not None:
                print(f"{mode}: {ex.graphs.replays} steps replayed from graphs", flush=True)
            results[mode] = rows
            roofline = ex.roofline
            del ex
            torch.cuda.empty_cache()
    path = write_result(
        "decode_step",
        {
            "device": device_name(device),
            "shape": args.shape,
            "dtype": "float16",
            "kv_len": args.ctx,
            "copy_bandwidth_GBps": bw / 1e9,
            "worker_roofline": {
                "copy_GBps": roofline.copy_bytes_per_s / 1e9,
                "matmul_TFLOPs": roofline.matmul_flops_per_s / 1e12,
                "source": roofline.source,
            },
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_per_token,
            "kernels": "triton (paged attention, fused rmsnorm/rope/silu_mul)",
            "timed_steps": args.steps,
            "rows_graphs": results["graphs"],
            "rows_eager": results["eager"],
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
