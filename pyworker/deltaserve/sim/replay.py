"""``replay()``: one simulated run of a trace through the real scheduler (the Rust loop,
``_native.simulate``) and its figures (:class:`SimResult`), with the same definitions as the
serving benchmark's replay client (``bench/replay.py``'s ``summarize``):

    ttft      first token - arrival            tpot  (finish - first token) / (outputs - 1)
    e2e       finish - arrival                 makespan  last finish - first arrival
    throughput  completed requests (and their output tokens) / makespan
    SLO attainment  share of all requests (refused ones miss) with ttft <= slo_ttft_s, with
              tpot <= slo_tpot_s (one-token requests meet it; None: every completed one), both

Arrivals are placed across the workers by the router's own ``--placement`` policy
(``placement``: one of ``_native.PLACEMENTS``; default ``least-loaded``, the simulator's rule
before placement existed), priced with the run's latency model (its JSON, as the daemon's
``--latency-profile`` reads it) and ``slo_tpot_s`` as the daemon's ``--tpot-slo-ms``.

``daemon_config()`` builds the scheduler config the daemon would give one worker of the modelled
GPU: the pool from the latency model's memory, the delta slots' bytes taken out of it, host copy
and GPU load reports on (as ``router/crates/server/src/engine/plan.rs``: a delta's copy to the GPU
runs beside the steps, its requests admitted once it is reported); every other limit is the
scheduler's own default (``_native.SchedulerConfig``) unless given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from deltaserve import _native
from deltaserve.sim.latency import LatencyModel
from deltaserve.sim.trace import SimTrace, load_trace

SLO_TTFT_S = 6.0
"""S-LoRA's TTFT SLO: the first token within 6 seconds."""


def daemon_config(
    model: LatencyModel,
    *,
    max_num_seqs: int | None = None,
    max_deltas: int | None = None,
    max_num_batched_tokens: int | None = None,
    host_adapter_bytes: int | None = None,
    block_size: int = 16,
) -> _native.SchedulerConfig:
    """The scheduler config of one daemon worker on the modelled GPU (module docstring); raises
    ``ValueError`` when the delta slots leave no KV page."""
    mem = model.memory
    probe = _native.SchedulerConfig(block_size, 1, 1)
    slots = probe.max_deltas if max_deltas is None else max_deltas
    page = mem.kv_bytes_per_token * block_size
    num_blocks = (mem.kv_pool_bytes - slots * mem.delta_bytes) // page
    if num_blocks < 1:
        raise ValueError(f"{slots} delta slots of {mem.delta_bytes} bytes leave no KV page in a pool of "
                         f"{mem.kv_pool_bytes} bytes")  # fmt: skip
    cfg = _native.SchedulerConfig(block_size, num_blocks, min(mem.max_model_len, num_blocks * block_size))
    cfg.max_deltas = slots
    cfg.host_copy_reports = True
    cfg.gpu_load_reports = True
    cfg.delta_graph_tokens = int(model.graph_max_delta_tokens)  # the worker's Hello: its largest delta graph
    if max_num_seqs is not None:
        cfg.max_num_seqs = max_num_seqs
    if max_num_batched_tokens is not None:
        cfg.max_num_batched_tokens = max_num_batched_tokens
    if host_adapter_bytes is not None:
        cfg.host_adapter_bytes = host_adapter_bytes
    cfg.validate()
    return cfg


