"""The four ``--placement`` policies in the scheduler simulator (CaraServe §7.5's placement study).

``deltaserve.sim.replay`` runs ``--workers`` copies of the router's real scheduler on a virtual
clock priced by a bundled latency model, and places every arrival with the router's own
``Placer`` (``placement=``: caraserve, least-loaded, first-fit, random), priced with the same
model's JSON as the daemon's ``--latency-profile`` and the TPOT SLO as its ``--tpot-slo-ms``.

The trace: S-LoRA's synthetic workload (``bench.workload.slora``) with power-law adapter
popularity (a MAF-like skew, ``--alpha``) over ``--adapters`` LoRA adapters whose ranks are drawn
uniformly from 8 / 16 / 32 / 64 per seed, Poisson arrivals at each of ``--rates`` (req/s over all
workers; the default brackets the saturation of 4 workers on the H200 model at this SLO). Per
policy, rate and seed: SLO attainment (TTFT within ``--slo-ttft-ms`` and TPOT within
``--tpot-slo-ms``, refused requests miss), mean TPOT, mean TTFT; then the mean over seeds.

    python3 -m bench.placement_sim                     # ~1 minute on 2 CPU cores; JSON in bench/results
    python3 -m bench.placement_sim --rates 200 --seeds 0 --duration 10 --no-write   # a quick look

The simulator has no GPU: its numbers are the model's (``--gpu-kind``, default the H200 fit),
not a measurement; what it checks is how the real policies rank on the real scheduler's batches.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from dataclasses import replace

import numpy as np

from bench import workload as wl
from bench.common import RESULTS, git_commit
from deltaserve import _native, sim
from deltaserve.sim.models import DEFAULT_MODEL, MODELS_DIR, bundled_model

RANKS = (8, 16, 32, 64)


def make_trace(adapters: int, alpha: float, rate: float, duration: float, seed: int) -> wl.Trace:
    """The skewed trace of one seed, each adapter's rank drawn from :data:`RANKS`."""
    trace = wl.slora(adapters, alpha, rate, 1.0, duration, (8, 512), (8, 512), RANKS, seed=seed)
    ranks = np.random.default_rng(10_000 + seed).choice(RANKS, size=len(trace.variants))
    trace.variants = [replace(v, rank=int(r)) for v, r in zip(trace.variants, ranks)]
    trace.params["ranks"] = "uniform over " + ",".join(map(str, RANKS))
    return trace


def run(trace: wl.Trace, model: sim.LatencyModel, policy: str, a: argparse.Namespace, seed: int) -> dict:
    """One simulated run's figures."""
    res = sim.replay(trace, latency_model=model, seed=seed, workers=a.workers, placement=policy,
                     slo_ttft_s=a.slo_ttft_ms / 1e3, slo_tpot_s=a.tpot_slo_ms / 1e3)  # fmt: skip
    s = res.summary()
    return {
        "slo_attainment": s["slo"]["attainment"],
        "tpot_attainment": s["slo"]["tpot_attainment"],
        "ttft_attainment": s["slo"]["ttft_attainment"],
        "mean_tpot_ms": s["tpot_s"]["mean"] * 1e3,
        "p99_tpot_ms": s["tpot_s"]["p99"] * 1e3,
        "mean_ttft_ms": s["ttft_s"]["mean"] * 1e3,
        "p99_ttft_ms": s["ttft_s"]["p99"] * 1e3,
        "completed": s["completed"],
        "requests": s["requests"],
        "adapter_host_loads": s["adapter_host_loads"],
        "per_worker": np.bincount(res.worker_of[res.worker_of >= 0], minlength=a.workers).tolist(),
    }


def mean_over_seeds(runs: list[dict]) -> dict:
    keys = ("slo_attainment", "tpot_attainment", "ttft_attainment", "mean_tpot_ms", "mean_ttft_ms", "p99_tpot_ms")
    return {k: statistics.mean(r[k] for r in runs) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--adapters", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law popularity exponent (S-LoRA's 1)")
    ap.add_argument("--rates", default="30,40,45,50,60", help="req/s over all workers, comma-separated")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--tpot-slo-ms", type=float, default=10.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=6000.0, help="TTFT SLO (S-LoRA's 6 s)")
    ap.add_argument("--gpu-kind", default=DEFAULT_MODEL, help="the bundled latency model")
    ap.add_argument("--policies", default=",".join(_native.PLACEMENTS))
    ap.add_argument("--no-write", action="store_true", help="print only, no JSON in bench/results")
    a = ap.parse_args()
    model = bundled_model(a.gpu_kind)
    profile = f"{(MODELS_DIR / a.gpu_kind).with_suffix('.json').relative_to(RESULTS.parent.parent)}"
    rates = [float(x) for x in a.rates.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    policies = a.policies.split(",")
    t0 = time.perf_counter()
    cells = []
    for rate in rates:
        traces = {s: make_trace(a.adapters, a.alpha, rate, a.duration, s) for s in seeds}
        for policy in policies:
            runs = [run(traces[s], model, policy, a, s) for s in seeds]
            cell = {"rate": rate, "policy": policy, **mean_over_seeds(runs), "runs": runs}
            cells.append(cell)
            print(f"rate {rate:6.1f}  {policy:12s}  SLO {cell['slo_attainment']:6.1%}  "
                  f"TPOT {cell['mean_tpot_ms']:6.2f} ms  TTFT {cell['mean_ttft_ms']:8.1f} ms", flush=True)  # fmt: skip
    wall = time.perf_counter() - t0
    print(f"{len(cells) * len(seeds)} runs in {wall:.1f} s")
    if a.no_write:
        return
    date = dt.date.today().isoformat()
    payload = {
        "experiment": "placement_sim", "commit": git_commit(), "date": date,
        "device": f"simulator (profile: {profile}, fitted on {model.device or a.gpu_kind})",
        "workload": {"generator": "bench.workload.slora", "adapters": a.adapters, "alpha": a.alpha,
                     "ranks": f"uniform over {RANKS} per adapter", "input_range": [8, 512],
                     "output_range": [8, 512], "cv": 1.0, "duration_s": a.duration, "seeds": seeds},
        "workers": a.workers, "tpot_slo_ms": a.tpot_slo_ms, "ttft_slo_ms": a.slo_ttft_ms,
        "scheduler": "daemon_config of the model (sim.daemon_config), overlap_steps on",
        "wall_s": wall, "cells": cells,
    }  # fmt: skip
    path = RESULTS / f"placement_sim-simulator-{a.gpu_kind}-{date}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
