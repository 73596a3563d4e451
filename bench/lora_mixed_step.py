"""Steps of S-LoRA's S2 mix (ranks 64 / 32 / 16 / 8 on q, k, v, o; Llama-2-7B shape, random weights):
why n = 1000-2000 serve slower than n = 5 when the decode kernels barely notice distinct adapters.

- decode, batch 64, KV 512, CUDA graphs: base, 4 adapters shared by all rows, 64 distinct adapters;
- prefill chunks (eager, as served): ``seqs x length`` new tokens with the base, one adapter for all,
  or a distinct adapter per sequence;
- mixed steps (eager, as continuous batching forms them under load): one 512-token prefill next to
  48 decoding requests, all base, 4 shared adapters, or a distinct adapter per request: SGMV then
  sees one long segment beside many one-token ones.
Each is timed on the wall (median) and by its kernels' device time (torch.profiler); a step whose
wall time exceeds its device time is bound by the host.

    python3 -m bench.lora_mixed_step [--out DIR]
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
from bench.decode_step import bench_batch  # noqa: E402
from bench.lora_decode_step import place  # noqa: E402
from bench.plans import new_request  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
RANKS = (64, 32, 16, 8)


def prefill_steps(ex: Executor, ids: list[int], length: int, first_block: int, first_id: int, reps: int) -> list[float]:
    """Wall seconds of ``reps`` prefill steps of one ``length``-token chunk per sequence (adapter
    ``ids[i]``), each admitted from scratch and released after."""
    nb = -(-length // ex.block_size)
    times = []
    for rep in range(reps):
        req0 = first_id + rep * len(ids)
        new = [
            new_request(
                req0 + i, range(3, 3 + length), range(first_block + i * nb, first_block + (i + 1) * nb), adapter_id=a
            )
            for i, a in enumerate(ids)
        ]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ex.step(wire.StepPlan(step_id=req0, new_requests=new, running=[], released=[]))
        times.append(time.perf_counter() - t0)
        ex.step(wire.StepPlan(step_id=req0 + 1, new_requests=[], running=[], released=[r.req_id for r in new]))
    return times


def start_decoding(ex: Executor, ids: list[int], first_block: int, first_id: int, steps: int) -> list[wire.NewRequest]:
    """Admits one request per adapter id of ``ids`` with a 16-token prompt and pages for ``steps``
    more tokens; returns them (pages from ``first_block`` on, ``ceil((17 + steps) / block_size)`` each)."""
    per = -(-(17 + steps) // ex.block_size)
    dec = [
        new_request(first_id + i, range(3, 19), range(first_block + i * per, first_block + (i + 1) * per), adapter_id=a)
        for i, a in enumerate(ids)
    ]
    ex.step(wire.StepPlan(step_id=first_id, new_requests=dec, running=[], released=[]))
    return dec


def mixed_steps(
    ex: Executor, dec: list[wire.NewRequest], prefill_id: int, length: int, first_block: int, first_id: int, reps: int
) -> list[float]:
    """Wall seconds of ``reps`` steps that each decode one token for the running requests ``dec`` and
    prefill one new ``length``-token request (adapter ``prefill_id``, pages from ``first_block``,
    released after its step)."""
    nb = -(-length // ex.block_size)
    times = []
    for rep in range(reps):
        new = new_request(
            first_id + rep, range(3, 3 + length), range(first_block, first_block + nb), adapter_id=prefill_id
        )
        running = [wire.RunningRequest(req_id=r.req_id, num_scheduled_tokens=1, new_block_ids=[]) for r in dec]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ex.step(wire.StepPlan(step_id=first_id + 2 * rep, new_requests=[new], running=running, released=[]))
        times.append(time.perf_counter() - t0)
        ex.step(wire.StepPlan(step_id=first_id + 2 * rep + 1, new_requests=[], running=[], released=[new.req_id]))
    return times


def device_ms(fn, steps: int) -> float:
    """Kernel time per step of ``fn()`` (which runs ``steps`` steps), from torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cuda:0")
    cfg = SHAPES[args.shape]
    decode_rows, prefill_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = write_random_model_dir(args.shape, tmp / args.shape)
        weights = {
            r: write_random_lora_dir(tmp / "w" / f"r{r}", cfg, r, QKVO, seed=r) / "adapter_model.safetensors"
            for r in RANKS
        }
        rank_of = {a: RANKS[(a - 1) % len(RANKS)] for a in range(1, 65)}
        dirs = {
            a: write_random_lora_dir(tmp / "l" / f"a{a}", cfg, r, QKVO, weights=weights[r]) for a, r in rank_of.items()
        }
        ex = Executor(
            model_dir,
            device="cuda:0",
            dtype="float16",
            block_size=16,
            kv_cache_bytes=0,
            gpu_memory_utilization=0.92,
            cuda_graph_max_batch=64,
            max_lora_rank=max(RANKS),
            max_loras_per_step=64,
            max_deltas=0,
        )
        first_page = place(ex, dirs, 0)
        cases = {
            "base": [0] * 64,
            "4 shared": [1 + i % 4 for i in range(64)],
            "64 distinct": [1 + i for i in range(64)],
        }
        for k, (name, ids) in enumerate(cases.items()):
            t = bench_batch(ex, 64, 512, 20, 5, first_id=(k + 1) * 100000, adapter_ids=ids, first_block=first_page)
            decode_rows.append(
                {"case": name, "batch": 64, "kv_len": 512, "graphs": True, "step_ms": statistics.median(t) * 1e3}
            )
            print(f"decode b64 graphs {name:12s}: {decode_rows[-1]['step_ms']:7.2f} ms", flush=True)
        first_id = 10_000_000
        for seqs, length in ((4, 256), (16, 64), (32, 32)):
            for name, ids in (
                ("base", [0] * seqs),
                ("one adapter", [1] * seqs),
                ("distinct", [1 + i for i in range(seqs)]),
            ):
                prefill_steps(ex, ids, length, first_page, first_id, 2)  # warm-up
                wall = statistics.median(prefill_steps(ex, ids, length, first_page, first_id + 1000, args.reps))
                dev = device_ms(lambda: prefill_steps(ex, ids, length, first_page, first_id + 2000, 3), 3)
                first_id += 10_000
                prefill_rows.append(
                    {
                        "case": name,
                        "seqs": seqs,
                        "length": length,
                        "wall_ms": wall * 1e3,
                        "device_ms": dev,
                        "ranks": sorted({rank_of[a] for a in ids if a}),
                    }
                )
                print(
                    f"prefill {seqs}x{length} {name:11s}: wall {wall * 1e3:6.2f} ms, kernels {dev:6.2f} ms", flush=True
                )
        mixed_rows = []
        reps = args.reps + 2 + 3
        for name, ids in (
            ("base", [0] * 48),
            ("4 shared", [1 + i % 4 for i in range(48)]),
            ("distinct", [1 + i for i in range(48)]),
        ):
            pid = ids[0] if name != "distinct" else 64
            dec = start_decoding(ex, ids, first_page, first_id, reps)
            prefill_block = first_page + len(ids) * -(-(17 + reps) // ex.block_size)
            mixed_steps(ex, dec, pid, 512, prefill_block, first_id + 100, 2)  # warm-up
            wall = statistics.median(mixed_steps(ex, dec, pid, 512, prefill_block, first_id + 200, args.reps))
            dev = device_ms(lambda: mixed_steps(ex, dec, pid, 512, prefill_block, first_id + 300, 3), 3)
            ex.step(
                wire.StepPlan(step_id=first_id + 400, new_requests=[], running=[], released=[r.req_id for r in dec])
            )
            first_id += 10_000
            mixed_rows.append({"case": name, "decoding": 48, "prefill": 512, "wall_ms": wall * 1e3, "device_ms": dev})
            print(
                f"mixed 48 decode + 512 prefill {name:9s}: wall {wall * 1e3:6.2f} ms, kernels {dev:6.2f} ms", flush=True
            )
    path = write_result(
        "lora_mixed_step",
        {
            "device": device_name(device),
            "shape": args.shape,
            "dtype": "float16",
            "targets": list(QKVO),
            "ranks": list(RANKS),
            "adapters": 64,
            "decode": decode_rows,
            "prefill": prefill_rows,
            "mixed": mixed_rows,
            "prefill_mode": "eager (as served)",
            "timed_reps": args.reps,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