def percentiles(values: np.ndarray) -> dict[str, float | None]:
    """mean, p50, p90, p99 (numpy linear interpolation); None for no values."""
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass
class SimResult:
    """One simulated run: per-request times (trace order; NaN where a request never got there)
    and the run's counters. :meth:`summary` gives the figures (module docstring)."""

    trace: SimTrace
    """The requests replayed."""
    first_token_s: np.ndarray
    """When each request's first token came (NaN: refused)."""
    finish_s: np.ndarray
    """When each request finished (NaN: refused)."""
    output_tokens: np.ndarray
    """Output tokens each request got."""
    worker_of: np.ndarray
    """The worker each request went to (-1: refused, the queue limit was reached)."""
    busy_s: list[float]
    """Device seconds each worker was busy (its steps; delta copies beside them not counted)."""
    counters: dict[str, int]
    """Scheduler counters over all workers: steps, num_preemptions, adapter_gpu_loads,
    adapter_host_loads, adapter_gpu_evictions, delta_skips, host_deferrals, ..."""
    peaks: dict[str, int]
    """Largest on any worker: kv_blocks, lora_blocks (pages), host_bytes, deltas_on_gpu,
    running, waiting."""
    config: dict[str, Any]
    """The scheduler config replayed (``SchedulerConfig.as_dict()``) and the workers."""
    slo_ttft_s: float = SLO_TTFT_S
    """TTFT SLO of the attainment figures."""
    slo_tpot_s: float | None = None
    """TPOT SLO (None: not judged)."""
    steps: list[tuple[int, int, bool, float, float, list[tuple[int, int]], int, dict[str, float]]] = field(
        default_factory=list
    )
    """With ``record_steps``: ``(worker, step_id, ahead, start_s, end_s, [(request, tokens)],
    prefill_tokens, features)`` per step in launch order; requests listed new first, then running;
    ``features`` the latency model's (``deltaserve.sim.latency``), by name."""
    scheduled_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """When each request was first sent to a worker in a plan (NaN: never): ``scheduled_s -
    arrival`` is its wait for a step, ``first_token_s - scheduled_s`` its steps' time."""

    def last(self, n: int) -> SimResult:
        """The run's last ``n`` requests (a trace replayed after a warm-up): their times, with the
        run's counters, peaks and steps as they are."""
        keep = slice(len(self.trace) - n, None)
        t = self.trace
        trace = replace(t, arrival_s=t.arrival_s[keep], prompt_len=t.prompt_len[keep],
                        output_len=t.output_len[keep], variant=t.variant[keep],
                        prompt_key=None if t.prompt_key is None else t.prompt_key[keep])  # fmt: skip
        return replace(self, trace=trace, first_token_s=self.first_token_s[keep], finish_s=self.finish_s[keep],
                       scheduled_s=self.scheduled_s[keep], output_tokens=self.output_tokens[keep],
                       worker_of=self.worker_of[keep])  # fmt: skip

    @property
    def completed(self) -> np.ndarray:
        """Mask of the requests that finished."""
        return ~np.isnan(self.finish_s)

    def summary(self) -> dict[str, Any]:
        """The run's figures, JSON-ready."""
        arrival = np.asarray(self.trace.arrival_s)
        done = self.completed
        n = len(arrival)
        ttft = self.first_token_s - arrival
        e2e = self.finish_s - arrival
        outs = self.output_tokens
        multi = done & (outs >= 2)
        tpot = np.full(n, np.nan)
        tpot[multi] = (self.finish_s[multi] - self.first_token_s[multi]) / (outs[multi] - 1)
        makespan = float(self.finish_s[done].max() - arrival.min()) if done.any() else 0.0
        ttft_ok = done & (ttft <= self.slo_ttft_s)
        tpot_ok = done if self.slo_tpot_s is None else done & (np.isnan(tpot) | (tpot <= self.slo_tpot_s))
        page = self.config.get("block_size", 16)
        return {
            "requests": n,
            "completed": int(done.sum()),
            "refused": int((self.worker_of < 0).sum()),
            "makespan_s": makespan,
            "throughput_req_s": done.sum() / makespan if makespan > 0 else 0.0,
            "throughput_out_tok_s": float(outs[done].sum()) / makespan if makespan > 0 else 0.0,
            "output_tokens": int(outs[done].sum()),
            "ttft_s": percentiles(ttft[done]),
            "tpot_s": percentiles(tpot[multi]),
            "e2e_s": percentiles(e2e[done]),
            "slo": {
                "ttft_s": self.slo_ttft_s,
                "tpot_s": self.slo_tpot_s,
                "ttft_attainment": float(ttft_ok.sum()) / n if n else None,
                "tpot_attainment": float(tpot_ok.sum()) / n if n else None,
                "attainment": float((ttft_ok & tpot_ok).sum()) / n if n else None,
            },
            "preemptions": self.counters.get("num_preemptions", 0),
            "adapter_gpu_loads": self.counters.get("adapter_gpu_loads", 0),
            "adapter_host_loads": self.counters.get("adapter_host_loads", 0),
            "adapter_gpu_evictions": self.counters.get("adapter_gpu_evictions", 0),
            "steps": self.counters.get("steps", 0),
            "peak": {**self.peaks, "kv_tokens": self.peaks.get("kv_blocks", 0) * page},
            "utilization": [b / makespan if makespan > 0 else 0.0 for b in self.busy_s],
            "config": self.config,
        }


