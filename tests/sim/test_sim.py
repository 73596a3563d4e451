"""deltaserve.sim: the real scheduler on a virtual clock (router/crates/py/src/sim*.rs) and its
Python side (pyworker/deltaserve/sim/). Small traces only: every test runs in well under a second."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from deltaserve import _native, sim
from deltaserve.sim.__main__ import main
from deltaserve.sim.models import DEFAULT_MODEL, MODELS_DIR, fit_default
from deltaserve.sim.trace import from_requests

REPO = Path(__file__).resolve().parents[2]


def make_trace(n: int = 200, rate: float = 20.0, seed: int = 0, deltas: bool = False) -> sim.SimTrace:
    """Poisson arrivals, S2 ranks (or 4 deltas), prompts U[8, 256], outputs U[4, 64]."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    variants = ([{"name": f"d{i}", "kind": "full"} for i in range(4)] if deltas else
                [{"name": f"a{i}", "kind": "lora", "rank": (64, 32, 16, 8)[i % 4]} for i in range(8)])  # fmt: skip
    names = [None] + [v["name"] for v in variants]
    reqs = [{"t": float(t[i]), "variant": names[int(rng.integers(0, len(names)))],
             "prompt_len": int(rng.integers(8, 257)), "output_len": int(rng.integers(4, 65))} for i in range(n)]  # fmt: skip
    return from_requests(reqs, variants)


def test_config_defaults_are_the_schedulers():
    cfg = _native.SchedulerConfig(16, 64, 512)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_deltas, cfg.prefetch_window) == (256, 2048, 3, 64)
    assert cfg.host_copy_reports is False
    cfg.max_num_seqs = 0
    with pytest.raises(_native.SchedError, match="max_num_seqs") as e:
        cfg.validate()
    assert e.value.error_type == "invalid_config"
    daemon = sim.daemon_config(sim.default_model(), max_num_seqs=32)
    assert daemon.host_copy_reports and daemon.max_num_seqs == 32 and daemon.max_deltas == 3


def test_deterministic_for_a_seed():
    trace = make_trace()
    runs = [sim.replay(trace, seed=s, noise=0.3, record_steps=True) for s in (7, 7, 8)]
    a, b, c = runs
    assert np.array_equal(a.finish_s, b.finish_s) and a.steps == b.steps and a.summary() == b.summary()
    assert not np.array_equal(a.finish_s, c.finish_s), "another seed draws other step times"


def test_every_request_finishes_once_with_its_tokens():
    trace = make_trace(deltas=False)
    res = sim.replay(trace, record_steps=True)
    assert res.completed.all() and (res.worker_of == 0).all()
    assert list(res.output_tokens) == list(trace.output_len)
    assert (res.first_token_s >= np.asarray(trace.arrival_s)).all() and (res.finish_s >= res.first_token_s).all()
    assert res.counters["num_finished"] == len(trace) and res.counters["num_preemptions"] == 0
    computed = np.zeros(len(trace), dtype=np.int64)
    for _worker, _step, _ahead, start, end, entries, _prefill, _features in res.steps:
        assert end >= start
        for req, tokens in entries:
            computed[req] += tokens
    # No preemption: each request computes its prompt and every output but the last once.
    assert list(computed) == [p + o - 1 for p, o in zip(trace.prompt_len, trace.output_len)]


def test_a_small_pool_preempts_and_still_finishes_everything():
    trace = make_trace(n=120, rate=200.0, deltas=True)
    model = sim.default_model()
    cfg = _native.SchedulerConfig(16, 64, 512)  # 1024 tokens of KV for bursts of 120 requests
    cfg.max_deltas, cfg.host_copy_reports = 2, True
    res = sim.replay(trace, cfg, model)
    s = res.summary()
    assert s["completed"] == len(trace) and s["preemptions"] > 0
    assert list(res.output_tokens) == list(trace.output_len)
    assert s["peak"]["kv_blocks"] <= 64 and s["peak"]["deltas_on_gpu"] == 2 and s["adapter_gpu_loads"] >= 4


