"""CPU cost of serving a compressed delta on the demo model (SmolLM2-135M-Instruct), through the real
executor: a decode step with base rows only vs with delta rows (the reference SBMM path, which
dequantises each delta once and keeps it: ``DeltaWeights.cache_reference``), and ``dequantize``
of one packed MLP linear.

    python -m bench.delta_cpu_step [--delta ~/.cache/deltaserve/deltas/json] [--batch 4] [--steps 10]

The delta is a ``deltaserve compress`` directory of the demo model (README: compressed full
fine-tunes). Writes ``bench/results/delta_cpu_step-cpu-<date>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import write_result  # noqa: E402
from bench.decode_step import bench_batch  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.compress.delta_dir import load_delta  # noqa: E402
from deltaserve.demo_model import default_out_dir, deltaserve_home  # noqa: E402
from deltaserve.formats.packed_delta import dequantize  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--delta", type=Path, default=deltaserve_home() / "deltas" / "json")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    ex = Executor(default_out_dir(), device="cpu", dtype="float32", block_size=16)
    info = ex.inspect_variant(str(args.delta), wire.VariantKind.DELTA)
    if info.error:
        raise SystemExit(info.error)
    delta = wire.VariantKind.DELTA
    ex.step(wire.StepPlan(step_id=10**9, adapter_ops=[wire.VariantOp(1, wire.TierOp.TO_HOST, str(args.delta), [], delta),
                                                      wire.VariantOp(1, wire.TierOp.TO_GPU, "", [], delta, 0)]))  # fmt: skip
    rows = {}
    for k, (name, ids) in enumerate((("base", [0] * args.batch), ("delta", [1] * args.batch))):
        times = bench_batch(
            ex, args.batch, args.ctx, args.steps, args.warmup, first_id=(k + 1) * 100_000, adapter_ids=ids
        )
        rows[name] = statistics.median(times)
        print(f"decode step, batch {args.batch}, {name}: {rows[name] * 1e3:.1f} ms", flush=True)
    _, packed, _ = load_delta(args.delta)
    linear = "model.layers.0.mlp.gate_proj"
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        dequantize(packed[linear])
        best = min(best, time.perf_counter() - t0)
    p_ = packed[linear]
    print(f"dequantize {linear} [{p_.out_features}x{p_.in_features}]: {best * 1e3:.2f} ms", flush=True)
    path = write_result(
        "delta_cpu_step",
        {
            "device": "cpu",
            "torch_threads": threads,
            "model": str(default_out_dir()),
            "delta": str(args.delta),
            "delta_summary": info.summary,
            "batch": args.batch,
            "kv_len": args.ctx,
            "timed_steps": args.steps,
            "step_ms": {k: v * 1e3 for k, v in rows.items()},
            "ratio_delta_to_base": rows["delta"] / rows["base"],
            "dequantize_ms": {"linear": linear, "shape": [p_.out_features, p_.in_features], "best_of_10": best * 1e3},
        },
        args.out,
    )
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