def variant_footprints(trace: SimTrace, model: LatencyModel, block_size: int) -> list[tuple[str, int, int, int]]:
    """``(kind, pool pages, host bytes, rank)`` of every variant of the trace on the modelled GPU."""
    mem = model.memory
    out = []
    for v in trace.variants:
        if v.kind == "delta":
            out.append(("delta", 0, mem.delta_bytes, 0))
        else:
            pages = math.ceil(v.rank * mem.lora_pages_per_rank * 16 / block_size)
            out.append(("lora", max(1, pages), v.rank * mem.lora_bytes_per_rank, v.rank))
    return out


def replay(
    trace: Any,
    config: _native.SchedulerConfig | None = None,
    latency_model: LatencyModel | None = None,
    seed: int = 0,
    *,
    workers: int = 1,
    slo_ttft_s: float = SLO_TTFT_S,
    slo_tpot_s: float | None = None,
    overlap_steps: bool = True,
    noise: float = 0.0,
    router_gap_s: float | None = None,
    max_queued_per_worker: int | None = None,
    step_times: list[float] | None = None,
    record_steps: bool = False,
    placement: str = "least-loaded",
) -> SimResult:
    """Replays ``trace`` (:func:`deltaserve.sim.trace.load_trace`'s sources) through ``workers``
    copies of the daemon's scheduler with ``config`` (default: :func:`daemon_config` of the
    model) on a virtual clock priced by ``latency_model`` (default: the bundled model,
    :func:`deltaserve.sim.default_model`). ``noise`` (the standard deviation of the log of a
    mean-1 step-time factor) draws from ``seed``; the same arguments give the same result.
    ``step_times`` replaces the model's device time of each step in launch order (one worker).
    ``placement`` picks each arrival's worker (module docstring). The model's daemon terms
    (host launch time, graph rule, ``ingress_s``, ``deliver_s``, ``router_gap_s`` unless given)
    time the pipeline around the device (``deltaserve.sim.latency``) A trace with prompt keys
    (``SimTrace.prompt_key``) runs with the daemon's prefix caching (on by default there); one
    without, as before them, without. Bad input raises
    ``ValueError`` naming it."""
    from deltaserve.sim.models import default_model

    sim_trace = load_trace(trace)
    model = latency_model or default_model()
    cfg = config or daemon_config(model)
    cfg.validate()
    requests = list(zip(sim_trace.arrival_s, sim_trace.prompt_len, sim_trace.output_len, sim_trace.variant))
    out = _native.simulate(
        cfg, requests, variant_footprints(sim_trace, model, cfg.block_size), model.native(), workers=workers,
        overlap_steps=overlap_steps, router_gap_s=model.router_gap_s if router_gap_s is None else router_gap_s,
        noise=noise, seed=seed, max_queued_per_worker=max_queued_per_worker, step_times=step_times,
        record_steps=record_steps, placement=placement, latency_profile=json.dumps(model.to_dict()),
        tpot_slo_s=slo_tpot_s, prompt_keys=None if sim_trace.prompt_key is None else list(sim_trace.prompt_key),
        **model.native_options(),
    )  # fmt: skip
    return SimResult(
        trace=sim_trace,
        first_token_s=np.asarray(out["first_token_s"], dtype=np.float64),
        finish_s=np.asarray(out["finish_s"], dtype=np.float64),
        scheduled_s=np.asarray(out["scheduled_s"], dtype=np.float64),
        output_tokens=np.asarray(out["output_tokens"], dtype=np.int64),
        worker_of=np.asarray(out["worker_of"], dtype=np.int64),
        busy_s=list(out["busy_s"]),
        counters=dict(out["counters"]),
        peaks=dict(out["peaks"]),
        config={**cfg.as_dict(), "workers": workers, "overlap_steps": overlap_steps, "placement": placement},
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
        steps=list(out["steps"]),
    )