def test_latency_model_fit_recovers_its_coefficients(tmp_path):
    rng = np.random.default_rng(1)
    truth = {
        "decode": {"const": 0.004, "seqs": 3e-5, "context_tokens": 1e-7, "lora_rank_sum": 2e-6, "deltas": 7e-4},
        "prefill": {"const": 0.002, "prefill_tokens": 2e-5, "prefill_attention": 1e-9, "lora_tokens": 1e-5},
    }
    samples = []
    for i in range(80):
        prefill = i % 2 == 1
        s = {"seqs": int(rng.integers(1, 256)), "context_tokens": int(rng.integers(100, 200000)),
             "lora_rank_sum": int(rng.integers(0, 2000)), "deltas": int(rng.integers(0, 4))}  # fmt: skip
        if prefill:
            s = {"prefill_tokens": int(rng.integers(16, 4096)), "lora_tokens": int(rng.integers(0, 2000))}
            s["prefill_attention"] = s["prefill_tokens"] * int(rng.integers(16, 4096))
        coef = truth["prefill" if prefill else "decode"]
        s["step_s"] = sum(coef.get(f, 0) * s.get(f, 1 if f == "const" else 0) for f in sim.FEATURES)
        samples.append(s)
    m = sim.LatencyModel.fit(samples)
    for kind in ("decode", "prefill"):
        assert m.r2[kind] == pytest.approx(1.0)
        for f in sim.FEATURES:
            assert getattr(m, kind)[f] == pytest.approx(truth[kind].get(f, 0.0), rel=1e-6, abs=1e-12), (kind, f)
    assert m.predict(samples[3]) == pytest.approx(samples[3]["step_s"])
    loaded = sim.LatencyModel.load(m.save(tmp_path / "m.json"))
    assert loaded == m


def test_one_off_slow_steps_are_left_out_of_the_fit_and_counted():
    """Two prefill steps that also compiled a kernel (1.5 s among ~0.1 s steps) would set the
    attention term; they are left out, the costs recovered, and counted. Slow steps that are more
    than a tenth of the samples are a cost the features miss, and stay in."""
    rng = np.random.default_rng(3)
    samples = [{"seqs": 8, "step_s": 0.01 + 1e-4 * (i % 5)} for i in range(12)]
    for _ in range(20):
        n = int(rng.integers(16, 512))
        samples.append({"prefill_tokens": n, "prefill_attention": n * n, "step_s": 0.05 + 2e-4 * n})
    slow = [{**samples[12 + i], "step_s": 1.5} for i in range(2)]
    m = sim.LatencyModel.fit(samples[:12] + slow + samples[14:])
    assert m.samples["prefill_outliers"] == 2 and "decode_outliers" not in m.samples
    assert m.prefill["const"] == pytest.approx(0.05) and m.prefill["prefill_tokens"] == pytest.approx(2e-4)
    assert m.prefill["prefill_attention"] == pytest.approx(0.0, abs=1e-12)
    many = [{**s, "step_s": 1.5} if i % 4 == 0 else s for i, s in enumerate(samples[12:])]
    kept = sim.LatencyModel.fit(samples[:12] + many)
    assert "prefill_outliers" not in kept.samples and kept.prefill["const"] > 0.2


def test_windowed_fit_recovers_costs_that_overlap_moved_into_a_neighbours_period():
    """Half of each prefill step's cost shows up in the period of the step before it (its host
    work runs while the earlier step's output waits): a per-step fit prices prefill at half its
    cost; windows of consecutive steps of one run shrink the error to their edges, less the
    longer they are."""
    rng = np.random.default_rng(2)
    dec, pre = {"const": 0.006, "seqs": 5e-5}, {"const": 0.004, "prefill_tokens": 2e-5}
    samples, true_s = [], []
    for i in range(400):
        if rng.random() < 0.3:
            s = {"prefill_tokens": int(rng.integers(16, 512)), "seqs": int(rng.integers(1, 64))}
            true_s.append(pre["const"] + pre["prefill_tokens"] * s["prefill_tokens"])
        else:
            s = {"seqs": int(rng.integers(1, 64))}
            true_s.append(dec["const"] + dec["seqs"] * s["seqs"])
        s["run"] = i // 100  # four runs (a step left out between them)
        samples.append(s)
    for i, s in enumerate(samples):
        moved = 0.5 * true_s[i + 1] if i + 1 < len(samples) and "prefill_tokens" in samples[i + 1] else 0.0
        kept = 0.5 * true_s[i] if "prefill_tokens" in s else true_s[i]
        s["step_s"] = kept + moved
    per_token = [sim.LatencyModel.fit(samples, window=w).prefill["prefill_tokens"] for w in (1, 2, 16)]
    assert per_token[0] < 0.6 * pre["prefill_tokens"], "per step: the moved half is lost"
    assert per_token[0] < per_token[1] < per_token[2], "longer windows, smaller edge error"
    m = sim.LatencyModel.fit(samples, window=16)
    assert m.prefill["prefill_tokens"] == pytest.approx(pre["prefill_tokens"], rel=0.1)
    assert m.decode["const"] == pytest.approx(dec["const"], rel=0.05)
    assert set(m.r2) == {"windows"} and m.r2["windows"] > 0.8
    with pytest.raises(ValueError, match="window 0"):
        sim.LatencyModel.fit(samples, window=0)


