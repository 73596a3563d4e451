"""Validates the simulator (``deltaserve.sim``) against the daemon on the same GPU: for the S-LoRA
S2 trace and the DeltaZip trace, one daemon start each, whose worker records every step
(``deltaserve.sim.record``):

    1. profile   a trace of the same workload (seed 1, 1.5x the rate) replayed open-loop; its
                 recorded steps fit a latency model (LatencyModel.fit over sliding windows of
                 FIT_WINDOW steps; steps that copied a variant to the GPU left out)
    2. measure   the validation trace (seed 0) replayed open-loop (bench/replay.py), on the same
                 daemon right after
    3. simulate  the profile trace, then the validation trace once it is done, as the daemon
                 saw them (the profile leaves variants resident), in the simulator: the fitted
                 model, the daemon's own scheduler config (its KV pages from /metrics, the
                 experiment's flags), the variants' footprints from their files; the figures
                 are the validation requests'
    4. compare   predicted vs measured throughput (req/s) and mean TTFT; target: within 15%

Variant transfer bandwidths (disk -> host -> GPU) are measured from the profile recording
(``deltaserve.sim.record.transfer_bandwidths``: each ``to_host`` read to its ``host_ready`` report,
each ``to_gpu`` copy as its step's worker time outside the forward pass beyond that of steps
without copies); a kind the profile never
moved keeps the bundled model's figure (H200 measurements, ``deltaserve/sim/models.py``). Writes
``bench/results/sim_validate-<device>-<date>.json``. On an H100 (about 5-7 minutes, most of it
writing the DeltaZip experiment's delta files and starting its daemon):

    python -m bench.sim_validate
    python -m bench.sim_validate --smoke           # tiny CPU models, a few requests (~1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import replay as rp
from bench.common import RESULTS, git_commit, write_result
from bench.launch import ServerSpec
from bench.serving.experiments import WORKLOADS, experiment
from bench.serving.runner import detect_devices, work_directory
from bench.serving.servers import SERVERS, merge_flags
from bench.serving.variants import prepare_variants
from deltaserve import _native, sim
from deltaserve.sim.record import read_steps, recording_python, steps_to_samples, transfer_bandwidths
from deltaserve.sim.trace import from_requests

TARGET = 0.15
"""Largest relative error accepted for throughput and mean TTFT."""
FIT_WINDOW = 2
"""Steps per sliding latency-fit window: two steps are in flight under overlapped steps, and a
step's host work lands in its neighbour's output-to-output period (per-step fits of the S-LoRA S2
profile had R² 0.05 and priced most prefill steps at 0.2 ms). A modelling choice, with a known
sensitivity: on that profile (H200, fe8b6b8), windows of 1 / 2 / 4 / 8 steps put the validation's
mean TTFT at -38 / -6 / +15 / +26 % of measured. Longer windows price each step more fully (the
edge error shrinks as 1 / window: tests/sim), and the simulator then over-predicts; its TPOT is
also 7-9 % over at every window: a mechanism of the daemon it does not model yet."""


@contextlib.contextmanager
def recording_interpreter(script: Path) -> Iterator[None]:
    """bench/launch.py starts the daemon with ``--python sys.executable``: point it at the
    recording wrapper while the server starts."""
    real = sys.executable
    sys.executable = str(script)
    try:
        yield
    finally:
        sys.executable = real


def _metric(url: str, name: str) -> float | None:
    base = url.split("/v1/")[0]
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == name:
                return float(parts[1])
    return None


def _flag(flags: list[str], name: str, default: int) -> int:
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return int(flags[i + 1])
        if f.startswith(name + "="):
            return int(f.split("=", 1)[1])
    return default


def _footprints(model: sim.LatencyModel, files: Any, trace: Any, kv_bytes_per_token: int) -> None:
    """Sets ``model.memory``'s variant sizes from the files the daemon serves."""
    mem = model.memory
    mem.kv_bytes_per_token = kv_bytes_per_token
    page = kv_bytes_per_token * 16
    lora = next((v for v in trace.variants if v.kind == "lora"), None)
    if lora is not None and files.lora_dir is not None:
        size = sum(p.stat().st_size for p in (Path(files.lora_dir) / lora.name).rglob("*.safetensors"))
        mem.lora_bytes_per_rank = max(1, size // lora.rank)
        mem.lora_pages_per_rank = mem.lora_bytes_per_rank / page
    if files.deltas:
        d = next(iter(files.deltas.values()))
        mem.delta_bytes = sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def _variant_bytes(files: Any, variants: list[Any]) -> dict[int, tuple[str, int]]:
    """Variant id -> (kind, bytes of its files): the daemon numbers the variants in the order the
    harness registers them, the trace's."""
    out = {}
    for i, v in enumerate(variants):
        if v.kind == "full":
            where = Path(files.deltas[v.name]) if files.deltas and v.name in files.deltas else None
            kind = "delta"
        else:
            where = Path(files.lora_dir) / v.name if files.lora_dir is not None else None
            kind = "lora"
        if where is not None and where.exists():
            out[i + 1] = (kind, sum(p.stat().st_size for p in where.rglob("*") if p.is_file()))
    return out


def _kv_bytes_per_token(model_dir: Path | None, devices: str) -> int:
    if model_dir is None:  # the demo model (SmolLM2-135M): 30 layers, 3 KV heads of 64
        cfg = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64}
    else:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * kv_heads * head * (4 if devices == "cpu" else 2)


