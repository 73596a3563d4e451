"""The serving experiments: each a named set of points (trace specs) run against one server start.

Experiments (defaults; ``--smoke`` shrinks each to a few requests on a tiny model on the CPU)::

    smoke        demo model (SmolLM2-135M), 3 random adapters (ranks 8, 4), 6 requests, sse + ws
    slora-s1     S-LoRA Table 3, S1: Llama-2-7B shape, rank 8, n ∈ {5, 100, 1000, 2000}, alpha 1,
                 cv 1, lengths U[8, 512], rate 40 req/s (above what one H200 serves: saturates),
                 60 s per point (S-LoRA: 5 min)
    slora-s2     the same with ranks 64/32/16/8 round-robin
    slo-vs-rate  S2 ranks, n = 100, alpha 1, cv ∈ {1, 4}, rate ∈ {2, 4, 8, 12, 16, 20, 24}, 60 s
    deltazip     DeltaZip §6 analogue: Llama-2-7B shape, n = 32 full fine-tunes (4-bit 2:4 deltas
                 for deltaserve, full fp16 models for swap), Poisson arrivals, popularity
                 ∈ {zipf-1.5, uniform} × rate ∈ {0.5, 1} req/s, 60 s per point; prompts U[8, 512],
                 outputs U[8, 128] tokens (shorter than the other experiments' U[8, 512] so the
                 swap baseline, which swaps a 13.5 GB model for most batches, drains a point in
                 minutes on one H100; workload.deltazip has no paper lengths). deltaserve:
                 --max-deltas 3 (DeltaZip's N) and a 32 GiB host tier (~9 deltas of 3.4 GB);
                 swap: --resident auto (as many full models as fit beside one batch, as
                 DeltaZip's vLLM-SCB baseline holds: 9 on an H200), --max-batch 32.
                 --distinct-weights 4 delta payloads, --distinct-checkpoints 2 (base + one).
                 Probes 4 variants after the points. Smoke: the tiny smoke-llama shape, 4
                 variants (all distinct), 2 slots, 4 requests per point.

``MAX_RATE`` (40 req/s) is the highest rate any experiment uses; bench/replay_capacity.py measures
that the replay client sustains 5× it (tests/bench/test_replay.py checks every request of that load
completes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bench import workload as wl
from bench.common import SMOKE_SHAPE

MAX_RATE = 40.0
"""The highest request rate any experiment below offers (req/s)."""
S2_RANKS = (64, 32, 16, 8)
"""S-LoRA Table 1, S2."""
GPU_FLAGS = ("--variant-host-bytes", str(48 << 30), "--max-deltas", "0")
"""S-LoRA keeps every adapter in host memory: 2000 rank-8 Llama-2-7B adapters are 34 GB (S2's
average rank ~30: too many for host RAM at n = 2000, so the host tier evicts there). No delta
slots: the LoRA experiments give the whole pool to KV and adapters, as S-LoRA does."""
DAEMON_GPU_FLAGS = {"deltaserve": GPU_FLAGS, "merged": GPU_FLAGS}
"""The LoRA experiments' flags per server: only the daemon takes them."""
DELTAZIP_RATES = (0.5, 1.0)
"""Default DeltaZip-analogue rates (req/s); expected to overload the swap baseline, which reads a 13.5 GB model
for most batches (not measured yet)."""
DELTAZIP_LENGTHS = ((8, 512), (8, 128))
"""Prompt and output length ranges of the deltazip experiment (see the module docstring)."""
DELTAZIP_FLAGS = {
    "deltaserve": ("--max-deltas", "3", "--variant-host-bytes", str(32 << 30)),
    "swap": ("--resident", "auto"),
}
"""DeltaZip's N = 3 delta slots, a host tier of ~9 Llama-2-7B deltas; swap keeps as many full models."""


@dataclass(frozen=True)
class Point:
    """One measurement: a trace spec (``workload.slora`` keyword arguments) and how to replay it."""

    label: str
    """Names the point in results and plot legends."""
    trace: dict[str, Any]
    """Keyword arguments of the ``workload`` generator."""
    protocol: str = "sse"
    """Replay transport (``replay.PROTOCOLS``)."""
    workload: str = "slora"
    """The trace generator, a key of ``WORKLOADS``."""