def test_last_requests_of_a_warmed_up_run():
    from deltaserve.sim.trace import from_requests

    reqs = [{"t": 0.1 * i, "variant": None, "prompt_len": 8, "output_len": 4} for i in range(10)]
    res = sim.replay(from_requests(reqs, []))
    tail = res.last(3)
    assert len(tail.trace) == 3 and tail.trace.arrival_s == res.trace.arrival_s[-3:]
    assert (tail.finish_s == res.finish_s[-3:]).all() and tail.summary()["requests"] == 3
    with pytest.raises(ValueError, match="unknown features"):
        sim.LatencyModel.fit([{"step_s": 1.0, "bogus": 1}])
    with pytest.raises(ValueError, match="no prefill samples"):
        sim.LatencyModel.fit([{"step_s": 1.0, "seqs": 1}])


def test_higher_rate_means_higher_ttft_under_saturation():
    trace = make_trace(n=300)
    cfg = sim.daemon_config(sim.default_model(), max_num_seqs=8)
    means = [sim.replay(trace.at_rate(r), cfg).summary()["ttft_s"]["mean"] for r in (5.0, 40.0, 160.0)]
    assert means[0] < means[1] < means[2]
    two = sim.replay(trace.at_rate(160.0), cfg, workers=2)
    assert two.summary()["ttft_s"]["mean"] < means[2] and set(two.worker_of) == {0, 1}


def test_bad_input_is_refused_by_name():
    trace = make_trace(n=5)
    too_long = from_requests([{"t": 0.0, "prompt_len": 5000, "output_len": 10}], [])
    with pytest.raises(ValueError, match="request 0"):
        sim.replay(too_long)
    with pytest.raises(ValueError, match="not among the trace's variants"):
        from_requests([{"t": 0.0, "variant": "x", "prompt_len": 5, "output_len": 1}], [])
    with pytest.raises(ValueError, match="step_times has 1 entries"):
        sim.replay(trace, step_times=[0.01])
    with pytest.raises(ValueError, match="workers must be at least 1"):
        sim.replay(trace, workers=0)


def test_the_bundled_default_is_fitted_from_the_committed_results():
    """Every field of the bundled model is what fitting the committed results gives: the same keys,
    strings and counts, and each coefficient to 1e-6 relative or 1e-12 s absolute. The least squares
    solve is not bit-stable across BLAS and NumPy builds in the directions the data hardly constrain
    (decode ``tokens`` and ``seqs`` are the same count in pure decode steps; torch 2.15 moved that
    split by 1e-14 s a token), so bit equality would test the library, not the fit."""
    committed = json.loads((MODELS_DIR / f"{DEFAULT_MODEL}.json").read_text())
    _assert_same_model(fit_default(REPO / "bench" / "results").to_dict(), committed, "model")


