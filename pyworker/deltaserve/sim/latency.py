"""The simulator's step-latency model: two linear models of a step's device time, one for
decode-only steps and one for steps that prefill, over the features the Rust loop computes for
every scheduled step (``deltaserve._native.SIM_FEATURES``, defined in
``router/crates/py/src/sim_latency.rs``), plus the transfer bandwidths of the variant tiers and
the memory geometry of one GPU (what a KV page and a variant take).

The daemon around the device (each term 0 by default, the model before it was measured; the
simulator's loop times them, ``router/crates/py/src/sim_pipeline.rs``)::

    host_decode / host_prefill  the worker thread's launch of a step (linear, same features): under
                                overlapped steps the output of the step in flight waits for it
    graph_max_batch,            which steps a captured CUDA graph replays (feature ``eager`` is 1
    graph_max_tokens,           for the others): decode steps of up to graph_max_batch requests,
    graph_max_delta_tokens      steps that prefill of up to graph_max_tokens tokens (and that
                                many requests), with delta rows up to graph_max_delta_tokens
                                tokens; 0: none
    router_gap_s                a plan's trip from the router's scheduling to the worker
    ingress_s                   a request's arrival (client send) to the engine adding it
    deliver_s                   a step's output leaving the worker to its tokens reaching clients
    stall_s_per_seq             the worker's stalls outside any launch and device span (host pauses:
                                on an H200 S-LoRA S2 recording 0.1-0.2 s every 48-60 steps at ~250
                                requests), as expected seconds per request of a step: priced as
                                device time (``native`` adds it to both kinds' ``seqs`` coefficient)

Features of one step (``const`` is always 1)::

    tokens             tokens computed (prefill chunks + decode tokens)
    seqs               requests in the step
    prefill_tokens     tokens of prefill chunks (a step with any is priced by the prefill model)
    context_tokens     Σ cached length after the step over its requests (∝ KV bytes read)
    prefill_attention  Σ chunk × (start + chunk) over prefill chunks (attention's quadratic part)
    lora_rank_sum      Σ rank over the distinct LoRA adapters in the step
    lora_segments      distinct LoRA adapters      lora_tokens   tokens of LoRA requests
    deltas             distinct deltas             delta_tokens  tokens (rows) of delta requests
    eager              1 when the step runs eagerly, 0 when a captured graph replays it
    dense_delta_segments  in an eager step, distinct deltas with a prefill chunk of at least
                       ``dense_min_m`` tokens: the worker runs such a chunk with its whole delta
                       dequantised (once per delta in the step) plus one matmul, shorter ones through
                       SBMM work tiles (``kernels/sbmm/meta.py``); 0 where ``dense_min_m`` is None
                       (the CPU). In a step a graph replays, 1 when a delta takes the graph's dense
                       lane (``adapters/delta_graphs.py``: one dequantisation and one masked matmul
                       over the bucket per linear, as an eager dense segment), else 0 (every delta
                       token on the tiles): in a step that prefills, padded to the smallest delta
                       bucket holding its tokens, the delta with the most tokens (ties: the first in
                       row order) if it has at least ``dense_lane_tokens(bucket)``
                       (:func:`dense_lane_buckets`); 0 where ``dense_lane_base_tokens`` is None

Fitting (:meth:`LatencyModel.fit`): ordinary least squares (numpy) per step kind, on the
features that vary in the samples of that kind (the others keep coefficient 0, so an unprofiled
cost is not invented); a feature whose fitted coefficient comes out negative is dropped and the
fit repeated, so every cost stays non-negative. Then the slow outliers (a step that also compiled
a kernel: 1.4-1.7 s among 0.04-0.28 s prefill steps of an H100 DeltaZip profile, which alone set the
quadratic attention term) are left out and the fit repeated, once (:func:`_fit_trimmed`: residuals
beyond 6 robust standard deviations and a twentieth of the median step above the median, at most a
tenth of the samples, from 10 samples up), their count under ``samples[f"{kind}_outliers"]``. R² is
reported per kind. A profile is a JSON list of measured steps: ``{"step_s": 0.0123, "tokens": 64,
"seqs": 64, ...}``, features absent from a sample count 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from deltaserve import _native

FEATURES: tuple[str, ...] = tuple(_native.SIM_FEATURES)
"""Feature names in coefficient order (owned by the Rust side)."""
KINDS = ("decode", "prefill")
"""The two step kinds, each with its own linear model."""


@dataclass
class Memory:
    """What one GPU of the modelled kind holds for the model served: sizes the scheduler's pool
    and the variants' footprints for :func:`deltaserve.sim.replay` and the planner."""

    kv_bytes_per_token: int = 524288
    """KV-cache bytes of one token, all layers (Llama-2-7B fp16: 32 layers × 2 × 4096 × 2)."""
    kv_pool_bytes: int = 0
    """Bytes of the KV pool (KV pages and LoRA pages) before delta slots are reserved."""
    max_model_len: int = 4096
    """Longest prompt + output the model takes."""
    lora_pages_per_rank: float = 0.6484375
    """Pool pages (16-token pages) per unit of LoRA rank: ``ceil(rank × this)`` pages."""
    lora_bytes_per_rank: int = 4997120
    """Host bytes of a LoRA adapter per unit of rank."""
    delta_bytes: int = 3358072832
    """Host bytes of one compressed delta, and GPU bytes of one delta slot."""


