"""Validates the simulator (``deltaserve.sim``) against the daemon on the same GPU: for the S-LoRA
S2 trace and the DeltaZip trace, one daemon start each, whose worker records every step
(``deltaserve.sim.record``: plans, outputs, the executor's launch and finish times, graph replays
and CUDA-event device spans):

    0. warm up   one trace per validated rate (seeds 200, 201, ...; ``PROFILE_RATE`` x the rate,
                 ``--warmup-duration`` s) replayed open-loop and simulated, never fitted: the
                 daemon's first uses of shapes (kernel compilation and tuning, allocator growth)
                 made the profile's steps slower than the same steps later (an H100 DeltaZip
                 recording: one-delta prefills of 380-415 tokens 0.17-0.22 s in the profile,
                 0.11-0.16 s in the validation replays)
    1. profile   one trace per validated rate (seeds 100, 101, ...; ``PROFILE_RATE`` x the rate,
                 ``--profile-duration`` s) replayed open-loop; the recording fits the model:
                 device time per step from the device spans (steps launched behind a running
                 one, whose spans hold no launch gaps), the worker's host launch time per step
                 (``LatencyModel.fit_host``), the graph rule (which steps replayed a graph), the
                 plans' trip from the router (``router_gap_s``), the worker's stalls
                 (``worker_stall_s_per_seq``), and from the profile's own
                 client records on the same clock (``bench/sim_timeline.py``) the delivery of a
                 token to its client (median) and the ingress of a request (5th percentile of
                 its wait for a plan, less the plan's trip); on the CPU (no device spans) the
                 output periods in sliding windows of ``FIT_WINDOW`` steps alone. The worker's
                 dense-prefill threshold (``sbmm.dense_min_m`` of the device, kept in the
                 recording) and on CUDA its graphs' dense lane (``delta_graphs.DENSE_LANE_BASE_TOKENS``,
                 kept too) set the feature ``dense_delta_segments``
    2. measure   per rate, ``--seeds`` validation traces (seeds ``SEED_STRIDE`` x the rate's index
                 + 0, 1, ...: the workloads draw prompts from the seed alone, and a seed shared by
                 two rates would repeat its prompts, served the second time from the daemon's
                 prefix cache) replayed open-loop
                 (bench/replay.py) on the same daemon, one after another
    3. simulate  every replay, warm-up and profile included, at the clients' own send times in one
                 run of the simulator (the daemon keeps variants resident from one replay to the next):
                 the fitted model, the daemon's scheduler config (its KV pages from /metrics, the
                 experiment's flags; delta loads beside the steps where the recording has the
                 worker's ``gpu_ready`` reports), the variants' footprints from their files, and each
                 prompt's identity (the replay's trace regenerated from its seed), so the
                 simulated scheduler's prefix cache hits where the daemon's did (on by default:
                 the workloads draw prompts from the seed alone, so seed k at two rates repeats
                 its prompts)
    4. compare   per replay and per rate (requests pooled over its seeds): predicted vs measured
                 throughput and mean TTFT (target: within 15 %), the measured spread of the mean
                 TTFT over the seeds beside the error, and each TTFT split into wait / steps /
                 deliver, measured (worker recording + client) and simulated

TTFT is the first token event (``--protocol ws``, the default): over SSE the client counts the
first chunk with text, and a token that decodes to no text yet (an incomplete UTF-8 character, a
special token: common with the random-weight models here) moves it to a later step, which the
simulator, counting tokens, does not see (the results before the ws default were over SSE).

Variant transfer bandwidths (disk -> host -> GPU) are measured from the profile recording
(``deltaserve.sim.record.transfer_bandwidths``; on a GPU the copies from the device spans,
``span_copy_bandwidths``: they queue on the compute stream, out of the host's sight); a kind the profile never moved keeps the bundled
model's figure (H200 measurements, ``deltaserve/sim/models.py``). Writes
``bench/results/sim_validate-<experiments>-<device>-<date>.json``. On an H100 or H200, each under
five minutes of wall time plus the model and variant files' writing:

    python -m bench.sim_validate --experiments slora-s2          # rates 8 and 28, 2 seeds each
    python -m bench.sim_validate --experiments deltazip          # rate 1, 2 seeds, a 60 s profile
    python -m bench.sim_validate --smoke           # tiny CPU models, a few requests (~2 min)

``--save-recording DIR`` keeps the raw material (the step recording, every replay's requests and
client records, the run's flags and file sizes); ``--from-recording DIR`` fits, simulates and
compares again from it on any machine, so a change to the model is checked without a GPU
(recordings from before the warm-up, or before the dense threshold was kept, refit as they ran:
no warm-up, the threshold of the recording's device kind today; recordings from before the dense
lane was kept refit without a lane).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import inspect
import json
import time
import urllib.request
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
from bench.sim_timeline import StartClock, measured_split, simulated_split
from deltaserve import _native, sim
from deltaserve.sim.record import (
    graph_rule,
    host_samples,
    keeps_delta_steps_within,
    read_steps,
    recording_python,
    reports_gpu_loads,
    router_gap_s,
    span_copy_bandwidths,
    steps_to_samples,
    transfer_bandwidths,
    worker_stall_s_per_seq,
)
from deltaserve.sim.trace import from_requests

TARGET = 0.15
"""Largest relative error accepted for throughput and mean TTFT."""
PROFILE_RATE = 1.25
"""Each profile trace offers this times its validation rate (batches a little past the measured)."""
SEED_STRIDE = 1000
"""Validation seeds of the rate of index j start at ``SEED_STRIDE`` x j: no two rates share a seed,
so none repeats another's prompts (the H200 run at 5c0e161 used seeds 0, 1 at both rates; its
rate-28 seed-0 replay got 29 % of its prompt tokens from the prefix cache)."""
LEAD_S = 0.1
"""Seconds between a replay's call and its trace's time 0."""
PROFILE_S = {"slora-s2": 15.0, "deltazip": 60.0}
"""Default ``--profile-duration`` per experiment: DeltaZip's 1 req/s makes few prefill steps (a 40 s
profile on an H100 fitted 23), which its prefill model needs more of than S-LoRA S2's rates do."""
WARMUP_S = 20.0
"""Default ``--warmup-duration`` (0: none)."""
UNSCORED = ("warmup", "profile")
"""Labels of the replays simulated but not compared (the phases before the validation's)."""
FIT_WINDOW = 2
"""Steps per sliding latency-fit window: two steps are in flight under overlapped steps, and a
step's host work lands in its neighbour's output-to-output period (per-step fits of the S-LoRA S2
profile had R² 0.05 and priced most prefill steps at 0.2 ms). A modelling choice, with a known
sensitivity: on that profile (H200, fe8b6b8), windows of 1 / 2 / 4 / 8 steps put the validation's
mean TTFT at -38 / -6 / +15 / +26 % of measured. Longer windows price each step more fully (the
edge error shrinks as 1 / window: tests/sim), and the simulator then over-predicts; its TPOT is
also 7-9 % over at every window. Used only where the recording has no device spans (the CPU):
on a GPU the spans and the launch times separate the two, and the simulator's worker pipeline
(``router/crates/py/src/sim_pipeline.rs``) puts the host work where the worker loop does."""


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


