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
from deltaserve.adapters.delta_graphs import DENSE_LANE_BASE_TOKENS
from deltaserve.sim.latency import dense_lane_buckets
from deltaserve.sim.record import dense_lane_delta, step_features
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


@pytest.mark.parametrize(
    ("dense_min_m", "delta_graphs", "lane"),
    [(DENSE_MIN_M, 0, None), (None, 0, None), (DENSE_MIN_M, 384, None), (DENSE_MIN_M, 384, DENSE_LANE_BASE_TOKENS)],
)
def test_simulated_and_recorded_steps_have_the_same_features(dense_min_m, delta_graphs, lane):
    """The simulator's features of the steps it schedules equal those the recorder's reading of the same
    steps gives; with graphs that take delta rows (``delta_graphs`` tokens; bigger graph buckets so that
    some such step fits) a replayed step has a dense segment only where a delta takes its dense lane
    (``lane``: the threshold's base; None: no lane, none), an eager one keeps its own."""
    trace = mixed_trace()
    cfg = sim.daemon_config(sim.default_model())
    cfg.max_num_batched_tokens = 512  # long prompts prefill in chunks, some of a delta past the threshold
    cfg.max_deltas, cfg.host_adapter_bytes = 4, 64 << 30  # every delta held: none preempts another's requests
    model = replace(
        sim.default_model(),
        dense_min_m=dense_min_m,
        dense_lane_base_tokens=lane,
        graph_max_batch=128 if delta_graphs else 16,
        graph_max_tokens=512 if delta_graphs else 256,
        graph_max_delta_tokens=delta_graphs,
    )
    res = sim.replay(trace, cfg, model, record_steps=True)
    assert res.completed.all() and res.counters["num_preemptions"] == 0
    deltas = {i + 1 for i, v in enumerate(trace.variants) if v.kind != "lora"}
    ranks = {i + 1: v.rank or 0 for i, v in enumerate(trace.variants)}
    recorded = step_features(as_recording(trace, res.steps), ranks, deltas, dense_min_m, lane)
    simulated = [features for *_, features in res.steps]
    assert len(recorded) == len(simulated)
    for i, ((_step, py, _period), rust) in enumerate(zip(recorded, simulated)):
        assert {f: py[f] for f in sim.FEATURES[1:]} == {f: rust[f] for f in sim.FEATURES[1:]}, f"step {i}"
        assert rust["const"] == 1.0
    dense = [rust["dense_delta_segments"] for rust in simulated]
    graphed_delta_prefills = [r for r in simulated if r["delta_tokens"] and r["prefill_tokens"] and not r["eager"]]
    if delta_graphs:
        assert graphed_delta_prefills and all(r["tokens"] <= delta_graphs for r in graphed_delta_prefills)
        lanes = [r["dense_delta_segments"] for r in graphed_delta_prefills]
        if lane is None:  # every delta token through the work tiles
            assert not any(lanes)
        else:  # a long run of one delta in the dense lane, shorter ones on the tiles: one lane at most
            assert set(lanes) == {0.0, 1.0}, "replayed delta prefills with and without a lane"
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


def test_the_dense_lane_takes_the_delta_with_the_most_tokens_at_its_buckets_threshold():
    """The recorder's side of the lane (the simulator's: ``LatencyModel::dense_lane_delta``, Rust tests):
    the worker's buckets and thresholds (``DELTA_TOKEN_BUCKETS``, ``dense_lane_tokens``), the delta with
    the most tokens of the step, the first of a tie, in steps that prefill only."""
    lane = dense_lane_buckets(64)
    assert (128, 106) in lane and (384, 192) in lane and lane == tuple(sorted(lane))
    assert dense_lane_buckets(0)[0] == (32, 10), "the base the worker's tests lower the threshold to"

    def step(tokens: int, prefill: bool = True) -> dict[str, float]:
        return {"tokens": tokens, "prefill_tokens": tokens - 2 if prefill else 0}

    assert dense_lane_delta(step(128), {1: 106}, None) is None, "no lane modelled"
    assert dense_lane_delta(step(128), {1: 105, 2: 23}, lane) is None, "bucket 128: 106 tokens"
    assert dense_lane_delta(step(128), {1: 106, 2: 22}, lane) == 1
    assert dense_lane_delta(step(128), {1: 20, 2: 108}, lane) == 2, "the delta with most tokens"
    assert dense_lane_delta(step(129), {1: 129}, lane) is None, "bucket 256: 149 tokens"
    assert dense_lane_delta(step(640), {3: 320, 1: 320}, lane) == 3, "a tie: the first in row order"
    assert dense_lane_delta(step(640), {1: 320, 3: 320}, lane) == 1
    assert dense_lane_delta(step(5000), {1: 5000}, lane) is None, "past the largest bucket"
    assert dense_lane_delta(step(128, prefill=False), {1: 128}, lane) is None, "decode graphs: no lane"


def test_the_dense_lane_is_priced_in_replayed_steps_and_old_models_have_none():
    """A model with the lane prices a replayed step's lane delta as a dense segment; one without it (saved
    before the lane) loads with none and prices replayed steps as before; bad values are refused."""
    trace = mixed_trace(n=40)
    cfg = sim.daemon_config(sim.default_model())
    cfg.max_num_batched_tokens = 512
    base = replace(sim.default_model(), dense_min_m=DENSE_MIN_M, graph_max_batch=128, graph_max_tokens=512,
                   graph_max_delta_tokens=384)  # fmt: skip
    priced = replace(base, prefill={**base.prefill, "dense_delta_segments": 0.05})
    ref = sim.replay(trace, cfg, priced).summary()
    lane = sim.replay(trace, cfg, replace(priced, dense_lane_base_tokens=DENSE_LANE_BASE_TOKENS)).summary()
    assert lane["ttft_s"]["mean"] > ref["ttft_s"]["mean"], "replayed lane steps priced dense"
    with_lane = replace(base, dense_lane_base_tokens=DENSE_LANE_BASE_TOKENS).to_dict()
    assert sim.LatencyModel.from_dict(with_lane).native_options()["dense_lane"] == list(dense_lane_buckets(64))
    old = {k: v for k, v in with_lane.items() if k != "dense_lane_base_tokens"}
    assert sim.LatencyModel.from_dict(old).dense_lane_base_tokens is None
    assert sim.LatencyModel.from_dict(old).native_options()["dense_lane"] is None
    for bad in (-1, 2.5, True, "64"):
        with pytest.raises(ValueError, match="dense_lane_base_tokens"):
            sim.LatencyModel.from_dict({**with_lane, "dense_lane_base_tokens": bad})
    config = _native.SchedulerConfig(16, 64, 512)
    for bad_lane in ([], [(32, 10), (32, 11)], [(64, 10), (32, 10)], [(32, 0)], [(0, 10)]):
        with pytest.raises(ValueError, match="dense_lane"):
            _native.simulate(config, [], [], base.native(), dense_lane=bad_lane)