@dataclass
class LatencyModel:
    """Step time ``max(0, coef[kind] · features)`` with ``kind`` decode or prefill, transfer
    bandwidths per variant kind, and the GPU's :class:`Memory`. JSON round trip with
    :meth:`save` / :meth:`load`."""

    decode: dict[str, float]
    """Seconds per unit of each feature for decode-only steps."""
    prefill: dict[str, float]
    """Seconds per unit of each feature for steps with a prefill chunk."""
    disk_to_host_bps: dict[str, float] = field(default_factory=lambda: {"lora": 6e8, "delta": 1.5e9})
    """Read bandwidth disk -> host memory per variant kind (bytes/s)."""
    host_to_gpu_bps: dict[str, float] = field(default_factory=lambda: {"lora": 2e10, "delta": 2.6e10})
    """Copy bandwidth host -> GPU per variant kind (bytes/s)."""
    memory: Memory = field(default_factory=Memory)
    """The GPU's pool and the variants' footprints."""
    r2: dict[str, float | None] = field(default_factory=dict)
    """Coefficient of determination of each kind's fit (None: too few samples to say)."""
    samples: dict[str, int] = field(default_factory=dict)
    """Samples each kind was fitted on."""
    host_decode: dict[str, float] = field(default_factory=dict)
    """Worker host seconds to launch a decode-only step, per unit of each feature (none: 0)."""
    host_prefill: dict[str, float] = field(default_factory=dict)
    """Worker host seconds to launch a step with a prefill chunk, per unit of each feature."""
    graph_max_batch: int = 0
    """Largest decode batch a captured CUDA graph replays (0: no graphs, every step eager)."""
    graph_max_tokens: int = 0
    """Largest step that prefills (tokens) a captured graph replays (0: every such step eager)."""
    graph_max_delta_tokens: int = 0
    """Largest step with delta rows that prefills (tokens) a captured graph replays (0: every such step
    eager, as the worker ran them before its mixed graphs took delta rows)."""
    dense_min_m: int | None = None
    """Fewest tokens of a delta's prefill chunk the worker runs dense (``sbmm.dense_min_m`` of the
    profiled device: 64 on CUDA; at least 2), feature ``dense_delta_segments``; None: no dense path
    (the CPU, and models from before the feature, whose coefficient is then 0)."""
    dense_lane_base_tokens: int | None = None
    """The constant term of the worker's dense-lane threshold (``delta_graphs.DENSE_LANE_BASE_TOKENS``
    of the profiled worker, on CUDA; :func:`dense_lane_buckets`), feature ``dense_delta_segments`` of a
    replayed step; None: no lane modelled (the CPU, and models from before the lane: a replayed step
    then has no dense segment)."""
    router_gap_s: float = 0.0
    """Seconds from the router forming a plan to the worker receiving it."""
    ingress_s: float = 0.0
    """Seconds from a request's send to the engine adding it (HTTP, tokenizer, command queue)."""
    deliver_s: float = 0.0
    """Seconds from a step's output leaving the worker to its tokens reaching the clients."""
    stall_s_per_seq: float = 0.0
    """Expected seconds of worker stall per request of a step (``sim.record.worker_stall_s_per_seq``:
    outputs later than both their device span and the next launch); 0: none measured."""
    device: str = ""
    """The GPU the samples were measured on."""
    source: str = ""
    """Where the samples came from (files, command)."""

    @classmethod
    def fit(cls, samples: Iterable[Mapping[str, Any]], window: int = 1, **kw: Any) -> LatencyModel:
        """Fits both kinds from measured steps (module docstring); ``kw`` sets the other fields.

        ``window`` > 1 fits both kinds at once on the sums over every ``window`` consecutive
        samples of one run (a sliding window; a sample's optional ``run`` key names its run of
        consecutive steps, default one run): for recordings of overlapped steps, where part of a
        step's cost lands in its neighbour's measured period, which per-step samples then
        misattribute (``bench/sim_validate.py`` uses 2, the steps in flight). R² is then the
        windows' own, under the key ``windows``.

        Raises ``ValueError`` for a sample without a positive finite ``step_s``, an unknown
        feature, a kind with no samples, or a window below 1."""
        if window < 1:
            raise ValueError(f"window {window}: want at least 1 sample")
        rows: dict[str, list[tuple[np.ndarray, float]]] = {k: [] for k in KINDS}
        runs: dict[Any, list[tuple[str, np.ndarray, float]]] = {}
        for i, s in enumerate(samples):
            unknown = set(s) - set(FEATURES) - {"step_s", "const", "run"}
            if unknown:
                raise ValueError(f"sample {i}: unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")
            t = s.get("step_s")
            if not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
                raise ValueError(f"sample {i}: step_s must be a positive number of seconds, got {t!r}")
            kind = "prefill" if s.get("prefill_tokens", 0) > 0 else "decode"
            x = features_vector(s)
            rows[kind].append((x, float(t)))
            runs.setdefault(s.get("run", 0), []).append((kind, x, float(t)))
        for kind in KINDS:
            if not rows[kind]:
                raise ValueError(f"no {kind} samples: the profile needs steps of both kinds")
        counts = {k: len(rows[k]) for k in KINDS}
        if window > 1:
            return cls._fit_windows(list(runs.values()), window, counts, **kw)
        coefs: dict[str, dict[str, float]] = {}
        r2: dict[str, float | None] = {}
        for kind in KINDS:
            x = np.stack([r[0] for r in rows[kind]])
            y = np.array([r[1] for r in rows[kind]])
            c, r2[kind], dropped = _fit_trimmed(x, y)
            coefs[kind] = {f: float(v) for f, v in zip(FEATURES, c)}
            if dropped:
                counts[f"{kind}_outliers"] = dropped
        return cls(decode=coefs["decode"], prefill=coefs["prefill"], r2=r2, samples=counts, **kw)

    @classmethod
    def _fit_windows(cls, runs: list[list[tuple[str, np.ndarray, float]]], window: int, counts: dict[str, int],
                     **kw: Any) -> LatencyModel:  # fmt: skip
        """:meth:`fit` over sliding windows: one row per ``window`` consecutive samples of a run,
        the decode and the prefill features summed in separate columns."""
        width = len(FEATURES)
        xs, ys = [], []
        for run in runs:
            cols = []
            for kind, x, t in run:
                row = np.zeros(2 * width)
                at = KINDS.index(kind) * width
                row[at : at + width] = x
                cols.append((row, t))
            for i in range(len(cols) - window + 1):
                xs.append(sum(r for r, _ in cols[i : i + window]))
                ys.append(sum(t for _, t in cols[i : i + window]))
        if not xs:
            raise ValueError(f"no run of {window} consecutive samples to fit")
        c, r2 = _fit_nonnegative(np.stack(xs), np.array(ys))
        coefs = {kind: {f: float(v) for f, v in zip(FEATURES, c[i * width : (i + 1) * width])}
                 for i, kind in enumerate(KINDS)}  # fmt: skip
        return cls(decode=coefs["decode"], prefill=coefs["prefill"], r2={"windows": r2}, samples=counts, **kw)

    def fit_host(self, samples: Iterable[Mapping[str, Any]]) -> LatencyModel:
        """Sets ``host_decode`` / ``host_prefill`` from measured launches: samples of step
        features with ``host_s`` (the worker's launch seconds, ``deltaserve.sim.record``), least
        squares per kind as :meth:`fit`'s; a kind without samples keeps no host cost. R² under
        ``host_decode`` / ``host_prefill``. Returns ``self``."""
        rows: dict[str, list[tuple[np.ndarray, float]]] = {k: [] for k in KINDS}
        for i, s in enumerate(samples):
            t = s.get("host_s")
            if not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
                raise ValueError(f"sample {i}: host_s must be seconds >= 0, got {t!r}")
            kind = "prefill" if s.get("prefill_tokens", 0) > 0 else "decode"
            rows[kind].append((features_vector(s), float(t)))
        for kind in KINDS:
            if not rows[kind]:
                continue
            c, r2, dropped = _fit_trimmed(np.stack([r[0] for r in rows[kind]]), np.array([r[1] for r in rows[kind]]))
            setattr(self, f"host_{kind}", {f: float(v) for f, v in zip(FEATURES, c)})
            self.r2[f"host_{kind}"] = r2
            self.samples[f"host_{kind}"] = len(rows[kind])
            if dropped:
                self.samples[f"host_{kind}_outliers"] = dropped
        return self

    def predict(self, step: Mapping[str, float]) -> float:
        """Seconds one step takes on the device: ``step`` maps feature names to values (absent: 0)."""
        coef = self.prefill if step.get("prefill_tokens", 0) > 0 else self.decode
        return max(0.0, sum(coef.get(f, 0.0) * v for f, v in zip(FEATURES, features_vector(step))))

    def predict_host(self, step: Mapping[str, float]) -> float:
        """Seconds the worker's host takes to launch one step (0 without a host model)."""
        coef = self.host_prefill if step.get("prefill_tokens", 0) > 0 else self.host_decode
        return max(0.0, sum(coef.get(f, 0.0) * v for f, v in zip(FEATURES, features_vector(step))))

    def native_options(self) -> dict[str, Any]:
        """The daemon terms as ``_native.simulate`` keywords (module docstring); ``router_gap_s``
        is :func:`deltaserve.sim.replay`'s to pass."""
        host = None
        if self.host_decode or self.host_prefill:
            host = ([self.host_decode.get(f, 0.0) for f in FEATURES], [self.host_prefill.get(f, 0.0) for f in FEATURES])
        return {"host": host, "graphs": (int(self.graph_max_batch), int(self.graph_max_tokens),
                                           int(self.graph_max_delta_tokens)),
                "ingress_s": float(self.ingress_s), "deliver_s": float(self.deliver_s),
                "dense_min_m": self.dense_min_m,
                "dense_lane": None if self.dense_lane_base_tokens is None
                              else list(dense_lane_buckets(self.dense_lane_base_tokens))}  # fmt: skip

    def native(self) -> tuple[list[float], list[float], tuple[float, float], tuple[float, float]]:
        """The form ``_native.simulate`` takes: the coefficients with ``stall_s_per_seq`` on ``seqs``."""
        stall = {"seqs": self.stall_s_per_seq}
        return (
            [self.decode.get(f, 0.0) + stall.get(f, 0.0) for f in FEATURES],
            [self.prefill.get(f, 0.0) + stall.get(f, 0.0) for f in FEATURES],
            (self.disk_to_host_bps["lora"], self.disk_to_host_bps["delta"]),
            (self.host_to_gpu_bps["lora"], self.host_to_gpu_bps["delta"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """Everything, as JSON-ready values."""
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        """Writes the model as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LatencyModel:
        """The inverse of :meth:`to_dict`; ``ValueError`` names a missing or unknown field."""
        d = dict(d)
        try:
            memory = Memory(**d.pop("memory", {}))
            model = cls(memory=memory, **d)
        except TypeError as e:
            raise ValueError(f"not a latency model: {e}") from None
        for kind in (*KINDS, "host_decode", "host_prefill"):
            bad = set(getattr(model, kind)) - set(FEATURES)
            if bad:
                raise ValueError(f"{kind}: unknown features {sorted(bad)}; known: {', '.join(FEATURES)}")
        terms = ("router_gap_s", "ingress_s", "deliver_s", "stall_s_per_seq", "graph_max_batch", "graph_max_tokens",
                 "graph_max_delta_tokens")  # fmt: skip
        for name in terms:
            x = getattr(model, name)
            if not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
                raise ValueError(f"{name}: want a number >= 0, got {x!r}")
        m = model.dense_min_m
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 2):
            raise ValueError(f"dense_min_m: want None or tokens >= 2 (a one-token chunk is a decode row), got {m!r}")
        lane = model.dense_lane_base_tokens
        if lane is not None and (not isinstance(lane, int) or isinstance(lane, bool) or lane < 0):
            raise ValueError(f"dense_lane_base_tokens: want None or tokens >= 0, got {lane!r}")
        for name in ("disk_to_host_bps", "host_to_gpu_bps"):
            bw = getattr(model, name)
            if set(bw) != {"lora", "delta"} or not all(v > 0 for v in bw.values()):
                raise ValueError(f"{name}: want positive bytes/s for 'lora' and 'delta', got {bw}")
        return model

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        """Reads a model written by :meth:`save`."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


@cache
def dense_lane_buckets(base_tokens: int) -> tuple[tuple[int, int], ...]:
    """The worker's dense lane with threshold base ``base_tokens`` (``LatencyModel.dense_lane_base_tokens``):
    ``(bucket, fewest tokens of one delta in its lane)`` for each delta token bucket of the mixed graphs
    (``worker.mixed_graphs.DELTA_TOKEN_BUCKETS``, ascending; ``adapters.delta_graphs.dense_lane_tokens``),
    ``_native.simulate``'s ``dense_lane``. Both worker modules import torch, so they are imported here, when
    a model has a lane, and not with the simulator."""
    from deltaserve.adapters.delta_graphs import dense_lane_tokens
    from deltaserve.worker.mixed_graphs import DELTA_TOKEN_BUCKETS

    return tuple((b, dense_lane_tokens(b, base_tokens)) for b in DELTA_TOKEN_BUCKETS)


def features_vector(step: Mapping[str, Any]) -> np.ndarray:
    """The step's features in :data:`FEATURES` order (``const`` = 1, absent ones 0)."""
    return np.array([1.0] + [float(step.get(f, 0.0)) for f in FEATURES[1:]])


OUTLIER_SIGMAS = 6.0
"""A sample whose residual lies this many robust standard deviations (1.4826 x the median absolute
deviation) above the median residual is an outlier (:func:`_fit_trimmed`)."""
MAX_OUTLIERS = 0.1
"""At most this fraction of a kind's samples are left out as outliers; more that far off are not
one-offs but a cost the features miss, and all are kept."""


def _fit_trimmed(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float | None, int]:
    """:func:`_fit_nonnegative`, then again without the slow outliers of its residuals (module
    docstring); returns ``c``, R² (of the samples fitted) and how many samples were left out."""
    c, r2 = _fit_nonnegative(x, y)
    if len(y) < 10:
        return c, r2, 0
    residual = y - x @ c
    mid = float(np.median(residual))
    spread = 1.4826 * float(np.median(np.abs(residual - mid)))
    # at least a twentieth of the median step beyond the median: an exact fit's rounding is no outlier
    slow = residual > mid + max(OUTLIER_SIGMAS * spread, 0.05 * float(np.median(y)))
    if not 0 < slow.sum() <= MAX_OUTLIERS * len(y):
        return c, r2, 0
    c, r2 = _fit_nonnegative(x[~slow], y[~slow])
    return c, r2, int(slow.sum())


def _fit_nonnegative(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float | None]:
    """Least squares of ``y ≈ x @ c`` over the columns that vary (plus ``const``), dropping any
    column whose coefficient comes out negative and refitting; returns ``c`` and R²."""
    varies = np.ptp(x, axis=0) > 0
    active = [j for j in range(x.shape[1]) if j == 0 or varies[j]]
    c = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [j for j, v in zip(active, sol) if v < 0]
        if not negative:
            c[active] = sol
            break
        worst = min(negative, key=lambda j: sol[active.index(j)])
        active.remove(worst)
    residual = y - x @ c
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = None if len(y) < 2 or ss == 0 else 1.0 - float((residual**2).sum()) / ss
    return c, r2
