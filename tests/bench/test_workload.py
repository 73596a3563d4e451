"""bench/workload.py: the generated traces have the asked rates, burstiness (cv), popularity,
lengths and Punica shapes, and are byte-for-byte deterministic.

Statistical checks use fixed seeds and tolerances of about four standard errors of the estimate
at the sample size used (stated at each check), so a wrong generator fails while the seed cannot
make a right one fail by bad luck beyond ~1e-4."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from bench import workload as wl

# Statistics need many requests but no prompt tokens: one-token prompts keep the traces cheap.
CHEAP = {"input_range": (1, 1), "output_range": (1, 1)}


def gaps(trace: wl.Trace) -> np.ndarray:
    t = np.array([r.t for r in trace.requests])
    return np.diff(np.concatenate([[0.0], t]))


def counts_by_index(trace: wl.Trace) -> np.ndarray:
    index = {v.name: i for i, v in enumerate(trace.variants)}
    return np.bincount([index[r.variant] for r in trace.requests], minlength=len(trace.variants))


@pytest.mark.parametrize("cv", [1.0, 4.0])
def test_slora_rate_and_cv(cv):
    rate, duration = 10.0, 4000.0
    t = wl.slora(50, 1.0, rate, cv, duration, seed=1, **CHEAP)
    g = gaps(t)
    assert len(t.requests) == int(rate * duration) == 40000
    assert all(a.t <= b.t for a, b in itertools.pairwise(t.requests))
    # Mean gap: standard error cv / rate / sqrt(n) = 0.5 % (cv 1), 2 % (cv 4) of the mean.
    assert g.mean() == pytest.approx(1 / rate, rel=4 * cv / math.sqrt(len(g)))
    # Sample cv of Gamma(1/cv²) gaps: relative standard error ~ sqrt((1 + 1.5 cv²) / n) ≈ 1 % (cv 1),
    # 2.5 % (cv 4) here (the 4th moment of the Gamma); 4 of them.
    cv_hat = g.std() / g.mean()
    assert cv_hat == pytest.approx(cv, rel=4 * math.sqrt((1 + 1.5 * cv * cv) / len(g)))
    # The mean rate over the whole trace (what a replay offers).
    assert len(t.requests) / t.duration == pytest.approx(rate, rel=4 * cv / math.sqrt(len(g)))


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.1])
def test_slora_power_popularity_is_s_lora_code(alpha):
    """S-LoRA's draw: P(index < k) = (k / n)^alpha (alpha = 1: uniform)."""
    n = 100
    t = wl.slora(n, alpha, 10.0, 1.0, 4000.0, seed=2, **CHEAP)
    counts = counts_by_index(t)
    cdf = np.cumsum(counts) / counts.sum()
    expected = (np.arange(1, n + 1) / n) ** alpha
    # DKW: sup |F_hat - F| > eps with probability <= 2 exp(-2 N eps²) = 2e-4 at eps = 0.0109 (N = 40000).
    assert np.abs(cdf - expected).max() < 0.011
    if alpha == 1.0:
        assert counts.min() > 0.75 * counts.mean()  # uniform: 400 ± 20 per adapter


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_slora_zipf_popularity_slope(alpha):
    """The paper text's reading: log(count) against log(rank) has slope -alpha."""
    n = 200
    t = wl.slora(n, alpha, 20.0, 1.0, 5000.0, seed=3, popularity="zipf", **CHEAP)
    counts = counts_by_index(t)
    top = 30  # ranks with at least ~ hundreds of requests, where Poisson noise is small
    slope = np.polyfit(np.log(np.arange(1, top + 1)), np.log(counts[:top]), 1)[0]
    assert slope == pytest.approx(-alpha, abs=0.06)
    assert counts[0] / counts[1] == pytest.approx(2**alpha, rel=0.08)


def test_slora_ranks_round_robin_and_lengths():
    t = wl.slora(7, 1.0, 20.0, 1.0, 200.0, input_range=(8, 40), output_range=(3, 17), ranks=(64, 32, 16, 8),
                 vocab=(100, 500), seed=4)  # fmt: skip
    assert [v.rank for v in t.variants] == [64, 32, 16, 8, 64, 32, 16]
    assert [v.name for v in t.variants] == [f"a{i:04d}" for i in range(7)]
    ins = np.array([len(r.prompt) for r in t.requests])
    outs = np.array([r.output_len for r in t.requests])
    assert (ins.min(), ins.max()) == (8, 40) and (outs.min(), outs.max()) == (3, 17)
    # Roughly uniform: every value appears, each value's count within 5 standard errors of N/k.
    for values, k in ((ins, 33), (outs, 15)):
        c = np.bincount(values - values.min(), minlength=k)
        assert len(c) == k and np.abs(c - len(values) / k).max() < 5 * math.sqrt(len(values) / k)
    ids = np.concatenate([r.prompt for r in t.requests])
    assert ids.min() >= 100 and ids.max() < 500
    body = t.requests[0].body("base:a0001")
    assert body["max_tokens"] == t.requests[0].output_len and body["ignore_eos"] is True
    assert body["prompt"] == t.requests[0].prompt and body["stream"] is True


