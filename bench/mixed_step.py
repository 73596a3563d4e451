"""Prefill and mixed (prefill + decode) steps, eager vs replayed from token-bucket CUDA graphs
(``worker/mixed_graphs.py``), through the real executor, next to the worker's step floor.

Llama-2-7B shape, random fp16 weights. Cases (each with and without LoRA rows: the prefill and the
decodes on 8 rank-16 adapters over all seven projections, decode row i on adapter 1 + i % 8):
  - ``decodes`` running requests at KV ``ctx`` decode one token each while one new request prefills a
    ``chunk``-token chunk (``--chunks``), as continuous batching forms steps under load;
  - a prefix-cache hit: one request whose first ``ctx`` tokens are cached computes its last
    ``--hit`` tokens (and samples), no decodes: the step behind TTFT with a warm prefix.
  - the decodes alone (the decode graphs' step), for reference.
One executor (graphs on), one model: each case is timed with the graphs attached and again with them
detached (the eager path every step with a prefill took before), ``Executor.step`` on the wall (host
build, forward, sampling, tokens back), median of ``--reps`` after warm-up; the floor is the worker's
own (``StepTiming.floor_us``).
The mixed graphs are captured here (after the decode graphs, in their pool) to time the capture and
measure the memory it takes. Exactness at 7B scale: after each case, its step is run eagerly and
replayed from the same state (``logits_gap``: max |logit difference|, arg-max agreement). LoRA rows
report what they add to the same step without them (``lora_added_{eager,graph}_ms``): a mixed
step's decode rows run on MBGMV and its chunk on SGMV, so this should be about the decode step's
LoRA cost plus the chunk's.

    python3 -m bench.mixed_step [--chunks 32,128,512] [--decodes 64] [--ctx 512] [--out DIR]
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

from bench.common import SHAPES, device_name, write_random_lora_dir, write_random_model_dir, write_result  # noqa: E402
from bench.lora_decode_step import place  # noqa: E402
from bench.plans import new_request  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.adapters.variants import StepRows  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402
from deltaserve.worker.mixed_graphs import MixedGraphs  # noqa: E402

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
N_ADAPTERS = 8


def case_request(req_id: int, tokens: int, computed: int, scheduled: int, first_block: int, bs: int, adapter: int):
    """A ``tokens``-token request (ids from its req_id) on pages from ``first_block``, and how many pages
    it takes (room for two more tokens)."""
    need = -(-(tokens + 2) // bs)
    ids = [3 + (req_id * 7 + j) % 1000 for j in range(tokens)]
    return new_request(req_id, ids, range(first_block, first_block + need), computed, scheduled, adapter), need


def logits_gap(ex: Executor, mixed: MixedGraphs, dec: list, chunk: int, computed: int, page: int, lora: bool):
    """The case's step (the running decodes' next tokens and a new chunk on pages from ``page``) run
    eagerly and replayed from the same state: (max |logit difference|, whether every row's arg-max
    agrees). Neither changes the requests (``ForwardRunner.forward`` only; the K/V it writes are its own)."""
    bs = ex.block_size
    tokens = [3 + j % 1000 for j in range(computed + chunk)]
    seqs, runs = [], []
    if chunk:
        seqs.append((tokens[computed:], computed, list(range(page, page + -(-(computed + chunk + 2) // bs))), True))
        runs.append((1 if lora else 0, chunk))
    for r in dec:
        st = ex.requests[r.req_id]
        seqs.append((st.token_ids[st.num_computed : st.num_computed + 1], st.num_computed, st.block_table, True))
        runs.append((st.variant_id, 1))
    rows = StepRows(runs, [v for v, _ in runs], False)
    out = {}
    for mode in ("eager", "graph"):
        ex.runner.mixed = mixed if mode == "graph" else None
        with torch.inference_mode():
            out[mode] = ex.runner.forward(seqs, rows, None).clone()
    diff = (out["eager"] - out["graph"]).abs().max().item()
    return diff, bool(torch.equal(out["eager"].argmax(-1), out["graph"].argmax(-1)))


def run_case(
    ex: Executor,
    args,
    decodes: int,
    chunk: int,
    computed: int,
    lora: bool,
    first_page: int,
    first_id: int,
    check: MixedGraphs | None = None,
):
    """Median wall seconds and worker floor (us) of the case's steps (module docstring); with ``check``,
    also ``logits_gap`` of the case's step after them (else None)."""
    bs = ex.block_size
    page, steps = first_page, args.warmup + args.reps
    dec = []
    for i in range(decodes):
        r, need = case_request(first_id + i, args.ctx + 1, args.ctx, 1, page, bs, 1 + i % N_ADAPTERS if lora else 0)
        r.block_ids = list(range(page, page + -(-(args.ctx + steps + 2) // bs)))
        page += len(r.block_ids)
        dec.append(r)
    step_id = first_id * 10
    if dec:
        ex.step(wire.StepPlan(step_id=step_id, new_requests=dec, running=[], released=[]))
    times, floors = [], []
    for s in range(steps):
        new, _ = case_request(first_id + 100_000 + s, computed + chunk, computed, chunk, page, bs, 1 if lora else 0)
        adds = [new] if chunk else []  # chunk 0: the decodes alone (the decode graphs' step, for reference)
        running = [wire.RunningRequest(req_id=r.req_id, num_scheduled_tokens=1, new_block_ids=[]) for r in dec]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = ex.step(wire.StepPlan(step_id=step_id + 2 * s + 1, new_requests=adds, running=running, released=[]))
        t1 = time.perf_counter()
        ex.step(wire.StepPlan(step_id=step_id + 2 * s + 2, released=[r.req_id for r in adds]))
        if s >= args.warmup:
            times.append(t1 - t0)
            floors.append(out.timing.floor_us)
    gap = logits_gap(ex, check, dec, chunk, computed, page, lora) if check is not None and chunk else None
    ex.step(wire.StepPlan(step_id=step_id + 2 * steps + 3, released=[r.req_id for r in dec]))
    return statistics.median(times), statistics.median(floors), gap


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", default="32,128,512")
    p.add_argument("--hit", type=int, default=32, help="tokens a prefix-cache hit leaves to compute")
    p.add_argument("--max-tokens", type=int, default=1024, help="largest token bucket")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cuda:0")
    cfg = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = write_random_model_dir(args.shape, tmp / args.shape)
        weights = write_random_lora_dir(tmp / "w", cfg, 16, SEVEN, seed=1) / "adapter_model.safetensors"
        dirs = {a: write_random_lora_dir(tmp / f"a{a}", cfg, 16, SEVEN, weights=weights) for a in range(1, 9)}
        ex = Executor(
            model_dir,
            device="cuda:0",
            dtype="float16",
            block_size=16,
            kv_cache_bytes=0,
            gpu_memory_utilization=0.90,
            max_num_batched_tokens=max(2048, args.max_tokens),
            cuda_graph_max_batch=128,
            cuda_graph_max_tokens=0,  # captured below, timed
            max_lora_rank=16,
            max_loras_per_step=64,
            max_deltas=0,
        )
        assert ex.graphs is not None
        torch.cuda.synchronize()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        mixed = MixedGraphs(
            ex.model,
            ex.kv,
            args.max_tokens,
            128,
            ex.max_model_len,
            scratch_slot=ex.num_blocks * ex.block_size,
            lora=ex.lora_pool,
            pool=ex.graphs.pool,
        )
        capture = {
            "seconds": mixed.capture_seconds,
            "graphs": len(mixed.graphs) + len(mixed.lora_graphs) + len(mixed.chunk_lora_graphs),
            "token_buckets": mixed.sizes,
            "max_seqs": mixed.max_seqs,
            "reserved_bytes": torch.cuda.memory_reserved() - reserved,
            "allocated_bytes": torch.cuda.memory_allocated() - allocated,
        }
        print(f"capture: {capture}", flush=True)
        first_page = place(ex, dirs, 0)
        decode_graphs = ex.runner.graphs
        cases = [(args.decodes, 0, 0)]  # the decodes alone: decode graphs vs eager
        cases += [(args.decodes, c, 0) for c in (int(x) for x in args.chunks.split(","))] + [(0, args.hit, args.ctx)]
        rows, first_id = [], 1
        for decodes, chunk, computed in cases:
            for lora in (False, True):
                row = {"decodes": decodes, "prefill_tokens": chunk, "cached_prefix": computed, "lora": lora}
                row["tokens"] = decodes + chunk
                row["bucket"] = mixed.bucket_for(decodes + chunk, decodes + 1) if chunk else None
                for mode in ("eager", "graph"):
                    ex.runner.mixed = mixed if mode == "graph" else None
                    ex.runner.graphs = decode_graphs if mode == "graph" else None
                    before = mixed.replays
                    check = mixed if mode == "graph" else None
                    t, floor_us, gap = run_case(ex, args, decodes, chunk, computed, lora, first_page, first_id, check)
                    if gap is not None:
                        row["max_abs_logit_diff"], row["argmax_equal"] = gap
                    first_id += 1000
                    row[f"{mode}_ms"] = t * 1e3
                    row[f"{mode}_mixed_replays"] = mixed.replays - before
                    row["floor_ms"] = floor_us / 1e3
                    row[f"{mode}_ratio_to_floor"] = t * 1e6 / floor_us if floor_us else None
                row["speedup"] = row["eager_ms"] / row["graph_ms"]
                if lora:  # what the LoRA rows add to the same step without them (rows[-1])
                    for mode in ("eager", "graph"):
                        row[f"lora_added_{mode}_ms"] = row[f"{mode}_ms"] - rows[-1][f"{mode}_ms"]
                rows.append(row)
                print(
                    f"{decodes:3d} decodes + {chunk:4d} tokens (cached {computed:4d}){' LoRA' if lora else '     '}: "
                    f"eager {row['eager_ms']:7.2f} ms, graph {row['graph_ms']:7.2f} ms (bucket {row['bucket']}, "
                    f"{row['speedup']:.2f}x); floor {row['floor_ms']:.2f} ms: eager "
                    f"{row['eager_ratio_to_floor'] or 0:.2f}x, graph {row['graph_ratio_to_floor'] or 0:.2f}x",
                    flush=True,
                )
                if lora:
                    print(
                        f"    LoRA rows add: eager {row['lora_added_eager_ms']:+.2f} ms, graph {row['lora_added_graph_ms']:+.2f} ms"
                    )
                if "argmax_equal" in row:
                    print(
                        f"    replay vs eager: max |logit diff| {row['max_abs_logit_diff']:.3g}, arg-max equal {row['argmax_equal']}"
                    )
    path = write_result(
        "mixed_step",
        {
            "device": device_name(device),
            "shape": args.shape,
            "dtype": "float16",
            "decode_ctx": args.ctx,
            "lora": f"{N_ADAPTERS} adapters, rank 16, seven projections; decode row i on adapter 1 + i % 8",
            "lora_kernels": "decode steps: MBGMV; mixed steps: decode rows MBGMV (row list), chunk SGMV (tiles)",
            "timed_steps": args.reps,
            "capture": capture,
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