def _assert_same_model(got: object, want: object, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key, value in want.items():
            _assert_same_model(got[key], value, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same_model(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12), (
            where,
            got,
            want,
        )
    else:
        assert got == want, (where, got, want)


def test_replay_and_plan_commands_run_on_a_tiny_trace(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    trace = make_trace(n=60, deltas=True)
    header = {"trace": {"kind": "test", "variants": [{"name": v.name, "kind": "full"} for v in trace.variants]}}
    names = [""] + [v.name for v in trace.variants]
    lines = [json.dumps(header)] + [
        json.dumps({"t": t, "variant": names[v], "prompt_len": p, "output_len": o})
        for t, p, o, v in zip(trace.arrival_s, trace.prompt_len, trace.output_len, trace.variant)
    ]
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", "--trace", str(path), "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 60
    rc = main(["plan", "--trace", str(path), "--slo-ttft-ms", "6000", "--rates", "2,200", "--max-num-seqs", "8,64",
               "--max-deltas", "1,3", "--max-gpus", "4", "--out-dir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "max-num-seqs" in out
    cells = json.loads((tmp_path / "plan.json").read_text())["cells"]
    assert len(cells) == 2 * 2 * 2
    low = [c["gpus"] for c in cells if c["rate"] == 2]
    high = [c["gpus"] or math.inf for c in cells if c["rate"] == 200]
    assert min(low) == 1 and min(high) >= min(low), out
    with pytest.raises(FileNotFoundError):
        main(["replay", "--trace", str(tmp_path / "missing.jsonl")])


def test_a_recording_becomes_latency_samples():
    from deltaserve.sim.record import step_periods, steps_to_samples

    steps = [  # req 1 (LoRA 2, rank 8) prefills 20 tokens in two chunks, req 2 (delta 3) joins
        {"recv": 0.0, "sent": 0.010, "new": [[1, 16, 0, 20, 2]], "running": [], "released": [], "ops": [[2, 1, 0]]},
        {"recv": 0.005, "sent": 0.018, "new": [[2, 3, 0, 3, 3]], "running": [[1, 4]], "released": [], "ops": []},
        {"recv": 0.030, "sent": 0.036, "new": [], "running": [[1, 1], [2, 1]], "released": [], "ops": []},
    ]
    assert step_periods(steps) == pytest.approx([0.010, 0.008, 0.006])
    samples = steps_to_samples(steps, ranks={2: 8}, deltas={3})
    assert len(samples) == 2, "the step that copied a variant to the GPU is left out"
    mixed, decode = samples
    assert mixed["prefill_tokens"] == 7 and mixed["tokens"] == 7 and mixed["context_tokens"] == 23
    assert (mixed["lora_rank_sum"], mixed["lora_tokens"], mixed["deltas"], mixed["delta_tokens"]) == (8, 4, 1, 3)
    assert decode["prefill_tokens"] == 0 and decode["context_tokens"] == 21 + 4 and decode["seqs"] == 2


def test_transfer_bandwidths_are_measured_as_the_simulator_prices_them():
    from deltaserve.sim.record import copies_waited, transfer_bandwidths

    MB = 1_000_000

    def step(recv, sent, ops=(), ready=(), outside_us=500, **recorded):
        timing = {"gap_us": 0, "forward_us": 1000, "total_us": 1000 + outside_us}
        return {"recv": recv, "sent": sent, "new": [], "running": [], "released": [], "ops": list(ops),
                "host_ready": list(ready), "timing": timing, **recorded}  # fmt: skip

    variants = {2: ("lora", 8 * MB), 3: ("delta", 100 * MB), 4: ("lora", 4 * MB)}
    steps = [  # reads of 2 and 3 asked at once run side by side: each its own time
        step(0.0, 0.002, ops=[[2, 0, 0], [3, 0, 1]]),
        step(0.002, 0.004, ready=[2]),
        step(0.004, 0.010, ready=[3]),
        # 2 and 4 copied to the GPU in one step 6 ms beyond the 0.5 ms outside the forward of
        # steps without ops: shared by bytes
        step(0.010, 0.020, ops=[[2, 1, 0], [4, 1, 0]], outside_us=6500),
        step(0.020, 0.022, ops=[[3, 1, 1]], outside_us=500),  # hidden: measures nothing
        # 5 read and copied in one step, 6 copied while its read still runs: the worker waited for
        # the reads inside those steps, whose time is not the copies'
        step(0.022, 0.100, ops=[[5, 0, 0], [5, 1, 0]], ready=[5], outside_us=78000),
        step(0.100, 0.102, ops=[[6, 0, 0]]),
        step(0.102, 0.200, ops=[[6, 1, 0]], ready=[6], outside_us=98000),
        # where the recording says how long the launch waited for reads (70 ms), the rest (4 ms)
        # is the copy's: 8 MB at 2 GB/s, as the copies of 2 and 4; the read ended with the wait
        step(
            0.200,
            0.275,
            ops=[[7, 0, 0], [7, 1, 0]],
            ready=[7],
            outside_us=74500,
            host_wait_s=0.070,
            launch=[0.200, 0.2755],
        ),
        # 8 read while the worker ran a long step; the output after it came 1 ms after that step's
        step(0.275, 0.280, ops=[[8, 0, 0]]),
        step(0.280, 0.330),
        step(0.330, 0.331, ready=[8]),
    ]
    variants |= {5: ("lora", 8 * MB), 6: ("lora", 8 * MB), 7: ("lora", 8 * MB), 8: ("lora", 8 * MB)}
    assert copies_waited(steps) == [False, False, False, False, False, True, False, True, False, False, False, False]
    bw = transfer_bandwidths(steps, variants)
    # A read ends with the wait of a step that blocked on it (7: 70 ms), else midway between the output
    # reporting it and the one before (8: 0.3305 - 0.275 = 55.5 ms, within 0.5 ms). Reads whose end is
    # known only within more than a quarter of their time (2: 3 +- 1 ms, 5: 39 +- 39, 6: 51 +- 49) are
    # left out while better ones exist: per kind the median of the rest.
    assert bw["disk_to_host_bps"]["lora"] == pytest.approx(np.median([8 * MB / t for t in (0.070, 0.0555)]))
    # 3's read (7 +- 3 ms) is the only delta read: kept
    assert bw["disk_to_host_bps"]["delta"] == pytest.approx(100 * MB / 0.007)
    assert bw["host_to_gpu_bps"] == pytest.approx({"lora": 12 * MB / 0.006})