def _footprints(files: Any, trace: Any) -> dict[str, Any]:
    """``Memory`` fields of the variants' sizes, from the files the daemon serves."""
    out: dict[str, Any] = {}
    lora = next((v for v in trace.variants if v.kind == "lora"), None)
    if lora is not None and files.lora_dir is not None:
        size = sum(p.stat().st_size for p in (Path(files.lora_dir) / lora.name).rglob("*.safetensors"))
        out["lora_bytes_per_rank"] = max(1, size // lora.rank)
    if files.deltas:
        d = next(iter(files.deltas.values()))
        out["delta_bytes"] = sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())
    return out


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


def _phase_traces(name: str, args: argparse.Namespace) -> tuple[Any, Any, list[tuple[str, float, int, Any]]]:
    """The experiment, its point and the phases ``(label, rate, seed, trace)`` in the order they
    run: the warm-ups (label ``warmup``, seeds 200 + the rate's index; none for a
    ``--warmup-duration`` of 0), the profiles (``profile``, seeds 100 + the index), both at
    ``PROFILE_RATE`` x the rate, then the validation replays: rate ``j``, seeds ``SEED_STRIDE`` j +
    0..``--seeds``-1."""
    overrides: dict[str, Any] = {"smoke": args.smoke}
    if not args.smoke:
        overrides["duration"] = args.duration
        if name == "slora-s2":
            overrides["n"] = [args.n]
    exp = experiment(name, **overrides)
    exp = replace(exp, points=exp.points[:1])
    point = exp.points[0]
    make = WORKLOADS[point.workload]
    rates = [point.trace["rate"]] if args.smoke else _rates(args, name)
    profile_s = args.profile_duration or PROFILE_S.get(name, PROFILE_S["slora-s2"])
    before = [("warmup", 200, min(args.warmup_duration, point.trace["duration"]) if args.smoke else args.warmup_duration),
              ("profile", 100, point.trace["duration"] if args.smoke else profile_s)]  # fmt: skip
    phases = [(label, r * PROFILE_RATE, seed + j,
               make(**{**point.trace, "seed": seed + j, "rate": r * PROFILE_RATE, "duration": s}))
              for label, seed, s in before if s > 0 for j, r in enumerate(rates)]  # fmt: skip
    seeds = [(r, SEED_STRIDE * j + k) for j, r in enumerate(rates) for k in range(1 if args.smoke else args.seeds)]
    phases += [(f"rate {r:g} seed {seed}", r, seed, make(**{**point.trace, "seed": seed, "rate": r}))
               for r, seed in seeds]  # fmt: skip
    return exp, point, phases


