"""``python -m deltaserve.sim``: the simulator's command line (``deltaserve.sim``'s docstring).

replay       one run of a trace: throughput, TTFT / TPOT / e2e percentiles, SLO attainment,
             preemptions, variant loads, peak memory
plan         GPUs needed per request rate at a TTFT SLO, over --max-num-seqs / --max-deltas
fit          a latency model from a profile (a JSON list of measured steps)
fit-default  the bundled default model from the committed results in bench/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deltaserve import _native
from deltaserve.sim import plan as planning
from deltaserve.sim.latency import LatencyModel
from deltaserve.sim.models import DEFAULT_MODEL, MODELS_DIR, bundled_model, bundled_models, fit_default
from deltaserve.sim.replay import daemon_config, replay
from deltaserve.sim.trace import load_trace


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _model(a: argparse.Namespace) -> LatencyModel:
    if a.latency_model is not None:
        return LatencyModel.load(a.latency_model)
    return bundled_model(a.gpu_kind)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="a JSONL trace (python -m bench.workload writes them)")
    p.add_argument("--gpu-kind", default=DEFAULT_MODEL,
                   help=f"a bundled latency model: {', '.join(bundled_models())} (default {DEFAULT_MODEL})")  # fmt: skip
    p.add_argument("--latency-model", type=Path, help="a latency model JSON (fit's output); overrides --gpu-kind")
    p.add_argument("--slo-ttft-ms", type=float, default=6000.0, help="TTFT SLO (default 6000, S-LoRA's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, help="replay only the first N requests")


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; returns the exit status."""
    p = argparse.ArgumentParser(prog="deltaserve sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay", help="simulate one run of a trace")
    _common(r)
    r.add_argument("--workers", type=int, default=1, help="GPUs, one daemon worker each")
    r.add_argument("--max-num-seqs", type=int)
    r.add_argument("--max-deltas", type=int)
    r.add_argument("--max-num-batched-tokens", type=int)
    r.add_argument("--rate", type=float, help="scale arrivals to this mean rate (req/s)")
    r.add_argument(
        "--slo-tpot-ms", type=float, help="TPOT SLO: attainment, and the daemon's --tpot-slo-ms for placement"
    )
    r.add_argument("--placement", choices=_native.PLACEMENTS, default="least-loaded",
                   help="the daemon's --placement policy across --workers (default least-loaded)")  # fmt: skip
    r.add_argument("--noise", type=float, default=0.0, help="log-normal step-time noise (sigma of the log)")
    r.add_argument("--no-overlap-steps", action="store_true", help="as the daemon's --overlap-steps false")
    r.add_argument("--out", type=Path, help="write the summary JSON here")
    pl = sub.add_parser("plan", help="GPUs needed per rate at a TTFT SLO")
    _common(pl)
    pl.add_argument("--rates", type=_floats, help="req/s, comma-separated (default: the trace's rate x 0.5,1,2,4)")
    pl.add_argument("--max-num-seqs", type=_ints, default=[64, 128, 256], help="comma-separated (default 64,128,256)")
    pl.add_argument(
        "--max-deltas", type=_ints, help="comma-separated (default: 1,3,6 with deltas in the trace, else 0)"
    )
    pl.add_argument("--attainment", type=float, default=0.9, help="share of requests within the SLO (default 0.9)")
    pl.add_argument("--max-gpus", type=int, default=16)
    pl.add_argument("--out-dir", type=Path, default=Path("."), help="where plan.json and plan.png go")
    f = sub.add_parser("fit", help="a latency model from a profile")
    f.add_argument("--profile", type=Path, required=True, help='JSON list of steps: {"step_s": ..., features...}')
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--device", default="", help="the GPU the profile was measured on")
    f.add_argument("--like", default=DEFAULT_MODEL, help="bundled model whose memory and bandwidths to keep")
    d = sub.add_parser("fit-default", help="the bundled default model from bench/results")
    d.add_argument("--results", type=Path, default=Path("bench/results"))
    d.add_argument("--out", type=Path, default=MODELS_DIR / f"{DEFAULT_MODEL}.json")
    a = p.parse_args(argv)
    try:
        return _run(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    if a.cmd == "fit":
        like = bundled_model(a.like)
        model = LatencyModel.fit(json.loads(a.profile.read_text()), disk_to_host_bps=like.disk_to_host_bps,
                                 host_to_gpu_bps=like.host_to_gpu_bps, memory=like.memory, device=a.device,
                                 source=str(a.profile))  # fmt: skip
        print(model.save(a.out), "R2", model.r2, "samples", model.samples)
        return 0
    if a.cmd == "fit-default":
        model = fit_default(a.results)
        print(model.save(a.out), "R2", model.r2, "samples", model.samples)
        return 0
    trace = load_trace(a.trace)
    if a.requests is not None:
        trace = trace.head(a.requests)
    model = _model(a)
    slo = a.slo_ttft_ms / 1e3
    if a.cmd == "replay":
        if a.rate is not None:
            trace = trace.at_rate(a.rate)
        cfg = daemon_config(model, max_num_seqs=a.max_num_seqs, max_deltas=a.max_deltas,
                            max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
        res = replay(trace, cfg, model, a.seed, workers=a.workers, slo_ttft_s=slo,
                     slo_tpot_s=None if a.slo_tpot_ms is None else a.slo_tpot_ms / 1e3, noise=a.noise,
                     overlap_steps=not a.no_overlap_steps, placement=a.placement)  # fmt: skip
        summary = res.summary()
        text = json.dumps(summary, indent=1)
        if a.out is not None:
            a.out.write_text(text + "\n")
        print(text)
        return 0
    has_deltas = any(v.kind == "delta" for v in trace.variants)
    deltas = a.max_deltas or ([1, 3, 6] if has_deltas else [0])
    rates = a.rates or [trace.rate * k for k in (0.5, 1, 2, 4)]
    cells = planning.plan(trace, model, rates=rates, max_num_seqs=a.max_num_seqs, max_deltas=deltas,
                          slo_ttft_s=slo, target=a.attainment, max_gpus=a.max_gpus, seed=a.seed)  # fmt: skip
    print(f"{len(trace)} requests, {len(trace.variants)} variants, model {model.device or a.gpu_kind}, "
          f"TTFT SLO {slo:g} s for {a.attainment:.0%} of requests")  # fmt: skip
    print(planning.table(cells, a.max_gpus))
    a.out_dir.mkdir(parents=True, exist_ok=True)
    out = a.out_dir / "plan.json"
    out.write_text(json.dumps({"trace": str(a.trace), "slo_ttft_s": slo, "attainment": a.attainment,
                               "model": model.device or a.gpu_kind, "cells": planning.to_json(cells)}, indent=1))  # fmt: skip
    print(out)
    title = f"GPUs for TTFT <= {slo:g} s ({a.attainment:.0%}), {model.device or a.gpu_kind}"
    png = planning.plot(cells, a.out_dir / "plan.png", title)
    if png is not None:
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
