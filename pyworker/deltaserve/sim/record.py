"""Recording what a daemon's worker runs, step by step, to fit latency models and to compare the
simulator's batches with the daemon's. The daemon runs ``<python> -m deltaserve.worker ...``;
:func:`recording_python` writes an executable that the daemon takes as its ``--python``, which
runs the real worker with its link wrapped so that every plan received and output sent is
appended to a JSONL file, one line per step::

    {"step_id": 7, "recv": 1234.5671, "sent": 1234.5893,      time.monotonic() (CLOCK_MONOTONIC,
     "new": [[req_id, tokens, computed, prompt_len, variant]],  shared by processes on one host)
     "running": [[req_id, tokens]], "released": [...], "ops": [[variant, op, kind]],
     "host_ready": [variant, ...], "gpu_ready": [variant, ...],   (gpu_ready since 2026-11-27)
     "timing": {"gap_us", "forward_us", "total_us", "busy_us", "floor_us"},   the worker's StepTiming
     "launch": [t0, t1], "finish": [t0, t1],    the executor's launch and finish of the step (host)
     "graph": false, "behind": true,            a captured graph replayed it; its launch returned
                                                before the step ahead of it ended on the device
     "device_s": 0.0071,                        CUDA events around its work (None on the CPU)
     "host_wait_s": 0.0}                        the launch's time blocked on variants' host reads

The executor's ``launch`` and ``finish`` are wrapped too (:func:`instrument_executor`): the
launch is the worker thread's host time for a step (under overlapped steps the output of the
step in flight waits for it), and the events give the step's device span: from the stream
reaching the step to its last kernel. A step whose launch returned while the step ahead still
ran (``behind``) had all its kernels queued before the device reached them, so its span is its
device time alone; otherwise the span includes launch-bound gaps.
``steps_to_samples`` turns a recording into latency-model samples (:mod:`deltaserve.sim.latency`
features; ``step_s`` the device span where the events recorded it, else the output-to-output
period ``sent[N] - max(recv[N], sent[N - 1])``), ``host_samples`` into host-launch samples, and
``router_gap_s`` measures a plan's trip from the router's scheduling to the worker,
``span_copy_bandwidths`` the variant copies to the GPU from the device spans, and
``worker_stall_s_per_seq`` the worker's pauses outside any launch. ``transfer_bandwidths`` measures
the variant tiers the way the simulator prices them: a ``to_host`` read from its plan's arrival to
its end (a launch's wait for it, or between the outputs around its ``host_ready``); a ``to_gpu``
copy as its step's worker time outside the forward pass beyond that of steps without copies.
A recording whose steps have ``gpu_ready`` comes from a worker that copies a delta's ``to_gpu`` beside
the steps (``adapters/delta_loads.py``) and reports it there: such a copy is in its step's time only
when a request of the step uses the delta (:func:`copies_beside`).
"""

from __future__ import annotations

import json
import os
import runpy
import stat
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deltaserve.sim.latency import dense_lane_buckets

RECORD_ENV = "DELTASERVE_SIM_RECORD"
"""Where the wrapped worker appends its steps (set by the script :func:`recording_python` writes)."""
DELAY_ENV = "DELTASERVE_SIM_RECORD_DELAY_S"
"""Seconds the wrapped worker waits before sending each step's output (tests: steps long enough
that arrivals never race an output)."""


STEP_TIMES: dict[int, dict[str, Any]] = {}
"""Step id -> what the wrapped executor measured of it (launch, finish, graph, behind, events),
until its output is recorded."""
_graph_replayed = [False]
_host_wait_s = [0.0]