def _dense_min_m(device: str) -> int | None:
    """The worker's dense-prefill threshold on ``device`` (``cpu``, else CUDA): ``sbmm.dense_min_m``."""
    import torch

    from deltaserve.kernels.sbmm import dense_min_m

    return dense_min_m(torch.device("cpu" if device == "cpu" else "cuda"))


def _dense_lane_base_tokens(device: str) -> int | None:
    """The worker's dense-lane threshold base on ``device`` (``LatencyModel.dense_lane_base_tokens``):
    ``delta_graphs.DENSE_LANE_BASE_TOKENS`` where the dense path runs (:func:`_dense_min_m`, CUDA),
    else None."""
    from deltaserve.adapters.delta_graphs import DENSE_LANE_BASE_TOKENS

    return DENSE_LANE_BASE_TOKENS if _dense_min_m(device) is not None else None


def _rates(args: argparse.Namespace, name: str) -> list[float]:
    text = args.rates_s2 if name == "slora-s2" else args.rates_deltazip
    return [float(x) for x in text.split(",") if x]


def _replay(trace: Any, url: str, point: Any, timeout_s: float) -> tuple[list[Any], float]:
    """Replays ``trace`` open-loop; returns its records and its absolute start (CLOCK_MONOTONIC)."""
    clock = StartClock()
    real, rp.time = rp.time, clock  # type: ignore[assignment]
    try:
        records = rp.run_replay(trace, url, protocol=point.protocol, timeout_s=timeout_s, lead_s=LEAD_S)
    finally:
        rp.time = real
    assert clock.first is not None
    return records, clock.first + LEAD_S