@dataclass(frozen=True)
class Experiment:
    """A named set of points run against one server start."""

    name: str
    """The result file's experiment name."""
    shape: str
    """A ``common.SHAPES`` key (random weights of that shape), or ``"demo"`` (SmolLM2 on CPU)."""
    points: tuple[Point, ...]
    """In run order."""
    slo_tpot: float | None = None
    """TPOT SLO (seconds) for the attainment figures; the TTFT SLO is S-LoRA's 6 s."""
    server_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Extra flags per ``--server`` name (``--server-flag``s given for a flag replace its value)."""
    timeout_s: float = 900.0
    """Per-request limit (an overloaded server may queue for minutes)."""
    distinct_weights: int = 8
    """Random weight files written per LoRA rank, or delta payloads (``--distinct-weights``)."""
    distinct_checkpoints: int = 2
    """Real full checkpoints behind the swap baseline's variants, the base included
    (``--distinct-checkpoints``)."""
    probe_variants: int = 0
    """Variants sent one fixed greedy prompt after the points (``probe_variants``)."""


WORKLOADS: dict[str, Callable[..., wl.Trace]] = {"slora": wl.slora, "deltazip": wl.deltazip}
"""Trace generators by ``Point.workload``."""


def _label(trace: dict, protocol: str) -> str:
    return f"n={trace['n_variants']} R={trace['rate']:g} cv={trace['cv']:g} {protocol}"


def _slora_points(ns, rates, cvs, ranks, duration, lengths, protocols=("sse",), vocab=(100, 32000)):
    return tuple(
        Point(label=f"n={n} R={rate:g} cv={cv:g} {p}", protocol=p,
              trace={"n_variants": n, "alpha": 1.0, "rate": rate, "cv": cv, "duration": duration,
                     "input_range": lengths, "output_range": lengths, "ranks": ranks, "vocab": vocab, "seed": 0})
        for n in ns for rate in rates for cv in cvs for p in protocols
    )  # fmt: skip


def _deltazip_points(popularities, ns, rates, duration, input_range, output_range, vocab=(100, 32000)):
    return tuple(
        Point(label=f"{pop} n={n} R={rate:g}", workload="deltazip",
              trace={"rate": rate, "duration": duration, "popularity": pop, "n_variants": n,
                     "input_range": input_range, "output_range": output_range, "vocab": vocab, "seed": 0})
        for pop in popularities for n in ns for rate in rates
    )  # fmt: skip


def deltazip_experiment(n: list[int] | None = None, rate: list[float] | None = None,
                        popularity: list[str] | None = None, duration: float | None = None,
                        smoke: bool = False) -> Experiment:  # fmt: skip
    """The DeltaZip analogue (module docstring); ``smoke``: 4 variants of the tiny smoke shape, a
    few requests per point at rates that keep the sweep's order."""
    pops = popularity or ["zipf-1.5", "uniform"]
    for pop in pops:
        if pop not in wl.DELTAZIP_POPULARITY:
            raise SystemExit(f"--popularity {pop!r}: want one of {', '.join(wl.DELTAZIP_POPULARITY)}")
    rates = rate or list(DELTAZIP_RATES)
    if smoke:  # 4 requests per point (int(rate * duration)), rates 3 and 4 req/s for the defaults
        pts = _deltazip_points(pops, n or [4], [2.0 + 2.0 * r for r in rates], 1.0, (4, 12), (2, 6), vocab=(3, 256))
        pts = tuple(replace(p, trace={**p.trace, "duration": 4.5 / p.trace["rate"]}) for p in pts)
        return Experiment("deltazip", SMOKE_SHAPE, pts, timeout_s=300, distinct_weights=4, distinct_checkpoints=4,
                          server_flags={"deltaserve": ("--max-deltas", "2"), "swap": ("--resident", "2")},
                          probe_variants=4)  # fmt: skip
    return Experiment("deltazip", "llama-2-7b", _deltazip_points(pops, n or [wl.DELTAZIP_VARIANTS], rates,
                                                                 duration or 60.0, *DELTAZIP_LENGTHS),
                      server_flags=DELTAZIP_FLAGS, distinct_weights=4, distinct_checkpoints=2, probe_variants=4)  # fmt: skip


def experiment(name: str, *, n: list[int] | None = None, rate: list[float] | None = None, cv: list[float] | None = None,
               duration: float | None = None, popularity: list[str] | None = None,
               smoke: bool = False) -> Experiment:  # fmt: skip
    """The named experiment with optional overrides of its sweeps (``--n``, ``--rate``, ``--cv``,
    ``--duration``, ``--popularity``); ``smoke`` shrinks it to a few short requests on a tiny CPU
    model."""
    lengths = (8, 512)
    if name == "deltazip":
        if cv:
            raise SystemExit("--cv: the deltazip experiment's arrivals are Poisson (cv 1)")
        return deltazip_experiment(n, rate, popularity, duration, smoke)
    if popularity:
        raise SystemExit(f"--popularity: only the deltazip experiment sweeps popularity, not {name!r}")
    if name == "smoke":
        return Experiment(name, "demo", _slora_points([3], [2.0], [1.0], (8, 4), 3.0, (4, 12), ("sse", "ws"),
                                                      vocab=(1000, 40000)), timeout_s=300)  # fmt: skip
    if name in ("slora-s1", "slora-s2"):
        ranks = (8,) if name == "slora-s1" else S2_RANKS
        exp = Experiment(name, "llama-2-7b", _slora_points(n or [5, 100, 1000, 2000], rate or [MAX_RATE], cv or [1.0],
                                                           ranks, duration or 60.0, lengths),
                         server_flags=DAEMON_GPU_FLAGS)  # fmt: skip
    elif name == "slo-vs-rate":
        exp = Experiment(name, "llama-2-7b", _slora_points(n or [100], rate or [2, 4, 8, 12, 16, 20, 24],
                                                           cv or [1.0, 4.0], S2_RANKS, duration or 60.0, lengths),
                         slo_tpot=0.2, server_flags=DAEMON_GPU_FLAGS)  # fmt: skip
    else:
        raise SystemExit(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    if smoke:  # same sweep structure, ~6 short requests per point on the demo model; rates keep their order

        def shrink(t: dict) -> dict:
            r = 1 + 3 * min(t["rate"], MAX_RATE) / MAX_RATE
            return {**t, "n_variants": math.ceil(math.log10(t["n_variants"])) + 1, "ranks": tuple(min(k, 8) for k in t["ranks"]),
                    "rate": r, "duration": 6 / r, "input_range": (4, 12), "output_range": (2, 6),
                    "vocab": (1000, 40000)}  # fmt: skip

        pts = tuple(
            replace(p, trace=shrink(p.trace), label=_label(shrink(p.trace), p.protocol)) for p in exp.points[:4]
        )
        exp = replace(exp, shape="demo", points=pts, timeout_s=300, server_flags={})
    return exp


EXPERIMENTS = ("smoke", "slora-s1", "slora-s2", "slo-vs-rate", "deltazip")