def test_punica_shapes_exact():
    n = 1000
    shapes = {s: wl.punica(s, n, 5.0, seed=5, **CHEAP) for s in wl.PUNICA_SHAPES}
    used = {s: Counter(r.variant for r in t.requests) for s, t in shapes.items()}
    assert len(used["distinct"]) == n and len(shapes["distinct"].variants) == n
    assert len(used["identical"]) == 1 and len(shapes["identical"].variants) == 1
    k = math.ceil(math.sqrt(n))
    assert len(shapes["uniform"].variants) == k == len(used["uniform"]) == 32
    assert max(used["uniform"].values()) - min(used["uniform"].values()) <= 1  # equally popular
    for t in shapes.values():
        assert len(t.requests) == n


def test_punica_skewed_is_zipf_1_5():
    n = 20000
    t = wl.punica("skewed", n, 5.0, seed=6, **CHEAP)
    counts = counts_by_index(t)
    # P(i) ∝ i^-1.5: the top two ratio is 2^1.5 = 2.83; counts ~7700 and ~2700 → ~2.5 % error.
    assert counts[0] / counts[1] == pytest.approx(2**1.5, rel=0.1)
    assert counts[0] / counts[3] == pytest.approx(4**1.5, rel=0.15)
    p = 1 / np.arange(1, n + 1) ** 1.5
    assert counts[0] / n == pytest.approx(p[0] / p.sum(), rel=0.05)
    # Poisson arrivals.
    g = gaps(t)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("popularity", wl.DELTAZIP_POPULARITY)
def test_deltazip(popularity):
    t = wl.deltazip(1.0, 20000.0, popularity=popularity, seed=7, **CHEAP)
    assert [v.name for v in t.variants] == [f"ft{i:02d}" for i in range(32)]
    assert all(v.kind == "full" and v.rank is None for v in t.variants)
    counts = counts_by_index(t)
    if popularity == "uniform":
        assert np.abs(counts - counts.mean()).max() < 5 * math.sqrt(counts.mean())  # 625 ± 25 each
    else:
        assert counts[0] / counts[1] == pytest.approx(2**1.5, rel=0.1)
    g = gaps(t)
    assert g.mean() == pytest.approx(1.0, rel=4 / math.sqrt(len(g)))
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)


def test_deterministic_bytes_and_round_trip(tmp_path):
    make = lambda seed: wl.slora(20, 0.8, 4.0, 2.0, 30.0, input_range=(4, 20), output_range=(4, 9), seed=seed)  # noqa: E731
    a, b = make(11), make(11)
    assert a.dumps() == b.dumps()
    assert make(12).dumps() != a.dumps()
    path = a.write(tmp_path / "t.jsonl")
    back = wl.Trace.read(path)
    assert back.dumps() == path.read_text()
    assert back.requests == a.requests and back.variants == a.variants
    assert back.params["alpha"] == 0.8 and back.params["ranks"] == [8]


def test_streams_are_independent():
    """Changing the rate (same request count) keeps who asks for what, and the lengths."""
    a = wl.slora(30, 0.5, 2.0, 1.0, 100.0, input_range=(1, 30), output_range=(1, 30), seed=8)
    b = wl.slora(30, 0.5, 4.0, 1.0, 50.0, input_range=(1, 30), output_range=(1, 30), seed=8)
    assert [r.variant for r in a.requests] == [r.variant for r in b.requests]
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert a.requests[-1].t == pytest.approx(2 * b.requests[-1].t, rel=1e-5)


def test_bad_parameters_and_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="input_range"):
        wl.slora(5, 1.0, 1.0, 1.0, 10.0, input_range=(10, 5))
    with pytest.raises(ValueError, match="rate"):
        wl.deltazip(0.0, 10.0)
    with pytest.raises(ValueError, match="Punica shape 'zipf'"):
        wl.punica("zipf", 10, 1.0)
    with pytest.raises(ValueError, match="popularity"):
        wl.deltazip(1.0, 10.0, popularity="azure")
    path = wl.slora(3, 1.0, 2.0, 1.0, 3.0, seed=0, **CHEAP).write(tmp_path / "t.jsonl")
    lines = path.read_text().splitlines()
    (tmp_path / "bad.jsonl").write_text("\n".join([lines[0], lines[1], "{not json"]) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: bad request line"):
        wl.Trace.read(tmp_path / "bad.jsonl")
    (tmp_path / "short.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ValueError, match="header says 6 requests, the file has 5"):
        wl.Trace.read(tmp_path / "short.jsonl")