def instrument_executor() -> None:
    """Wraps ``Executor.launch`` / ``Executor.finish`` and the graph replays so that each step's
    host launch, finish, graph use and device span land in :data:`STEP_TIMES` (module docstring)."""
    import torch

    from deltaserve.adapters.host_tier import HostTier
    from deltaserve.worker import cuda_graphs, mixed_graphs
    from deltaserve.worker.executor import Executor

    launch, finish, host_wait = Executor.launch, Executor.finish, HostTier.wait

    def timed_launch(self: Any, plan: Any, in_flight: Any) -> Any:
        cuda = self.device.type == "cuda"
        _graph_replayed[0] = False
        _host_wait_s[0] = 0.0
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.monotonic()
        out = launch(self, plan, in_flight)
        t1 = time.monotonic()
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        behind = in_flight is not None and not in_flight.is_done()
        STEP_TIMES[plan.step_id] = {"launch": [t0, t1], "graph": _graph_replayed[0], "behind": behind,
                                    "host_wait_s": _host_wait_s[0], "events": (start, end)}  # fmt: skip
        return out

    def timed_host_wait(self: Any, variant_id: int) -> Any:
        t0 = time.monotonic()
        try:
            return host_wait(self, variant_id)
        finally:
            _host_wait_s[0] += time.monotonic() - t0

    def timed_finish(self: Any, launched: Any) -> Any:
        t0 = time.monotonic()
        out = finish(self, launched)
        t1 = time.monotonic()
        rec = STEP_TIMES.get(launched.step_id)
        if rec is not None:
            rec["finish"] = [t0, t1]
            start, end = rec.pop("events", (None, None))
            if start is not None and end is not None:
                end.synchronize()
                rec["device_s"] = start.elapsed_time(end) / 1e3
        return out

    Executor.launch = timed_launch  # type: ignore[method-assign]
    Executor.finish = timed_finish  # type: ignore[method-assign]
    HostTier.wait = timed_host_wait  # type: ignore[method-assign]
    for graphs in (cuda_graphs.DecodeGraphs, mixed_graphs.MixedGraphs):
        for name in ("run_rows", "run"):  # whichever replays a captured step
            real = getattr(graphs, name, None)
            if callable(real):
                setattr(graphs, name, _flagging(real))


def _flagging(real: Any) -> Any:
    def replay(*args: Any, **kw: Any) -> Any:
        _graph_replayed[0] = True
        return real(*args, **kw)

    return replay


class RecordingLink:
    """A ``WorkerLink`` that records the plans it receives and the outputs it sends."""

    def __init__(self, link: Any, out: Path, delay_s: float = 0.0) -> None:
        self._link = link
        self._delay_s = delay_s
        self._out = open(out, "a", buffering=1)  # noqa: SIM115 (lives as long as the worker)
        self._plans: dict[int, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)

    def recv(self, timeout_s: float | None = None) -> bytes | None:
        from deltaserve import wire

        frame = self._link.recv(timeout_s)
        if frame is not None:
            now = time.monotonic()
            msg = wire.decode(frame)
            if isinstance(msg, wire.StepPlan):
                self._plans[msg.step_id] = {
                    "step_id": msg.step_id, "recv": now,
                    "new": [[n.req_id, n.num_scheduled_tokens, n.num_computed_tokens, n.num_prompt_tokens,
                             n.adapter_id] for n in msg.new_requests],
                    "running": [[r.req_id, r.num_scheduled_tokens] for r in msg.running],
                    "released": list(msg.released),
                    "ops": [[op.adapter_id, int(op.op), int(op.kind)] for op in msg.adapter_ops],
                }  # fmt: skip
        return frame

    def send(self, data: bytes, timeout_s: float | None = None) -> None:
        from deltaserve import wire

        msg = wire.decode(data)
        if self._delay_s and isinstance(msg, wire.StepOutput):
            time.sleep(self._delay_s)
        self._link.send(data, timeout_s)
        now = time.monotonic()
        if isinstance(msg, wire.StepOutput) and msg.step_id in self._plans:
            rec = self._plans.pop(msg.step_id)
            rec["sent"] = now
            t = msg.timing
            rec["timing"] = {"gap_us": t.gap_us, "forward_us": t.forward_us, "total_us": t.total_us,
                             "busy_us": t.busy_us, "floor_us": t.floor_us}  # fmt: skip
            rec["host_ready"] = list(msg.host_ready)
            rec["gpu_ready"] = list(msg.gpu_ready)
            rec.update({k: v for k, v in STEP_TIMES.pop(msg.step_id, {}).items() if k != "events"})
            self._out.write(json.dumps(rec, separators=(",", ":")) + "\n")


