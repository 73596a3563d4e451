"""The simulator's daemon terms around the device (router/crates/py/src/sim_pipeline.rs, the
host-launch model, the graph rule, ingress and delivery; deltaserve.sim.latency) and what measures
them (deltaserve.sim.record's launch times and device spans, bench/sim_timeline.py's split of a
request's time to first token). Each term is deterministic for a seed and is the simulator before
it when its parameter is zero. Small traces: well under a second each."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from bench.sim_timeline import first_tokens, measured_split, simulated_split
from deltaserve import sim
from deltaserve.sim.record import (
    graph_rule,
    host_samples,
    keeps_delta_steps_within,
    router_gap_s,
    span_copy_bandwidths,
    steps_to_samples,
)
from tests.sim.test_sim import make_trace


def same(a: sim.SimResult, b: sim.SimResult) -> bool:
    """The same times and steps (their features aside: a graph rule changes ``eager``, not the time)."""
    return (np.array_equal(a.first_token_s, b.first_token_s) and np.array_equal(a.finish_s, b.finish_s)
            and [s[:-1] for s in a.steps] == [s[:-1] for s in b.steps])  # fmt: skip


def test_zero_terms_are_the_simulator_before_them():
    trace = make_trace(n=120, rate=30.0)
    base = sim.default_model()
    before = sim.replay(trace, latency_model=base, seed=3, noise=0.2, record_steps=True)
    zeros = {f: 0.0 for f in sim.FEATURES}
    off = replace(base, host_decode=zeros, host_prefill=zeros, graph_max_batch=16, graph_max_tokens=256, ingress_s=0.0,
                  deliver_s=0.0, router_gap_s=0.0)  # fmt: skip
    assert same(before, sim.replay(trace, latency_model=off, seed=3, noise=0.2, record_steps=True))
    assert np.isfinite(before.scheduled_s).all() and (before.scheduled_s >= np.asarray(trace.arrival_s)).all()
    assert (before.first_token_s > before.scheduled_s).all()


def test_ingress_shifts_arrivals_and_delivery_shifts_what_clients_see():
    trace = make_trace(n=80, rate=25.0)
    base = sim.default_model()
    ref = sim.replay(trace, latency_model=base, record_steps=True)
    late = sim.replay(trace, latency_model=replace(base, deliver_s=0.004), record_steps=True)
    assert late.steps == ref.steps, "delivery never changes what the scheduler does"
    assert np.allclose(late.first_token_s - ref.first_token_s, 0.004)
    assert np.allclose(late.finish_s - ref.finish_s, 0.004)
    shifted = replace(trace, arrival_s=tuple(t + 0.003 for t in trace.arrival_s))
    a = sim.replay(trace, latency_model=replace(base, ingress_s=0.003))
    b = sim.replay(shifted, latency_model=base)
    assert np.allclose(a.first_token_s, b.first_token_s) and np.allclose(a.scheduled_s, b.scheduled_s)


def test_host_launch_time_is_deterministic_and_delays_the_step_in_flight():
    trace = make_trace(n=120, rate=30.0)
    base = sim.default_model()
    slow = replace(base, host_prefill={"const": 0.02, "eager": 0.01}, host_decode={"const": 0.0005})
    runs = [sim.replay(trace, latency_model=slow, seed=5, noise=0.2, record_steps=True) for _ in range(2)]
    assert same(*runs)
    ref = sim.replay(trace, latency_model=base, seed=5, noise=0.2).summary()
    got = runs[0].summary()
    assert got["ttft_s"]["mean"] > ref["ttft_s"]["mean"] and got["tpot_s"]["mean"] > ref["tpot_s"]["mean"]
    assert runs[0].completed.all()
    # The eager term only prices eager steps: a graph rule that takes every step removes it.
    graphed = replace(slow, graph_max_batch=10_000, graph_max_tokens=100_000)
    fast = sim.replay(trace, latency_model=graphed, seed=5, noise=0.2).summary()
    assert fast["ttft_s"]["mean"] < got["ttft_s"]["mean"]


def test_host_fit_recovers_launch_costs_and_old_models_load(tmp_path):
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(200):
        seqs = int(rng.integers(1, 64))
        prefill = int(rng.integers(0, 2)) * int(rng.integers(8, 512))
        eager = 1.0 if prefill else float(seqs > 32)
        host = (0.004 + 2e-6 * prefill if prefill else 0.0003 + 0.003 * eager) + 1e-7 * seqs
        samples.append(
            {"seqs": seqs, "tokens": seqs + prefill, "prefill_tokens": prefill, "eager": eager, "host_s": host}
        )
    model = sim.default_model()
    model.fit_host(samples)
    assert model.host_decode["eager"] == pytest.approx(0.003, rel=1e-3)
    assert model.predict_host({"seqs": 10, "tokens": 10, "eager": 0}) == pytest.approx(0.0003 + 1e-6, rel=1e-3)
    assert model.predict_host({"seqs": 1, "tokens": 101, "prefill_tokens": 100, "eager": 1}) == pytest.approx(
        0.004 + 2e-4 + 1e-7, rel=1e-3)  # fmt: skip
    back = sim.LatencyModel.load(model.save(tmp_path / "m.json"))
    assert back == model
    old = {k: v for k, v in model.to_dict().items() if k not in ("host_decode", "host_prefill", "deliver_s")}
    assert sim.LatencyModel.from_dict(old).host_decode == {}
    with pytest.raises(ValueError, match="deliver_s"):
        sim.LatencyModel.from_dict({**model.to_dict(), "deliver_s": -1.0})
    with pytest.raises(ValueError, match="host_s"):
        model.fit_host([{"seqs": 1, "host_s": float("nan")}])


def recording() -> list[dict]:
    """Four overlapped steps: request 1 prefills (graph-less) in step 1, request 2 joins in step 3."""

    def step(i, recv, sent, new=(), running=(), graph=False, behind=True, device_s=0.006, ops=()):
        return {"step_id": i, "recv": recv, "sent": sent, "new": [list(n) for n in new],
                "running": [list(r) for r in running], "released": [], "ops": list(ops), "host_ready": [],
                "timing": {"gap_us": 0, "forward_us": 0, "total_us": 0, "busy_us": 0},
                "launch": [recv, recv + 0.002], "graph": graph, "behind": behind, "device_s": device_s}  # fmt: skip

    return [
        step(1, 10.000, 10.010, new=[(1, 40, 0, 40, 3)], behind=False, device_s=0.012),
        step(2, 10.004, 10.016, running=[(1, 1)], graph=True),
        step(3, 10.0112, 10.030, new=[(2, 20, 0, 20, 0)], running=[(1, 1)], device_s=0.011),
        step(4, 10.0163, 10.036, running=[(1, 1), (2, 1)], graph=True),
    ]


def test_a_recording_gives_host_samples_spans_graph_rule_and_router_gap():
    steps = recording()
    samples = steps_to_samples(steps, ranks={3: 8}, deltas=set())
    assert [s["step_s"] for s in samples] == [0.006, 0.011, 0.006], "device spans of the steps launched behind"
    assert [s["eager"] for s in samples] == [0.0, 1.0, 0.0]
    periods = steps_to_samples(steps, ranks={3: 8}, deltas=set(), device_spans=False)
    assert len(periods) == 4 and periods[0]["step_s"] == pytest.approx(0.010)
    host = host_samples(steps, ranks={3: 8}, deltas=set())
    assert [h["host_s"] for h in host] == pytest.approx([0.002] * 4)
    assert graph_rule(steps) == (2, 0, 0)
    graphed = [{**s, "graph": True} for s in steps]
    assert graph_rule(graphed) == (2, 40, 0), "mixed steps: tokens"
    assert graph_rule(graphed, deltas={3}) == (2, 40, 40), "request 1 is on variant 3: a delta step"
    assert graph_rule(steps[:1] + graphed[1:], deltas={3}) == (2, 21, 21), "its decode beside request 2's prompt"
    assert graph_rule(graphed, deltas={7}) == (2, 40, 0)
    # Plans 3 and 4 came ahead (before outputs 2 and 3): formed at outputs 1 and 2.
    assert router_gap_s(steps) == pytest.approx(np.median([10.0112 - 10.010, 10.0163 - 10.016]))
    assert router_gap_s(steps[:2]) is None
    # A step that copied variant 3 (2 MB) to the GPU spent 2 ms past the model's price of it.
    copying = [{**steps[1], "ops": [[3, 1, 0]], "device_s": 0.008}]
    bw = span_copy_bandwidths(copying, {3: 8}, set(), {3: ("lora", 2_000_000)}, lambda f: 0.006)
    assert bw == {"lora": pytest.approx(1e9)}


def test_a_recording_says_whether_its_router_kept_delta_steps_within_the_delta_graphs():
    steps = recording()  # request 1 (variant 3) prefills 40 tokens; step 3: its decode beside a 20-token prompt
    assert keeps_delta_steps_within(steps, {3}, 40), "no step with variant 3's rows passes 40 tokens"
    assert not keeps_delta_steps_within(steps, {3}, 32), "step 1 prefills 40 tokens of variant 3"
    short = [{**steps[0], "new": [[1, 10, 0, 10, 3]]}, *steps[1:]]  # a 10-token prompt instead
    assert not keeps_delta_steps_within(short, {3}, 16), "step 3: 21 tokens with its decode"
    assert keeps_delta_steps_within(short, {3}, 21)
    assert keeps_delta_steps_within(steps, {7}, 16), "no delta rows: no limit to pass"
    assert not keeps_delta_steps_within(steps, {3}, 0), "no limit"
    decodes = [{**steps[3], "running": [[1, 1], [2, 1]]}]
    assert keeps_delta_steps_within(decodes, {3}, 1), "decodes alone are never held back"


def test_time_to_first_token_splits_into_wait_steps_and_delivery():
    steps = recording()
    seen = first_tokens(steps)
    assert seen[1]["planned"] == 10.000 and seen[1]["first_out"] == 10.010
    assert seen[2]["planned"] == 10.0112 and seen[2]["first_out"] == 10.030
    records = [SimpleNamespace(i=0, variant="v3", prompt_len=40, sent=0.0, ttft=0.0125, error=None),
               SimpleNamespace(i=1, variant="base", prompt_len=20, sent=0.0100, ttft=0.0215, error=None)]  # fmt: skip
    ids = {"v3": 3, "base": 0}.get
    split = measured_split(records, 9.9990, steps, ids)
    assert split["matched"] == 2
    wait, stepped, deliver = np.array([r[2:] for r in split["per_request"]]).T
    assert wait == pytest.approx([0.001, 0.0022]) and stepped == pytest.approx([0.010, 0.0188])
    assert deliver == pytest.approx([0.0015, 0.0005])
    assert split["mean_s"]["deliver"] == pytest.approx(0.001)
    sim_split = simulated_split(np.array([0.0, 1.0]), np.array([0.001, 1.004]), np.array([0.02, 1.03]), 0.0005,
                                0.002)  # fmt: skip
    assert sim_split["mean_s"]["wait"] == pytest.approx(0.003) and sim_split["mean_s"]["deliver"] == 0.002


def test_worker_stalls_are_outputs_later_than_their_span_and_the_next_launch():
    """``worker_stall_s_per_seq``: an output of a step launched behind another that comes more than
    ``STALL_MIN_S`` after both its device span and the next launch is a stall, priced per request of
    those steps; the model folds it into both kinds' ``seqs`` coefficient for the simulator."""
    from deltaserve.sim.latency import FEATURES
    from deltaserve.sim.record import worker_stall_s_per_seq

    steps = recording()
    assert worker_stall_s_per_seq(steps) == 0.0, "periods of 6-14 ms over spans of 6-11 ms"
    late = [*steps[:3], {**steps[3], "sent": 10.136}]  # output 4 came 106 ms after 3, its span 6 ms
    # behind steps 2, 3, 4 hold 1 + 2 + 2 requests; the stall is 100 ms
    assert worker_stall_s_per_seq(late) == pytest.approx(0.100 / 5)
    waited = [*late, {**steps[3], "step_id": 5, "sent": 10.142, "launch": [10.030, 10.134]}]
    assert worker_stall_s_per_seq(waited) == 0.0, "output 4 waited for launch 5 (104 ms): the host model's"
    assert worker_stall_s_per_seq([*late[:3], {**late[3], "behind": False}]) == 0.0, "spans with launch gaps"
    model = sim.default_model()
    model.stall_s_per_seq = 0.02
    decode, prefill, *_ = model.native()
    seqs = FEATURES.index("seqs")
    assert decode[seqs] == pytest.approx(model.decode.get("seqs", 0.0) + 0.02)
    assert prefill[seqs] == pytest.approx(model.prefill.get("seqs", 0.0) + 0.02)
    assert model.predict({"seqs": 4}) == sim.default_model().predict({"seqs": 4}), "the device model is unchanged"
    old = {k: v for k, v in model.to_dict().items() if k != "stall_s_per_seq"}
    assert sim.LatencyModel.from_dict(old).stall_s_per_seq == 0.0
    with pytest.raises(ValueError, match="stall_s_per_seq"):
        sim.LatencyModel.from_dict({**model.to_dict(), "stall_s_per_seq": -1.0})
