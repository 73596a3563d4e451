"""The simulator's prefix caching (``SimTrace.prompt_key``, ``_native.simulate(prompt_keys=)``):
requests whose keys are equal have equal prompts, and the real scheduler's prefix cache serves
the repeats, as the daemon's does (on by default there); without keys the simulator is as before
them. And how ``bench/sim_validate.py`` keys a recorded replay's prompts (its trace regenerated:
seed k at two rates repeats the same prompts). Small traces: well under a second each."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.sim_validate import _prefix_caching, _prompt_keys
from deltaserve import _native, sim
from deltaserve.sim.trace import from_requests
from tests.sim.test_sim import make_trace


def test_without_keys_or_with_distinct_keys_the_run_is_the_one_before_keys():
    trace = make_trace(n=120, rate=30.0)
    model = sim.default_model()
    before = sim.replay(trace, latency_model=model, seed=3, noise=0.2, record_steps=True)
    assert before.counters["prefix_hit_tokens"] == 0
    distinct = sim.replay(replace(trace, prompt_key=tuple(range(len(trace)))), latency_model=model, seed=3,
                          noise=0.2, record_steps=True)  # fmt: skip
    assert distinct.counters["prefix_hit_tokens"] == 0
    assert np.array_equal(before.first_token_s, distinct.first_token_s) and before.steps == distinct.steps


def test_repeated_prompts_hit_the_cache_and_prefill_less():
    trace = make_trace(n=80, rate=20.0)
    model = sim.default_model()
    once = tuple(range(40))
    keyed = replace(trace, prompt_key=once + once)  # the last 40 repeat the first 40's prompts
    ref = sim.replay(trace, latency_model=model, record_steps=True)
    hit = sim.replay(keyed, latency_model=model, record_steps=True)
    assert hit.counters["prefix_hit_tokens"] > 0
    assert sum(s[6] for s in hit.steps) < sum(s[6] for s in ref.steps), "repeats prefill less"
    again = sim.replay(keyed, latency_model=model, record_steps=True)
    assert np.array_equal(hit.first_token_s, again.first_token_s), "deterministic"


def test_bad_keys_are_refused():
    rows = [{"t": 0.0, "prompt_len": 4, "output_len": 2, "prompt_key": 1}, {"t": 0.1, "prompt_len": 4, "output_len": 2}]
    with pytest.raises(ValueError, match="prompt_key"):
        from_requests(rows, [])
    with pytest.raises(ValueError, match="prompt_key"):
        from_requests([{**rows[0], "prompt_key": -1}], [])
    cfg = _native.SchedulerConfig(16, 64, 1024)
    with pytest.raises(ValueError, match="prompt_keys"):
        _native.simulate(cfg, [(0.0, 4, 2, 0)], [], sim.default_model().native(), prompt_keys=[1, 2])
    trace = from_requests([{**rows[0], "prompt_key": 7}, {**rows[1], "prompt_key": 7}], [])
    assert trace.prompt_key == (7, 7) and trace.head(1).prompt_key == (7,)


def test_validation_keys_regenerate_the_recorded_prompts():
    params = {"kind": "slora", "seed": 0, "n_variants": 4, "alpha": 1.0, "rate": 8.0, "cv": 1.0, "duration": 2.0,
              "input_range": [8, 64], "output_range": [8, 16], "ranks": [8], "vocab": [100, 32000]}  # fmt: skip
    from bench.serving.experiments import WORKLOADS

    def replay(p):
        t = WORKLOADS["slora"](**{k: v for k, v in p.items() if k != "kind"})
        return {"trace": p, "requests": [{"prompt_len": len(q.prompt), "variant": q.variant,
                                          "output_len": q.output_len} for q in t.requests]}  # fmt: skip

    slow, fast = replay(params), replay({**params, "rate": 20.0})
    a, b = _prompt_keys(slow), _prompt_keys(fast)
    assert a is not None and b is not None and len(set(a)) == len(a)
    assert a[:5] == b[:5], "the same seed draws the same prompts at any rate"
    assert _prompt_keys(replay({**params, "seed": 1}))[:5] != a[:5]
    wrong = {**slow, "requests": [{**slow["requests"][0], "prompt_len": 999}, *slow["requests"][1:]]}
    assert _prompt_keys(wrong) is None, "a trace that does not regenerate as recorded gets no keys"
    assert _prefix_caching([]) and not _prefix_caching(["--no-enable-prefix-caching"])
    assert not _prefix_caching(["--enable-prefix-caching", "false"]) and _prefix_caching(
        ["--enable-prefix-caching=true"]
    )


def test_no_two_replays_share_a_seed():
    from argparse import Namespace

    from bench.sim_validate import _phase_traces

    args = Namespace(smoke=False, duration=5.0, n=8, rates_s2="8,28", rates_deltazip="1", profile_duration=2.0, seeds=2,
                     warmup_duration=1.0)  # fmt: skip
    _, _, phases = _phase_traces("slora-s2", args)
    labels = [label for label, *_ in phases]
    assert labels[:4] == ["warmup", "warmup", "profile", "profile"], "warm-ups, then profiles, then validation"
    seeds = [seed for _, _, seed, _ in phases]
    assert seeds[:4] == [200, 201, 100, 101] and len(set(seeds)) == len(seeds) == 8
    firsts = {tuple(trace.requests[0].prompt) for *_, trace in phases}
    assert len(firsts) == 8, "every replay draws its own prompts"
    assert [t.params["duration"] for *_, t in phases[:4]] == [1.0, 1.0, 2.0, 2.0]
    _, _, phases = _phase_traces("slora-s2", Namespace(**{**vars(args), "warmup_duration": 0.0}))
    assert [label for label, *_ in phases][:2] == ["profile", "profile"], "no warm-up"