def recording_python(script: Path, out: Path, python: str = sys.executable, delay_s: float = 0.0) -> Path:
    """Writes an executable at ``script`` for the daemon's ``--python``: it runs the worker with
    its steps recorded to ``out`` (appended), each output held back ``delay_s`` seconds; any
    other module it runs (``deltaserve.demo_model``) runs unwrapped."""
    script = Path(script)
    env = f'{RECORD_ENV}="{Path(out).resolve()}" {DELAY_ENV}={float(delay_s)!r}'
    script.write_text(
        "#!/bin/sh\n# The worker runs recorded; anything else the daemon runs (the demo model's set-up) as is.\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "deltaserve.worker" ]; then\n'
        f'  {env} exec "{python}" -m deltaserve.sim.record "$@"\nfi\nexec "{python}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def read_steps(path: Path) -> list[dict[str, Any]]:
    """A recording's steps, in the order the worker ran them."""
    steps = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(steps, key=lambda s: s["sent"])


def step_periods(steps: list[dict[str, Any]]) -> list[float]:
    """Device seconds of each step: from when it could start (its plan received, the previous
    output sent) to its output being sent."""
    out, prev = [], -float("inf")
    for s in steps:
        out.append(s["sent"] - max(s["recv"], prev))
        prev = s["sent"]
    return out


def steps_to_samples(
    steps: list[dict[str, Any]],
    ranks: Mapping[int, int],
    deltas: set[int],
    skip_loads: bool = True,
    device_spans: bool = True,
    dense_min_m: int | None = None,
    dense_lane_base_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """Latency-model samples of a recording; ``ranks`` gives each LoRA variant id's rank,
    ``deltas`` the variant ids that are deltas, ``dense_min_m`` the worker's dense-prefill
    threshold and ``dense_lane_base_tokens`` its dense lane's (:func:`step_features`). With
    ``skip_loads``, steps that loaded a variant to the GPU or waited for a delta's copy beside the
    steps (:func:`copy_waits`) are left out (their time includes the copy, which the model prices
    apart). Each sample's ``run`` counts the steps left out before it: samples of one run are
    consecutive steps (``LatencyModel.fit``'s windows stay within a run). With ``device_spans`` and a
    recording that has them, ``step_s`` is each step's device span, of the steps launched behind
    a running one only (``behind``: spans without launch gaps, which the host-launch model prices)
    for each step kind that has some; else the output-to-output period."""
    spans = device_spans and any(s.get("device_s") for s in steps)
    rows = step_features(steps, ranks, deltas, dense_min_m, dense_lane_base_tokens)
    clean = {_kind(f) for s, f, _ in rows if spans and s.get("device_s") and s.get("behind")}
    samples = []
    run = 0
    for (s, f, period), waited in zip(rows, copy_waits(steps, deltas)):
        loads = waited or any(op[1] == TO_GPU for op in s["ops"])
        t = s.get("device_s") if spans else period
        keep = t is not None and t > 0 and (s.get("behind") or _kind(f) not in clean)
        if keep and not (skip_loads and loads):
            samples.append({**f, "step_s": t, "run": run})
        else:
            run += 1
    return samples


def _kind(features: Mapping[str, float]) -> str:
    return "prefill" if features["prefill_tokens"] > 0 else "decode"


def host_samples(
    steps: list[dict[str, Any]],
    ranks: Mapping[int, int],
    deltas: set[int],
    dense_min_m: int | None = None,
    dense_lane_base_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """Host-launch samples (``LatencyModel.fit_host``): each recorded step's features
    (:func:`step_features`) with ``host_s``, its launch's seconds; steps that copied a variant to
    the GPU or waited for a delta's copy beside the steps (:func:`copy_waits`) are left out (the copy is
    priced apart), as are recordings without launch times."""
    rows = step_features(steps, ranks, deltas, dense_min_m, dense_lane_base_tokens)
    return [{**f, "host_s": s["launch"][1] - s["launch"][0]}
            for (s, f, _), waited in zip(rows, copy_waits(steps, deltas))
            if "launch" in s and not waited and not any(op[1] == TO_GPU for op in s["ops"])]  # fmt: skip


def router_gap_s(steps: list[dict[str, Any]]) -> float | None:
    """Median seconds from the router forming a plan to the worker receiving it, over the plans
    formed ahead: under overlapped steps plan N is formed when output N - 2 arrives (N - 1 in
    flight), so its trip is ``recv[N] - sent[N - 2]`` when it came before ``sent[N - 1]``. None
    when no plan was formed ahead."""
    gaps = [s["recv"] - steps[i - 2]["sent"] for i, s in enumerate(steps)
            if i >= 2 and steps[i - 2]["sent"] <= s["recv"] < steps[i - 1]["sent"]]  # fmt: skip
    return float(np.median(gaps)) if gaps else None


def _prompt_steps(steps: list[dict[str, Any]], deltas: Collection[int]) -> Iterator[tuple[dict[str, Any], int, bool]]:
    """The recorded steps with a prompt chunk (a new request, or a running one computing more than one
    token), each with its tokens and whether it has rows of ``deltas`` (variant ids; a request's variant
    is known from the step that admitted it)."""
    variant: dict[int, int] = {}
    for s in steps:
        for rid, _n, _c, _p, v in s["new"]:
            variant[rid] = v
        if s["new"] or any(n > 1 for _, n in s["running"]):
            rids = [n[0] for n in s["new"]] + [rid for rid, _ in s["running"]]
            tokens = sum(n[1] for n in s["new"]) + sum(n for _, n in s["running"])
            yield s, tokens, any(variant.get(rid, 0) in deltas for rid in rids)


def graph_rule(steps: list[dict[str, Any]], deltas: Collection[int] = ()) -> tuple[int, int, int]:
    """``(graph_max_batch, graph_max_tokens, graph_max_delta_tokens)`` as the recording shows them: the
    most requests of a step a graph replayed, the most tokens of a replayed step that prefilled, and of
    one of those with rows of ``deltas`` (variant ids; 0: none seen)."""
    most = max((len(s["new"]) + len(s["running"]) for s in steps if s.get("graph")), default=0)
    tokens = delta_tokens = 0
    for s, t, delta_rows in _prompt_steps(steps, deltas):
        if s.get("graph"):
            tokens = max(tokens, t)
            if delta_rows:
                delta_tokens = max(delta_tokens, t)
    return most, tokens, delta_tokens


def keeps_delta_steps_within(steps: list[dict[str, Any]], deltas: Collection[int], limit: int) -> bool:
    """Whether the recorded router kept the prompt chunks of steps with rows of ``deltas`` (variant ids)
    within ``limit`` tokens, as it does since 2026-11-28 (``delta_graph_tokens``, the worker's largest
    delta graph bucket): no recorded step with such rows and a prompt chunk passed it, unless its decodes
    alone did. An older router whose steps never passed it formed the steps a limit would have."""
    if limit <= 0:
        return False
    for s, tokens, delta_rows in _prompt_steps(steps, deltas):
        decodes = sum(n == 1 for _, n in s["running"])
        if delta_rows and tokens > limit and decodes < limit:
            return False
    return True


TO_HOST, TO_GPU, DROP_GPU = 0, 1, 2
"""``TierOp`` values in a recording's ``ops``."""


def copies_waited(steps: list[dict[str, Any]]) -> list[bool]:
    """Per recorded step: whether one of its copies to the GPU waited for its variant's read (a
    ``to_host`` in that step or earlier whose ``host_ready`` came in no earlier step) and the
    recording does not say for how long (``host_wait_s``, recorded since 2026-11-26). The worker
    blocks on the read inside the step, so such a step's time holds the read's rest as well as the
    copy, and a copy priced from it comes out many times too slow: on an H100 DeltaZip recording
    (7debbdc) the steps whose read was done took 0.06-0.54 s with their copy, those that waited
    0.67-3.07 s, and the copies priced from all of them 3.05 GB/s instead of ~25. Where the wait
    is recorded, :func:`copy_time_s` takes it out instead."""
    reading: set[int] = set()
    waited = []
    for s in steps:
        reading |= {v for v, op, _kind in s["ops"] if op == TO_HOST}
        unknown = "host_wait_s" not in s
        waited.append(unknown and any(op == TO_GPU and v in reading for v, op, _kind in s["ops"]))
        reading -= set(s.get("host_ready", ()))
    return waited


def copy_time_s(step: Mapping[str, Any], beyond_s: float) -> float:
    """A step's time left to its copies: ``beyond_s`` (its time beyond what it computes) less the
    launch's recorded wait for host reads."""
    return beyond_s - step.get("host_wait_s", 0.0)


READ_END_SLACK = 0.25
"""A read whose end a recording knows only to within more than this fraction of its duration (half
the gap between two outputs: :func:`read_end_s`) is left out of the disk bandwidth when a kind has
reads known better."""


def read_end_s(step: dict[str, Any], variant: int, last_sent: float | None) -> tuple[float, float]:
    """When variant ``variant``'s host read ended, and within how many seconds, from the step whose
    output reports it in ``host_ready`` (``last_sent``: the output before it). A step whose launch
    blocked on the read (it copies the variant: the router sends the read, the copy and the prefill
    in one plan) ended its wait then: the launch's start plus its ``host_wait_s`` (the wait comes
    first in a launch), exact. Such a step's output leaves after the copy and the prefill too: on an
    H200 DeltaZip recording those reads measured 0.95-1.19 s to the output and 0.68-0.90 s to the
    wait's end, so pricing reads to the output made every cold request pay its copy and prefill
    twice in the simulator. A read that ended while other steps ran (or the worker idled) is
    reported by the first output after it: the midpoint of that output and the one before, within
    half their gap."""
    launch = step.get("launch")
    copies = any(v == variant and op == TO_GPU for v, op, _kind in step["ops"])
    if copies and launch and step.get("host_wait_s", 0.0) > 0:
        return float(launch[0]) + float(step["host_wait_s"]), 0.0
    sent = float(step["sent"])
    if last_sent is None:
        return sent, 0.0
    return (last_sent + sent) / 2, (sent - last_sent) / 2


def transfer_bandwidths(
    steps: list[dict[str, Any]], variants: Mapping[int, tuple[str, int]]
) -> dict[str, dict[str, float]]:
    """Measured tier bandwidths of a recording (module docstring): ``{"disk_to_host_bps": {kind:
    B/s}, "host_to_gpu_bps": {kind: B/s}}``, per kind the median over its reads (copies: over the
    steps that copied it) of bytes per second, for the kinds with a measurement: a one-off (the
    first read, a copy in a step that also compiled a kernel) is one sample, not a weight on the
    rest. ``variants`` maps a variant id to ``(kind, host bytes)``.

    A read's time is its ``to_host`` plan's arrival to its end (:func:`read_end_s`: the end of the
    wait of a step that blocked on it, else the midpoint between the output reporting it in
    ``host_ready`` and the one before; reads known to within ``READ_END_SLACK`` of their time when a
    kind has any) (the worker runs several reads at once, as the simulator does: each is one
    reader's time).
    A copy's time is its step's worker time outside the forward pass (``busy_us - forward_us``)
    beyond the median of that over the steps without tier ops, shared by bytes among the
    step's copies; steps whose copies waited for a read (:func:`copies_waited`) measure none, nor do
    copies beside the steps (:func:`copies_beside`)."""
    reads: dict[str, list[tuple[float, bool]]] = {}  # (B/s, end known within READ_END_SLACK)
    copies_bps: dict[str, list[float]] = {}
    started: dict[int, float] = {}
    outside = [_outside_forward_s(s) for s in steps if not s["ops"] and "timing" in s]
    baseline = float(np.median(outside)) if outside else 0.0
    last_sent: float | None = None
    beside = reports_gpu_loads(steps)
    for s, waited in zip(steps, copies_waited(steps)):
        for v, op, _kind in s["ops"]:
            if op == TO_HOST and v in variants:
                started.setdefault(v, s["recv"])
        for v in s.get("host_ready", []):
            if v in started and v in variants:
                kind, size = variants[v]
                end, within = read_end_s(s, v, last_sent)
                took = end - started.pop(v)
                if took > 0:
                    reads.setdefault(kind, []).append((size / took, within <= READ_END_SLACK * took))
        last_sent = s["sent"]
        copies = _copies(s, variants, beside)
        if copies and not waited and "timing" in s:
            _add_copy_rate(copies_bps, s, copies, _outside_forward_s(s) - baseline)
    return {
        "disk_to_host_bps": {
            k: float(np.median([b for b, ok in v if ok] or [b for b, _ in v])) for k, v in reads.items()
        },
        "host_to_gpu_bps": {k: float(np.median(v)) for k, v in copies_bps.items()},
    }


def span_copy_bandwidths(
    steps: list[dict[str, Any]],
    ranks: Mapping[int, int],
    deltas: set[int],
    variants: Mapping[int, tuple[str, int]],
    predict: Any,
    dense_min_m: int | None = None,
    dense_lane_base_tokens: int | None = None,
) -> dict[str, float]:
    """Host -> GPU bandwidth per variant kind from the device spans (where recorded): a step's
    copies take its span beyond ``predict(features)`` (the device model's time for the step without
    them; features as :func:`step_features`'s), shared by bytes among its copies, per kind the
    median over the steps that copied it of bytes per second (as :func:`transfer_bandwidths`); steps
    whose copies waited for a read (:func:`copies_waited`) measure none, nor do copies beside the steps
    (:func:`copies_beside`). Copies queue on the device (``non_blocking``; a delta's on its load stream,
    which a step that admits its request waits for), so the host times of :func:`transfer_bandwidths`
    do not see them on a GPU."""
    rates: dict[str, list[float]] = {}
    rows = step_features(steps, ranks, deltas, dense_min_m, dense_lane_base_tokens)
    beside = reports_gpu_loads(steps)
    for (s, f, _), waited in zip(rows, copies_waited(steps)):
        copies = _copies(s, variants, beside)
        if copies and not waited and s.get("device_s"):
            _add_copy_rate(rates, s, copies, s["device_s"] - predict(f))
    return {k: float(np.median(v)) for k, v in rates.items()}


def reports_gpu_loads(steps: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the recording comes from a worker that copies a delta's ``to_gpu`` beside the steps and
    reports it (``StepOutput.gpu_ready``, recorded with every step since 2026-11-27; the router's
    ``gpu_load_reports``). Older recordings have no ``gpu_ready``: their copies ran in their steps."""
    return any("gpu_ready" in s for s in steps)


def copies_beside(step: Mapping[str, Any], deltas: Collection[int]) -> set[int]:
    """The deltas (of variant ids ``deltas``) whose copies to the GPU the recorded ``step`` sent beside
    the steps, outside its time, in a recording that :func:`reports_gpu_loads`: a delta loaded ahead of
    its requests, none of which the step admits (with nothing else to run the router admits a request
    with its delta's ``to_gpu``, and the step waits for the copy: that one is in its time, as every
    copy of a LoRA adapter)."""
    used = {n[4] for n in step["new"]}
    return {v for v, op, _kind in step["ops"] if op == TO_GPU and v in deltas and v not in used}


def copy_waits(steps: list[dict[str, Any]], deltas: Collection[int]) -> list[bool]:
    """Per recorded step: whether it waited for part of a copy beside the steps sent in an earlier step
    (:func:`copies_beside`): it admits a request of a delta whose copy no earlier output reported in
    ``gpu_ready`` (with nothing else to run, the router admits it while the delta loads, and the step
    waits for the rest). All False for a recording that does not :func:`reports_gpu_loads`."""
    if not reports_gpu_loads(steps):
        return [False] * len(steps)
    loading: set[int] = set()
    waited = []
    for s in steps:
        used = {n[4] for n in s["new"]}
        waited.append(bool(used & loading))
        loading -= used  # copied once this step ran
        loading -= {v for v, op, _kind in s["ops"] if op == DROP_GPU}
        loading |= copies_beside(s, deltas)
        loading -= set(s.get("gpu_ready", ()))
    return waited


def _copies(
    step: Mapping[str, Any], variants: Mapping[int, tuple[str, int]], beside: bool = False
) -> list[tuple[str, int]]:
    """``(kind, host bytes)`` of each variant the step copied to the GPU within its time (``beside``: the
    recording :func:`reports_gpu_loads`, and :func:`copies_beside` are left out)."""
    deltas = {v for v, (kind, _) in variants.items() if kind == "delta"}
    away = copies_beside(step, deltas) if beside else set()
    return [variants[v] for v, op, _kind in step["ops"] if op == TO_GPU and v in variants and v not in away]


def _add_copy_rate(
    rates: dict[str, list[float]], step: Mapping[str, Any], copies: list[tuple[str, int]], beyond_s: float
) -> None:
    """One step's copies as one sample per kind copied: their bytes over the step's time left to them
    (:func:`copy_time_s` of ``beyond_s``); none where that is not positive (a copy hidden under the
    step, or noise)."""
    extra = copy_time_s(step, beyond_s)
    if extra > 1e-6:
        for kind in {k for k, _ in copies}:
            rates.setdefault(kind, []).append(sum(b for _, b in copies) / extra)


def _outside_forward_s(step: Mapping[str, Any]) -> float:
    """A recorded step's worker time outside its forward pass, seconds: of the step alone
    (``busy_us``) where recorded, else of its whole period (``total_us``, which under overlapped
    steps includes the wait for the step ahead)."""
    t = step["timing"]
    return (t.get("busy_us") or t["total_us"]) / 1e6 - t["forward_us"] / 1e6


STALL_MIN_S = 0.05
"""An output later than its step's device span and the next step's launch by more than this is a
stall (:func:`worker_stall_s_per_seq`); shorter gaps are the pipeline's own (encode, send)."""


def worker_stall_s_per_seq(steps: list[dict[str, Any]]) -> float:
    """Expected seconds the worker stalls per request of a step (``LatencyModel.stall_s_per_seq``),
    from the steps launched behind a running one that have a device span: there an output follows
    the one before it by the step's span, or by the next step's launch when the loop launched that
    first (its host time, which the host model prices). What comes later than both by more than
    ``STALL_MIN_S`` is a stall: a pause of the worker's host outside any launch (on an H200 S-LoRA S2
    recording, 0.11-0.18 s every 48-60 steps at ~250 running requests, in a step's ``finish`` or
    before its output). Their total over the requests of those steps; 0 without spans."""
    stalled = 0.0
    seqs = 0
    by_id = {s["step_id"]: s for s in steps}
    previous: float | None = None
    for s in steps:
        period = None if previous is None else s["sent"] - previous
        previous = s["sent"]
        if period is None or not s.get("device_s") or not s.get("behind"):
            continue
        seqs += len(s["new"]) + len(s["running"])
        after = by_id.get(s["step_id"] + 1)
        launch = after["launch"][1] - after["launch"][0] if after and after.get("launch") else 0.0
        late = period - max(float(s["device_s"]), launch)
        if late > STALL_MIN_S:
            stalled += late
    return stalled / seqs if seqs else 0.0


def step_features(
    steps: list[dict[str, Any]],
    ranks: Mapping[int, int],
    deltas: set[int],
    dense_min_m: int | None = None,
    dense_lane_base_tokens: int | None = None,
) -> list[tuple[dict[str, Any], dict[str, float], float]]:
    """``(step, latency-model features, device seconds)`` of every recorded step, in order: the
    features the simulator computes for a step it schedules (``step_features`` in
    ``router/crates/py/src/sim_latency.rs``, tests/sim checks they agree). In an eager step, prefill
    chunks of a delta of at least ``dense_min_m`` tokens run dense (``LatencyModel.dense_min_m``; None:
    none); in a replayed one (``graph``), the delta in the dense lane does (:func:`dense_lane_delta`,
    threshold base ``dense_lane_base_tokens``, ``LatencyModel.dense_lane_base_tokens``; None: none)."""
    lane = None if dense_lane_base_tokens is None else dense_lane_buckets(dense_lane_base_tokens)
    cached: dict[int, int] = {}
    variant: dict[int, int] = {}
    out = []
    for s, period in zip(steps, step_periods(steps)):
        for rid in s["released"]:
            cached.pop(rid, None)
        f = {k: 0.0 for k in ("tokens", "seqs", "prefill_tokens", "context_tokens", "prefill_attention",
                              "lora_tokens", "delta_tokens")}  # fmt: skip
        loras: set[int] = set()
        tokens_by_delta: dict[int, int] = {}  # in the order of each delta's first row
        dense: set[int] = set()
        chunks = [(r, n, c, True) for r, n, c, _p, v in s["new"]]
        for r, _n, _c, _p, v in s["new"]:
            variant[r] = v
        chunks += [(r, n, cached.get(r, 0), n > 1) for r, n in s["running"]]
        for rid, n, start, prefill in chunks:
            cached[rid] = start + n
            f["tokens"] += n
            f["seqs"] += 1
            f["context_tokens"] += start + n
            if prefill:
                f["prefill_tokens"] += n
                f["prefill_attention"] += n * (start + n)
            v = variant.get(rid, 0)
            if v in deltas:
                f["delta_tokens"] += n
                tokens_by_delta[v] = tokens_by_delta.get(v, 0) + n
                if prefill and dense_min_m is not None and n >= dense_min_m:
                    dense.add(v)
            elif v:
                f["lora_tokens"] += n
                loras.add(v)
        f["lora_segments"] = len(loras)
        f["lora_rank_sum"] = sum(ranks.get(v, 0) for v in loras)
        f["deltas"] = len(tokens_by_delta)
        f["eager"] = 0.0 if s.get("graph") else 1.0
        if f["eager"]:
            f["dense_delta_segments"] = len(dense)
        else:  # a graph: the deltas on the work tiles, but for one in the dense lane
            f["dense_delta_segments"] = float(dense_lane_delta(f, tokens_by_delta, lane) is not None)
        out.append((s, f, period))
    return out


def dense_lane_delta(
    features: Mapping[str, float], tokens_by_delta: Mapping[int, int], lane: Sequence[tuple[int, int]] | None
) -> int | None:
    """The delta the worker runs in the dense lane of a replayed step of ``features`` (``DeltaPool.dense_lane_for``;
    ``LatencyModel::dense_lane_delta`` in ``router/crates/py/src/sim_latency.rs`` is the simulator's): in a
    step that prefills, padded to the smallest ``(bucket, fewest lane tokens)`` of ``lane``
    (``latency.dense_lane_buckets``) holding its tokens, the delta of ``tokens_by_delta`` (its rows' tokens,
    in row order) with the most tokens, the first of those tied, if it has at least the bucket's fewest.
    None in a decode step (the decode graphs have no lane), past the largest bucket and without ``lane``."""
    if lane is None or not features["prefill_tokens"] or not tokens_by_delta:
        return None
    fewest = next((least for bucket, least in lane if bucket >= features["tokens"]), None)
    most = max(tokens_by_delta, key=tokens_by_delta.__getitem__)
    return most if fewest is not None and tokens_by_delta[most] >= fewest else None


def main() -> None:
    """The wrapped worker: ``python -m deltaserve.sim.record -m deltaserve.worker ARGS...``."""
    out = os.environ.get(RECORD_ENV)
    args = sys.argv[1:]
    if args[:2] == ["-m", "deltaserve.worker"]:
        args = args[2:]
    if not out:
        raise SystemExit(f"{RECORD_ENV} is not set: run through the script recording_python() writes")
    from deltaserve import _native

    real = _native.WorkerLink
    instrument_executor()
    delay_s = float(os.environ.get(DELAY_ENV) or 0.0)
    _native.WorkerLink = lambda *a, **kw: RecordingLink(real(*a, **kw), Path(out), delay_s)  # type: ignore[misc,assignment]
    sys.argv = ["deltaserve.worker", *args]
    runpy.run_module("deltaserve.worker", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