def validate(name: str, args: argparse.Namespace, work: Path, devices: str, device: str) -> dict[str, Any]:
    """Profile, measure, simulate and compare one experiment (module docstring) on ``devices``
    (``cpu`` or CUDA ids), the GPU named ``device``."""
    overrides: dict[str, Any] = {"smoke": args.smoke}
    if not args.smoke:
        overrides["duration"] = args.duration
        if name == "slora-s2":
            overrides.update(n=[args.n], rate=[args.rate_s2])
        else:
            overrides.update(rate=[args.rate_deltazip])
    exp = experiment(name, **overrides)
    exp = replace(exp, points=exp.points[:1])
    point = exp.points[0]
    make = WORKLOADS[point.workload]
    valid = make(**point.trace)
    profile = make(**{**point.trace, "seed": 1, "rate": point.trace["rate"] * 1.5})
    variants = list({v.name: v for v in valid.variants + profile.variants}.values())
    files = prepare_variants(exp, "deltaserve", variants, work, devices)
    (args.out_dir or RESULTS).mkdir(parents=True, exist_ok=True)
    record = work / f"{name}-steps.jsonl"
    record.unlink(missing_ok=True)
    script = recording_python(work / f"{name}-python", record)
    flags = merge_flags(exp.server_flags.get("deltaserve", ()), [])
    spec = ServerSpec(model_dir=files.model_dir, lora_dir=files.lora_dir, devices=devices, deltas=files.deltas,
                      flags=flags, daemon=args.daemon, log=(args.out_dir or RESULTS) / f"sim_validate-{name}-server.log")  # fmt: skip
    t0 = time.perf_counter()
    with recording_interpreter(script), SERVERS["deltaserve"](spec) as endpoint:
        ready_s = time.perf_counter() - t0
        print(f"[{name}] profile: {len(profile.requests)} requests over {profile.duration:.1f} s", flush=True)
        rp.run_replay(profile, endpoint.url, protocol=point.protocol, timeout_s=exp.timeout_s)
        split = time.monotonic()
        print(f"[{name}] measure: {len(valid.requests)} requests over {valid.duration:.1f} s", flush=True)
        records = rp.run_replay(valid, endpoint.url, protocol=point.protocol, timeout_s=exp.timeout_s)
        num_blocks = int(_metric(endpoint.url, "deltaserve_kv_blocks_total") or 0)
    measured = rp.summarize(records)
    steps = read_steps(record)
    ranks = {i + 1: v.rank or 0 for i, v in enumerate(variants)}
    delta_ids = {i + 1 for i, v in enumerate(variants) if v.kind == "full"}
    # The daemon numbers variants in registration order; the harness registers them in trace order.
    profiled = [s for s in steps if s["sent"] <= split]
    like = sim.default_model()
    for skip_loads in (True, False):  # steps that copied a variant in only when the others lack a kind
        samples = steps_to_samples(profiled, ranks, delta_ids, skip_loads=skip_loads)
        try:
            model = sim.LatencyModel.fit(samples, window=FIT_WINDOW, disk_to_host_bps=like.disk_to_host_bps,
                                         host_to_gpu_bps=like.host_to_gpu_bps, memory=like.memory, device=device,
                                         source=f"{name} profile, {len(samples)} steps")  # fmt: skip
            break
        except ValueError:
            if not skip_loads:
                raise
    _footprints(model, files, valid, _kv_bytes_per_token(files.model_dir, devices))
    sizes = _variant_bytes(files, variants)
    moved = transfer_bandwidths(profiled, sizes)
    model.disk_to_host_bps = {**like.disk_to_host_bps, **moved["disk_to_host_bps"]}
    model.host_to_gpu_bps = {**like.host_to_gpu_bps, **moved["host_to_gpu_bps"]}
    cfg = _native.SchedulerConfig(16, num_blocks, min(4096, num_blocks * 16))
    cfg.max_num_seqs = _flag(flags, "--max-num-seqs", cfg.max_num_seqs)
    cfg.max_num_batched_tokens = _flag(flags, "--max-num-batched-tokens", cfg.max_num_batched_tokens)
    cfg.max_deltas = _flag(flags, "--max-deltas", cfg.max_deltas)
    cfg.host_adapter_bytes = _flag(flags, "--variant-host-bytes", cfg.host_adapter_bytes)
    cfg.host_copy_reports = True
    # The daemon served the profile first: replay it, then the validation trace after it ends.
    warm_up = from_requests(profile.requests, variants)
    offset = float(np.nanmax(sim.replay(warm_up, cfg, model).finish_s))
    both = from_requests(list(profile.requests) + [replace(q, t=q.t + offset) for q in valid.requests], variants)
    predicted = sim.replay(both, cfg, model).last(len(valid.requests)).summary()
    err_thr = predicted["throughput_req_s"] / measured["throughput_req_s"] - 1 if measured["throughput_req_s"] else None
    m_ttft, p_ttft = measured["ttft_s"]["mean"], predicted["ttft_s"]["mean"]
    err_ttft = p_ttft / m_ttft - 1 if m_ttft and p_ttft is not None else None
    ok = all(e is not None and abs(e) <= TARGET for e in (err_thr, err_ttft))
    print(f"[{name}] throughput measured {measured['throughput_req_s']:.3f} predicted {predicted['throughput_req_s']:.3f} "
          f"req/s ({_pct(err_thr)}); mean TTFT measured {_fmt(m_ttft)} predicted {_fmt(p_ttft)} s ({_pct(err_ttft)}); "
          f"latency fit R2 {model.r2}; {'within' if ok else 'NOT within'} {TARGET:.0%}", flush=True)  # fmt: skip
    return {
        "experiment": name, "trace": valid.params, "profile_trace": profile.params, "server_flags": flags,
        "server_ready_s": ready_s, "steps_recorded": len(steps), "profile_samples": len(samples),
        "transfers_measured": moved,
        "latency_model": model.to_dict(), "scheduler_config": cfg.as_dict(),
        "measured": {k: measured[k] for k in ("requests", "completed", "failed", "makespan_s", "throughput_req_s",
                                              "throughput_out_tok_s", "ttft_s", "tpot_s", "e2e_s")},
        "predicted": {k: predicted[k] for k in ("requests", "completed", "makespan_s", "throughput_req_s",
                                                "throughput_out_tok_s", "ttft_s", "tpot_s", "e2e_s", "preemptions",
                                                "adapter_gpu_loads", "adapter_host_loads", "peak")},
        "error": {"throughput_req_s": err_thr, "ttft_mean_s": err_ttft}, "within_target": ok,
    }  # fmt: skip


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def main(argv: list[str] | None = None) -> Path:
    """The command line (module docstring); returns the result file."""
    p = argparse.ArgumentParser(prog="python -m bench.sim_validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--experiments", default="slora-s2,deltazip", help="comma-separated: slora-s2, deltazip")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per trace (default 30)")
    p.add_argument("--n", type=int, default=100, help="slora-s2 adapters (default 100)")
    p.add_argument("--rate-s2", type=float, default=8.0, help="slora-s2 req/s (default 8)")
    p.add_argument("--rate-deltazip", type=float, default=1.0, help="deltazip req/s (default 1)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU models, a few requests")
    p.add_argument("--devices", help="`cpu` or a CUDA id (default: 0 when CUDA is available)")
    p.add_argument("--daemon", type=Path, help="deltaserve binary (default: $DELTASERVE_BIN, target/release)")
    p.add_argument("--work-dir", type=Path, help="keep the model and variant files here (default: a temporary dir)")
    p.add_argument("--out-dir", type=Path, default=None, help=f"where results go (default {RESULTS})")
    a = p.parse_args(argv)
    auto, device = detect_devices()
    devices = "cpu" if a.smoke else (a.devices or auto)
    if devices == "cpu":
        device = "cpu"
    runs = []
    with work_directory(a.work_dir) as work:
        for name in [x for x in a.experiments.split(",") if x]:
            runs.append(validate(name, a, work, devices, device))
    payload = {"device": device, "commit": git_commit(), "target": TARGET, "smoke": a.smoke, "runs": runs,
               "within_target": all(r["within_target"] for r in runs)}  # fmt: skip
    path = write_result("sim_validate" + ("-smoke" if a.smoke else ""), payload, a.out_dir)
    print(path)
    return path


if __name__ == "__main__":
    main()