def validate(name: str, args: argparse.Namespace, work: Path, devices: str, device: str) -> dict[str, Any]:
    """Profile, measure, simulate and compare one experiment (module docstring) on ``devices``
    (``cpu`` or CUDA ids), the GPU named ``device``."""
    exp, point, phases = _phase_traces(name, args)
    point = replace(point, protocol=args.protocol)
    variants = list({v.name: v for *_, t in phases for v in t.variants}.values())
    files = prepare_variants(exp, "deltaserve", variants, work, devices)
    (args.out_dir or RESULTS).mkdir(parents=True, exist_ok=True)
    record = work / f"{name}-steps.jsonl"
    record.unlink(missing_ok=True)
    script = recording_python(work / f"{name}-python", record)
    flags = merge_flags(exp.server_flags.get("deltaserve", ()), [])
    dense, lane = _dense_min_m(devices), _dense_lane_base_tokens(devices)  # what the worker will use
    spec = ServerSpec(model_dir=files.model_dir, lora_dir=files.lora_dir, devices=devices, deltas=files.deltas, env=files.env,
                      flags=flags, daemon=args.daemon, log=(args.out_dir or RESULTS) / f"sim_validate-{name}-server.log",
                      python=str(script))  # fmt: skip
    ran: list[tuple[str, float, int, Any, list[Any], float]] = []
    t0 = time.perf_counter()
    with SERVERS["deltaserve"](spec) as endpoint:
        ready_s = time.perf_counter() - t0
        for label, rate, seed, trace in phases:
            print(f"[{name}] {label}: {len(trace.requests)} requests over {trace.duration:.1f} s", flush=True)
            ran.append((label, rate, seed, trace, *_replay(trace, endpoint.url, point, exp.timeout_s)))
        num_blocks = int(_metric(endpoint.url, "deltaserve_kv_blocks_total") or 0)
    context = {
        "experiment": name, "protocol": point.protocol, "trace": point.trace, "server_flags": flags,
        "server_ready_s": ready_s, "num_blocks": num_blocks, "device": device, "dense_min_m": dense,
        "dense_lane_base_tokens": lane,
        "variants": [{"name": v.name, "kind": v.kind, "rank": v.rank} for v in variants],
        "variant_bytes": {str(k): list(v) for k, v in _variant_bytes(files, variants).items()},
        "footprints": _footprints(files, phases[0][3]),
        "kv_bytes_per_token": _kv_bytes_per_token(files.model_dir, devices),
    }  # fmt: skip
    replays = [{"label": label, "rate": rate, "seed": seed, "start": start, "trace": trace.params,
                "requests": [{"t": q.t, "variant": q.variant, "prompt_len": len(q.prompt), "output_len": q.output_len}
                             for q in trace.requests],
                "records": [r.row() for r in recs]} for label, rate, seed, trace, recs, start in ran]  # fmt: skip
    if args.save_recording is not None:  # the raw material, for --from-recording
        args.save_recording.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.save_recording / f"{name}-steps.jsonl.gz", "wt") as f:
            f.write(record.read_text())
        (args.save_recording / f"{name}-replays.json").write_text(json.dumps({"context": context, "replays": replays}))
    return analyse(context, read_steps(record), replays)


def from_recording(name: str, where: Path) -> dict[str, Any]:
    """:func:`analyse` of what ``--save-recording`` kept of a run of experiment ``name``."""
    saved = json.loads((where / f"{name}-replays.json").read_text())
    with gzip.open(where / f"{name}-steps.jsonl.gz", "rt") as f:
        steps = sorted((json.loads(line) for line in f if line.strip()), key=lambda s: s["sent"])
    return analyse(saved["context"], steps, saved["replays"])


