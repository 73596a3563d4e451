"""The latency model's features have one definition on two sides: the simulator computes them for
the steps its scheduler forms (``step_features`` in router/crates/py/src/sim_latency.rs), the
recording side for the steps a daemon's worker ran (``deltaserve.sim.record.step_features``), and
the model fitted on the one prices the other. Here both see the same steps. Small traces: well
under a second each."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from deltaserve import _native, sim
from deltaserve.sim.record import step_features
from deltaserve.sim.trace import from_requests

DENSE_MIN_M = 64
"""The worker's threshold on CUDA (``sbmm.dense_min_m``)."""


def mixed_trace(n: int = 80, rate: float = 40.0, seed: int = 0) -> sim.SimTrace:
    """Base, 2 LoRA adapters and 4 deltas; prompts of 8..1200 tokens, a quarter each of the threshold
    and one less, so that chunks of a delta fall on both sides of it and long prompts are split."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    variants = [{"name": f"a{i}", "kind": "lora", "rank": 8 << i} for i in range(2)]
    variants += [{"name": f"d{i}", "kind": "full"} for i in range(4)]
    names = [None] + [v["name"] for v in variants]
    reqs = [{"t": float(t[i]), "variant": names[int(rng.integers(0, len(names)))],
             "prompt_len": int(rng.choice([rng.integers(8, 1200), rng.integers(8, 64), DENSE_MIN_M - 1, DENSE_MIN_M])),
             "output_len": int(rng.integers(2, 24))} for i in range(n)]  # fmt: skip
    return from_requests(reqs, variants)


def as_recording(trace: sim.SimTrace, steps: list) -> list[dict]:
    """The simulated steps as the recorder writes a worker's (``deltaserve.sim.record``): a
    request's first entry is its ``new`` one (nothing preempted, no prefix cache: 0 computed)."""
    seen: set[int] = set()
    out = []
    for _worker, step_id, _ahead, start, end, entries, _prefill, features in steps:
        new, running = [], []
        for rid, n in entries:
            if rid in seen:
                running.append([rid, n])
            else:
                seen.add(rid)
                new.append([rid, n, 0, int(trace.prompt_len[rid]), int(trace.variant[rid])])
        out.append({"step_id": step_id, "recv": start, "sent": end, "new": new, "running": running,
                    "released": [], "ops": [], "graph": features["eager"] == 0.0})  # fmt: skip
    return out


@pytest.mark.parametrize(("dense_min_m", "delta_graphs"), [(DENSE_MIN_M, 0), (None, 0), (DENSE_MIN_M, 384)])
def test_simulated_and_recorded_steps_have_the_same_features(dense_min_m, delta_graphs):
    """The simulator's features of the steps it schedules equal those the recorder's reading of the same
    steps gives; with graphs that take delta rows (``delta_graphs`` tokens; bigger graph buckets so that
    some such step fits) a replayed step has no dense segments, an eager one keeps them."""
    trace = mixed_trace()
    cfg = sim.daemon_config(sim.default_model())
    cfg.max_num_batched_tokens = 512  # long prompts prefill in chunks, some of a delta past the threshold
    cfg.max_deltas, cfg.host_adapter_bytes = 4, 64 << 30  # every delta held: none preempts another's requests
    model = replace(
        sim.default_model(),
        dense_min_m=dense_min_m,
        graph_max_batch=128 if delta_graphs else 16,
        graph_max_tokens=512 if delta_graphs else 256,
        graph_max_delta_tokens=delta_graphs,
    )
    res = sim.replay(trace, cfg, model, record_steps=True)
    assert res.completed.all() and res.counters["num_preemptions"] == 0
    deltas = {i + 1 for i, v in enumerate(trace.variants) if v.kind != "lora"}
    ranks = {i + 1: v.rank or 0 for i, v in enumerate(trace.variants)}
    recorded = step_features(as_recording(trace, res.steps), ranks, deltas, dense_min_m)
    simulated = [features for *_, features in res.steps]
    assert len(recorded) == len(simulated)
    for i, ((_step, py, _period), rust) in enumerate(zip(recorded, simulated)):
        assert {f: py[f] for f in sim.FEATURES[1:]} == {f: rust[f] for f in sim.FEATURES[1:]}, f"step {i}"
        assert rust["const"] == 1.0
    dense = [rust["dense_delta_segments"] for rust in simulated]
    graphed_delta_prefills = [r for r in simulated if r["delta_tokens"] and r["prefill_tokens"] and not r["eager"]]
    if delta_graphs:  # a replayed step runs every delta token through the work tiles
        assert graphed_delta_prefills and all(r["tokens"] <= delta_graphs for r in graphed_delta_prefills)
        assert not any(r["dense_delta_segments"] for r in graphed_delta_prefills)
    else:
        assert not graphed_delta_prefills, "steps with delta rows that prefill run eagerly"
    if dense_min_m is None:
        assert not any(dense), "no dense path, no dense segments"
    else:
        assert max(dense) >= 2, "a step with two deltas' dense segments"
        assert any(r["delta_tokens"] and r["prefill_tokens"] and not r["dense_delta_segments"] for r in simulated), (
            "a delta prefill below the threshold: work tiles only"
        )


def test_dense_segments_are_priced_and_old_models_price_none():
    trace = mixed_trace(n=40)
    base = replace(sim.default_model(), dense_min_m=DENSE_MIN_M)
    assert not sim.default_model().prefill.get("dense_delta_segments"), "the bundled model saw no delta prefill"
    ref = sim.replay(trace, latency_model=base).summary()
    priced = replace(base, prefill={**base.prefill, "dense_delta_segments": 0.05})
    slow = sim.replay(trace, latency_model=priced).summary()
    assert slow["ttft_s"]["mean"] > ref["ttft_s"]["mean"]
    off = sim.replay(trace, latency_model=replace(priced, dense_min_m=None)).summary()
    assert off["ttft_s"]["mean"] == pytest.approx(ref["ttft_s"]["mean"]), "no threshold: the feature is 0"
    old = {k: v for k, v in base.to_dict().items() if k != "dense_min_m"}
    old["prefill"] = {k: v for k, v in old["prefill"].items() if k != "dense_delta_segments"}
    assert sim.LatencyModel.from_dict(old).dense_min_m is None
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="dense_min_m"):
            sim.LatencyModel.from_dict({**base.to_dict(), "dense_min_m": bad})
    with pytest.raises(ValueError, match="dense_min_m"):
        _native.simulate(_native.SchedulerConfig(16, 64, 512), [], [], base.native(), dense_min_m=1)