def analyse(context: dict[str, Any], steps: list[dict[str, Any]], replays: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps 1 (fit), 3 (simulate) and 4 (compare) of the module docstring, from one daemon's step
    recording, its replays (``requests``: the trace's; ``records``: the client's rows; warm-ups and
    profiles first) and the run's ``context`` (flags, pool, variants and their file sizes, the
    worker's dense-prefill threshold and dense lane)."""
    name, device, flags = context["experiment"], context["device"], context["server_flags"]
    variants = context["variants"]
    fields = {f.name for f in dataclasses.fields(rp.Record)}
    ran = [(r["label"], r["rate"], r["seed"], r["requests"], [rp.Record(**{k: v for k, v in row.items() if k in fields})
                                                              for row in r["records"]], r["start"])
           for r in replays]  # fmt: skip
    ids = {v["name"]: i + 1 for i, v in enumerate(variants)}  # the harness registers variants in this order
    variant_id = lambda v: ids.get(v, 0)  # noqa: E731 (the base model: 0)
    ranks = {i + 1: v["rank"] or 0 for i, v in enumerate(variants)}
    delta_ids = {i + 1 for i, v in enumerate(variants) if v["kind"] == "full"}
    profiles = [r for r in ran if r[0] == "profile"]
    # The profile's steps: from its first replay's start to the first validation replay's (the
    # warm-ups before it ran to completion: their steps all came earlier).
    fit_from, fit_to = profiles[0][5] - LEAD_S, next(r[5] for r in ran if r[0] not in UNSCORED) - LEAD_S
    profiled = [s for s in steps if fit_from <= s["sent"] <= fit_to]
    dense = context["dense_min_m"] if "dense_min_m" in context else _dense_min_m(device)  # kept since 2026-11-26
    lane = context.get("dense_lane_base_tokens")  # kept since the simulator models the lane; before: none
    model = _fit(name, profiled, ranks, delta_ids, device, dense, lane)
    model.memory.kv_bytes_per_token = context["kv_bytes_per_token"]
    for key, value in context["footprints"].items():
        setattr(model.memory, key, value)
    if "lora_bytes_per_rank" in context["footprints"]:
        model.memory.lora_pages_per_rank = model.memory.lora_bytes_per_rank / (context["kv_bytes_per_token"] * 16)
    sizes = {int(k): (v[0], int(v[1])) for k, v in context["variant_bytes"].items()}
    moved = transfer_bandwidths(profiled, sizes)
    if any(s.get("device_s") for s in profiled):  # a GPU's copies are on the device: its spans time them
        moved["host_to_gpu_bps"].update(
            span_copy_bandwidths(profiled, ranks, delta_ids, sizes, model.predict, dense, lane)
        )
    like = sim.default_model()
    model.disk_to_host_bps = {**like.disk_to_host_bps, **moved["disk_to_host_bps"]}
    model.host_to_gpu_bps = {**like.host_to_gpu_bps, **moved["host_to_gpu_bps"]}
    # The daemon's pipeline around the device, measured on the profile (validation data unseen).
    model.graph_max_batch, model.graph_max_tokens, model.graph_max_delta_tokens = graph_rule(profiled, delta_ids)
    model.router_gap_s = router_gap_s(profiled) or 0.0
    model.stall_s_per_seq = worker_stall_s_per_seq(profiled)
    prof_splits = [measured_split(recs, start, steps, variant_id) for *_, recs, start in profiles]
    prof_rows = np.array([r[2:] for sp in prof_splits for r in sp["per_request"]]).reshape(-1, 3)
    if len(prof_rows):
        model.deliver_s = max(0.0, float(np.median(prof_rows[:, 2])))
        model.ingress_s = max(0.0, float(np.percentile(prof_rows[:, 0], 5)) - model.router_gap_s)
    num_blocks = context["num_blocks"]
    cfg = _native.SchedulerConfig(16, num_blocks, min(4096, num_blocks * 16))
    cfg.max_num_seqs = _flag(flags, "--max-num-seqs", cfg.max_num_seqs)
    cfg.max_num_batched_tokens = _flag(flags, "--max-num-batched-tokens", cfg.max_num_batched_tokens)
    cfg.max_deltas = _flag(flags, "--max-deltas", cfg.max_deltas)
    cfg.host_adapter_bytes = _flag(flags, "--variant-host-bytes", cfg.host_adapter_bytes)
    cfg.host_copy_reports = True
    # The daemon loads deltas beside the steps when its worker reports the copies (``gpu_ready``, recorded
    # with every step since 2026-11-27): an older recording, without the field, ran each copy inside the
    # step that admitted its request, and replays so.
    cfg.gpu_load_reports = reports_gpu_loads(steps)
    # The router keeps the prompt chunks of steps with delta rows within the worker's delta graphs (its
    # Hello's ``delta_graph_tokens``) since 2026-11-28; an older daemon's recording replays without it.
    limit = model.graph_max_delta_tokens
    cfg.delta_graph_tokens = limit if keeps_delta_steps_within(steps, delta_ids, limit) else 0
    # Every replay as the daemon saw it, at the clients' own send times, in one simulated run:
    # each phase starts with the variants and state the ones before left, its KV prefix cache
    # included (prompts keyed by content: seed k at two rates repeats its prompts).
    origin = ran[0][5]
    reqs: list[dict[str, Any]] = []
    spans = []
    keys = [_prompt_keys(r) for r in replays] if _prefix_caching(flags) else []
    for k, (_, _, _, requests, recs, start) in enumerate(ran):
        lo = len(reqs)
        for j, (q, r) in enumerate(zip(requests, recs)):
            sent = r.sent if r.sent == r.sent else q["t"]
            key = {"prompt_key": keys[k][j]} if keys and all(x is not None for x in keys) else {}
            reqs.append({**q, "t": start + sent - origin, **key})
        spans.append((lo, len(reqs)))
    order = np.argsort([q["t"] for q in reqs], kind="stable")
    result = sim.replay(from_requests([reqs[i] for i in order], variants), cfg, model)
    where = np.empty(len(order), dtype=np.int64)
    where[order] = np.arange(len(order))
    points = []
    for (label, rate, seed, requests, recs, start), (lo, hi) in zip(ran, spans):
        if label not in UNSCORED:
            points.append(_compare(label, rate, seed, len(requests), recs, start, steps, variant_id, result,
                                   where[lo:hi], model))  # fmt: skip
    by_rate = _by_rate(points)
    ok = all(r["within_target"] for r in by_rate)
    for r in by_rate:
        print(f"[{name}] rate {r['rate']:g}: mean TTFT measured {_fmt(r['ttft_mean_s']['measured'])} s "
              f"(spread over {r['runs']} runs {_pct(r['ttft_mean_s']['measured_spread'])}) predicted "
              f"{_fmt(r['ttft_mean_s']['predicted'])} s ({_pct(r['error']['ttft_mean_s'])}); throughput "
              f"{_pct(r['error']['throughput_req_s'])}", flush=True)  # fmt: skip
    return {
        **{k: context[k] for k in ("experiment", "protocol", "trace", "server_flags", "server_ready_s")},
        "steps_recorded": len(steps), "steps_fitted": len(profiled),
        **{f"{label}_traces": [r["trace"] for r in replays if r["label"] == label] for label in UNSCORED},
        "profile_split": [{k: v for k, v in sp.items() if k != "per_request"} for sp in prof_splits],
        "transfers_measured": moved, "latency_model": model.to_dict(), "scheduler_config": cfg.as_dict(),
        "prefix_caching": {"simulated": result.trace.prompt_key is not None,
                           "hit_tokens_simulated": int(result.counters.get("prefix_hit_tokens", 0)),
                           "hit_tokens_measured": sum(n[2] for s in steps for n in s["new"])},
        "points": points, "by_rate": by_rate, "within_target": ok,
    }  # fmt: skip


def _prefix_caching(flags: list[str]) -> bool:
    """Whether the daemon ran with prefix caching (on by default; ``--no-enable-prefix-caching`` or
    ``--enable-prefix-caching false`` turn it off, the last one given winning)."""
    on = True
    for i, f in enumerate(flags):
        if f == "--no-enable-prefix-caching":
            on = False
        elif f.startswith("--enable-prefix-caching"):
            value = f.split("=", 1)[1] if "=" in f else (flags[i + 1] if i + 1 < len(flags) else "true")
            on = value.lower() not in ("false", "0", "no", "off")
    return on


def _prompt_keys(replay: dict[str, Any]) -> list[int] | None:
    """Each request's prompt identity (64 bits of a BLAKE2b digest of its token ids), from the
    replay's trace regenerated from its parameters (the workloads draw prompts from the seed
    alone: seed k at two rates repeats the same prompts, which the daemon's prefix cache then
    serves); None when the trace cannot be regenerated as recorded."""
    params = dict(replay.get("trace") or {})
    make = WORKLOADS.get(params.get("kind", ""))
    if make is None:
        return None
    accepted = inspect.signature(make).parameters
    try:
        trace = make(**{k: v for k, v in params.items() if k in accepted})
    except (TypeError, ValueError):
        return None
    got = [(len(q.prompt), q.variant, q.output_len) for q in trace.requests]
    want = [(q["prompt_len"], q["variant"], q["output_len"]) for q in replay["requests"]]
    if got != want:
        return None
    digest = lambda p: hashlib.blake2b(np.asarray(p, dtype=np.int64).tobytes(), digest_size=8).digest()  # noqa: E731
    return [int.from_bytes(digest(q.prompt), "little") for q in trace.requests]


def _fit(name: str, profiled: list[dict[str, Any]], ranks: dict[int, int], delta_ids: set[int],
         device: str, dense: int | None, lane: int | None) -> sim.LatencyModel:  # fmt: skip
    """The profile's latency model: device time per step from the recorded device spans where the
    worker had them (CUDA), with host launch time from the recorded launches; else (the CPU, whose
    launch computes the step) sliding windows of output periods (``FIT_WINDOW``) alone. ``dense``:
    the worker's dense-prefill threshold (``LatencyModel.dense_min_m``), ``lane`` its dense lane's
    (``LatencyModel.dense_lane_base_tokens``)."""
    like = sim.default_model()
    spans = any(s.get("device_s") for s in profiled)
    for skip_loads in (True, False):  # steps that copied a variant in only when the others lack a kind
        samples = steps_to_samples(
            profiled, ranks, delta_ids, skip_loads=skip_loads, dense_min_m=dense, dense_lane_base_tokens=lane
        )
        try:
            model = sim.LatencyModel.fit(samples, window=1 if spans else FIT_WINDOW, memory=like.memory, device=device,
                                         dense_min_m=dense, dense_lane_base_tokens=lane,
                                         source=f"{name} profile, {len(samples)} steps, "
                                                f"{'device spans' if spans else f'windows of {FIT_WINDOW}'}")  # fmt: skip
            break
        except ValueError:
            if not skip_loads:
                raise
    host = host_samples(profiled, ranks, delta_ids, dense, lane)
    if host and spans:  # on the CPU a launch computes the whole step: the periods already hold it
        model.fit_host(host)
    return model


def _compare(label: str, rate: float, seed: int, n: int, recs: list[Any], start: float,
             steps: list[dict[str, Any]], variant_id: Any, result: Any, rows: np.ndarray,
             model: sim.LatencyModel) -> dict[str, Any]:  # fmt: skip
    """Measured vs predicted figures of one validation replay of ``n`` requests (its requests at
    ``rows`` of the simulated run)."""
    measured = rp.summarize(recs)
    t = result.trace

    def pick(xs: Any) -> tuple[Any, ...]:
        return tuple(np.asarray(xs)[rows].tolist())

    sub = replace(result, trace=replace(t, arrival_s=pick(t.arrival_s), prompt_len=pick(t.prompt_len),
                                        output_len=pick(t.output_len), variant=pick(t.variant),
                                        prompt_key=None if t.prompt_key is None else pick(t.prompt_key)),
                  first_token_s=result.first_token_s[rows], finish_s=result.finish_s[rows],
                  scheduled_s=result.scheduled_s[rows], output_tokens=result.output_tokens[rows],
                  worker_of=result.worker_of[rows])  # fmt: skip
    predicted = sub.summary()
    err = {k: _rel(predicted[k], measured[k]) for k in ("throughput_req_s",)}
    err["ttft_mean_s"] = _rel(predicted["ttft_s"]["mean"], measured["ttft_s"]["mean"])
    err["tpot_mean_s"] = _rel(predicted["tpot_s"]["mean"], measured["tpot_s"]["mean"])
    return {
        "label": label, "rate": rate, "seed": seed, "requests": n,
        "measured": {k: measured[k] for k in ("completed", "failed", "makespan_s", "throughput_req_s", "ttft_s",
                                              "tpot_s", "e2e_s")},
        "predicted": {k: predicted[k] for k in ("completed", "makespan_s", "throughput_req_s", "ttft_s", "tpot_s",
                                                "e2e_s", "preemptions", "adapter_gpu_loads", "adapter_host_loads")},
        "error": err,
        "ttft_split": {
            "measured": {k: v for k, v in measured_split(recs, start, steps, variant_id).items() if k != "per_request"},
            "predicted": simulated_split(np.asarray(sub.trace.arrival_s), sub.scheduled_s, sub.first_token_s,
                                         model.router_gap_s, model.deliver_s),
        },
    }  # fmt: skip


def _by_rate(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate: mean TTFT and throughput over its runs (requests pooled), the measured spread
    (standard deviation of the runs' means over their mean) and the prediction's error."""
    out = []
    for rate in sorted({p["rate"] for p in points}):
        runs = [p for p in points if p["rate"] == rate]

        def pooled(side: str, key: str, runs: list[dict[str, Any]] = runs) -> float | None:
            vals = [(p[side][key]["mean"], p[side]["completed"]) for p in runs if p[side][key]["mean"] is not None]
            total = sum(c for _, c in vals)
            return sum(m * c for m, c in vals) / total if total else None

        m_ttft, p_ttft = pooled("measured", "ttft_s"), pooled("predicted", "ttft_s")
        m_thr = float(np.mean([p["measured"]["throughput_req_s"] for p in runs]))
        p_thr = float(np.mean([p["predicted"]["throughput_req_s"] for p in runs]))
        means = [p["measured"]["ttft_s"]["mean"] for p in runs if p["measured"]["ttft_s"]["mean"] is not None]
        spread = float(np.std(means, ddof=1) / np.mean(means)) if len(means) > 1 else None
        per_run = [p["error"]["ttft_mean_s"] for p in runs]
        err = {"throughput_req_s": _rel(p_thr, m_thr), "ttft_mean_s": _rel(p_ttft, m_ttft)}
        out.append({
            "rate": rate, "runs": len(runs),
            "ttft_mean_s": {"measured": m_ttft, "predicted": p_ttft, "measured_spread": spread,
                            "per_run_error": per_run},
            "throughput_req_s": {"measured": m_thr, "predicted": p_thr},
            "error": err, "within_target": all(e is not None and abs(e) <= TARGET for e in err.values()),
        })  # fmt: skip
    return out


def _rel(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured - 1 if predicted is not None and measured else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def main(argv: list[str] | None = None) -> Path:
    """The command line (module docstring); returns the result file."""
    p = argparse.ArgumentParser(prog="python -m bench.sim_validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--experiments", default="slora-s2,deltazip", help="comma-separated: slora-s2, deltazip")
    p.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals per validation trace (default 25)")
    p.add_argument(
        "--profile-duration", type=float, help="seconds of a profile trace (default 15 slora-s2, 60 deltazip)"
    )
    p.add_argument(
        "--warmup-duration",
        type=float,
        default=WARMUP_S,
        help=f"seconds of a warm-up trace, before the profile: simulated, not fitted (default {WARMUP_S:g}; 0: none)",
    )
    p.add_argument("--seeds", type=int, default=2, help="validation traces per rate (default 2; seeds 1000 j + 0..N-1)")
    p.add_argument("--n", type=int, default=100, help="slora-s2 adapters (default 100)")
    p.add_argument(
        "--rates-s2",
        default="8,28",
        help="slora-s2 req/s, comma-separated (default 8, the paper's, and 28, near where the H200 "
        "model's batch reaches --max-num-seqs 256)",
    )
    p.add_argument("--rates-deltazip", default="1", help="deltazip req/s, comma-separated (default 1)")
    p.add_argument(
        "--protocol",
        default="ws",
        choices=("ws", "sse"),
        help="ws (default): TTFT is the first token event, what the simulator predicts; sse: the "
        "first chunk with text (a token may decode to no text yet)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny CPU models, a few requests")
    p.add_argument("--save-recording", type=Path, help="also write the worker's steps and the clients' records here")
    p.add_argument("--from-recording", type=Path, help="no GPU: fit, simulate and compare from a --save-recording")
    p.add_argument("--devices", help="`cpu` or a CUDA id (default: 0 when CUDA is available)")
    p.add_argument("--daemon", type=Path, help="deltaserve binary (default: $DELTASERVE_BIN, target/release)")
    p.add_argument("--work-dir", type=Path, help="keep the model and variant files here (default: a temporary dir)")
    p.add_argument("--out-dir", type=Path, default=None, help=f"where results go (default {RESULTS})")
    a = p.parse_args(argv)
    auto, device = detect_devices()
    devices = "cpu" if a.smoke else (a.devices or auto)
    if devices == "cpu":
        device = "cpu"
    names = [x for x in a.experiments.split(",") if x]
    if a.from_recording is not None:  # offline: what --save-recording kept, fitted and simulated again
        runs = [from_recording(name, a.from_recording) for name in names]
        device = json.loads((a.from_recording / f"{names[0]}-replays.json").read_text())["context"]["device"]
    else:
        with work_directory(a.work_dir) as work:
            runs = [validate(name, a, work, devices, device) for name in names]
    payload = {"device": device, "commit": git_commit(), "target": TARGET, "smoke": a.smoke, "runs": runs,
               "within_target": all(r["within_target"] for r in runs)}  # fmt: skip
    name = "sim_validate-" + a.experiments.replace(",", "-") + ("-smoke" if a.smoke else "")
    path = write_result(name, payload, a.out_dir)
    print(path)
    return path


if __name__ == "__main__":
    main()
