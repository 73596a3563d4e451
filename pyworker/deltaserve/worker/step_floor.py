"""The floor of a served step: the least time any implementation could take for what the step runs.

The roofline model, with the device's two ceilings measured once at start-up (``measure_roofline``)::

    bytes = base weights (every parameter, read once per step)
          + KV the step attends over: Σ over its requests of (tokens computed + tokens scheduled) × K/V bytes
          + variant bytes the step touches, once per distinct variant in it (``VariantCost.read_bytes``:
            a LoRA adapter's A/B rows, a delta's packed linears and dense lm_head delta), and a block
            several of its variants share once (``VariantCost.shared``: the zoo's per-block batching)
    flops = 2 × block-linear params × tokens + 2 × lm_head params × logits rows
          + attention: 4 × layers × heads × head_dim × (query, key) pairs (a chunk of n tokens after c
            computed ones has n·c + n(n+1)/2 causal pairs; a decode token is a chunk of 1)
          + variant linears: Σ over the step's variants of ``VariantCost.flops_per_token`` × its tokens
    floor = max(bytes ÷ copy bandwidth, flops ÷ matmul peak)                  (microseconds)

Assumptions (each makes the floor lower, never higher, than a real step's): every byte is read exactly
once per step at the bandwidth of a large device-to-device copy (bytes read plus written ÷ time, as
``bench/common.copy_bandwidth``), so caches and re-reads are free; activations, logits, the embedding
rows gathered and the K/V written are not counted; compute runs at the peak of one large square matmul
in the serving dtype, with no overlap loss between the memory-bound and compute-bound parts; norms,
rotary, sampling and launch overheads cost nothing. The ratio Σ measured step time ÷ Σ floor (the
*served-step efficiency*) is what the benchmarks report; 1.0 is the bound. The measured time is each
step's ``busy_us`` (``worker/loop.py``), not its ``total_us``: a step launched behind the one in flight
counts that wait in ``total_us``, which would count overlapped seconds twice.

``measure_roofline`` is the calibration: a large copy and a large matmul, a few repetitions, best of
(about 20 ms on a GPU, tens of ms on CPU). It runs once per process and device and is cached; the
environment variable ``DELTASERVE_ROOFLINE=<copy GB/s>,<matmul TFLOP/s>`` replaces it (tests, or
pinning the ceilings of a known card).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.adapters.variants import VariantCost, VariantKind, VariantPool
from deltaserve.model.arch import ModelConfig

from .requests import RequestState

log = logging.getLogger("deltaserve.worker")

ROOFLINE_ENV = "DELTASERVE_ROOFLINE"
"""``<copy GB/s>,<matmul TFLOP/s>``: the ceilings to use instead of measuring them."""


@dataclass(frozen=True)
class Roofline:
    """The device's two ceilings in the serving dtype."""

    copy_bytes_per_s: float
    """Device-to-device copy bandwidth: bytes read plus bytes written per second."""
    matmul_flops_per_s: float
    """Dense matmul throughput (2·m·n·k per product) per second."""
    source: str
    """``measured`` (with the device and dtype) or ``$DELTASERVE_ROOFLINE``."""

    def describe(self) -> str:
        return f"copy {self.copy_bytes_per_s / 1e9:.1f} GB/s, matmul {self.matmul_flops_per_s / 1e12:.2f} TFLOP/s ({self.source})"


_measured: dict[tuple[str, torch.dtype], Roofline] = {}
"""Calibrations done in this process, by (device, dtype)."""


def parse_roofline(text: str) -> Roofline:
    """``"<copy GB/s>,<matmul TFLOP/s>"`` -> Roofline; ValueError (naming the variable) otherwise."""
    try:
        gbps, tflops = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"${ROOFLINE_ENV}={text!r}: expected '<copy GB/s>,<matmul TFLOP/s>'") from None
    if not (gbps > 0 and tflops > 0):
        raise ValueError(f"${ROOFLINE_ENV}={text!r}: both ceilings must be positive")
    return Roofline(gbps * 1e9, tflops * 1e12, f"${ROOFLINE_ENV}")


def device_seconds(fn: Callable[[], object], device: torch.device, runs: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``runs`` calls of ``fn`` after ``warmup`` untimed ones: CUDA events around
    each call on a CUDA ``device`` (its device time), the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _best_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """The fastest of ``reps`` timed runs of ``fn`` (after one warm-up)."""
    return min(device_seconds(fn, device, reps))


def _copy_seconds(device: torch.device, nbytes: int, reps: int) -> float:
    """Best time of one device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src), device, reps)


def _matmul_seconds(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """Best time of one ``n``×``n``×``n`` matmul in ``dtype``."""
    a = torch.full((n, n), 0.5, device=device, dtype=dtype)
    b = torch.full((n, n), 0.25, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    return _best_seconds(lambda: torch.mm(a, b, out=c), device, reps)


def measure_roofline(device: torch.device, dtype: torch.dtype) -> Roofline:
    """The device's copy bandwidth and matmul peak in ``dtype``, best of a few runs (cached per process;
    ``$DELTASERVE_ROOFLINE`` replaces the measurement). On CUDA: a 1 GiB copy and an 8192² matmul, best
    of 5; on CPU: an 8 MiB copy and a 384² matmul, best of 3 (tens of ms). Frees what it allocated."""
    override = os.environ.get(ROOFLINE_ENV)
    if override:
        roofline = parse_roofline(override)
        log.info("roofline: %s", roofline.describe())
        return roofline
    key = (str(device), dtype)
    if key in _measured:
        return _measured[key]
    cuda = device.type == "cuda"
    reps = 5 if cuda else 3
    started = time.perf_counter()
    copy_bytes = (1 << 30) if cuda else (8 << 20)
    copy_s = _copy_seconds(device, copy_bytes, reps)
    n = 8192 if cuda else 384
    matmul_s = _matmul_seconds(device, dtype, n, reps)
    if cuda:
        torch.cuda.empty_cache()
    roofline = Roofline(2 * copy_bytes / copy_s, 2 * n**3 / matmul_s, f"measured on {device} in {dtype}")
    _measured[key] = roofline
    log.info("roofline: %s in %.0f ms", roofline.describe(), (time.perf_counter() - started) * 1e3)
    return roofline


@dataclass(frozen=True)
class ModelCosts:
    """What one step of the base model reads and computes, per unit of work."""

    weight_bytes: int
    """Every parameter's bytes (a tied embedding once): read once per step."""
    block_linear_params: int
    """Parameters of the linears every token passes through (matrices outside the embedding and lm_head)."""
    head_params: int
    """lm_head's parameters: computed for the logits rows only."""
    kv_bytes_per_token: int
    """K and V of one token over all layers."""
    attn_flops_per_pair: int
    """FLOPs of one (query, key) pair over all layers and heads: QKᵀ and PV, 2·head_dim each."""

    @classmethod
    def of_model(cls, model: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> ModelCosts:
        """The costs of a loaded model (call before variant wrappers are attached)."""
        params = list(model.parameters())
        embeds = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        heads = {id(m.weight) for name, m in model.named_modules() if name.endswith("lm_head")}
        matrices = [p for p in params if p.dim() >= 2 and id(p) not in embeds and id(p) not in heads]
        return cls(
            weight_bytes=sum(p.numel() * p.element_size() for p in params),
            block_linear_params=sum(p.numel() for p in matrices),
            head_params=cfg.vocab_size * cfg.hidden_size,
            kv_bytes_per_token=2
            * cfg.num_layers
            * cfg.num_kv_heads
            * cfg.head_dim
            * torch.empty((), dtype=dtype).element_size(),
            attn_flops_per_pair=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
        )


@dataclass(frozen=True)
class StepRun:
    """One scheduled request as the floor sees it."""

    variant_id: int
    """Its variant (0: the base alone)."""
    computed: int
    """Tokens already in the KV cache before the step."""
    tokens: int
    """Tokens the step computes for it."""
    logits: bool
    """Whether it wants a logits row (samples a token)."""


@dataclass(frozen=True)
class StepFloor:
    """A step's bytes, FLOPs and the floor they give."""

    bytes: int
    flops: int
    floor_s: float

    @property
    def floor_us(self) -> int:
        """The floor in whole microseconds, rounded up (a non-empty step's floor is at least 1)."""
        return math.ceil(self.floor_s * 1e6)


def causal_pairs(computed: int, tokens: int) -> int:
    """(query, key) pairs of a chunk of ``tokens`` after ``computed`` cached ones (causal)."""
    return tokens * computed + tokens * (tokens + 1) // 2


def step_floor(
    costs: ModelCosts, roofline: Roofline, runs: Sequence[StepRun], variants: Mapping[int, VariantCost]
) -> StepFloor:
    """The floor of a step running ``runs``; ``variants`` holds the cost of each non-zero variant id
    in them that the device reads (an id missing from it, e.g. one whose LoRA runs on the CPU helpers
    this step, costs nothing). An empty step's floor is 0."""
    if not runs:
        return StepFloor(0, 0, 0.0)
    tokens = sum(r.tokens for r in runs)
    logits_rows = sum(1 for r in runs if r.logits)
    kv_bytes = sum(r.computed + r.tokens for r in runs) * costs.kv_bytes_per_token
    pairs = sum(causal_pairs(r.computed, r.tokens) for r in runs)
    flops = 2 * costs.block_linear_params * tokens + 2 * costs.head_params * logits_rows
    flops += costs.attn_flops_per_pair * pairs
    variant_tokens: dict[int, int] = {}
    for r in runs:
        if r.variant_id != 0:
            variant_tokens[r.variant_id] = variant_tokens.get(r.variant_id, 0) + r.tokens
    variant_bytes = 0
    shared: dict[object, int] = {}
    for v, v_tokens in variant_tokens.items():
        cost = variants.get(v)
        if cost is None:
            continue
        variant_bytes += cost.read_bytes
        shared.update(cost.shared)
        flops += cost.flops_per_token * v_tokens
    variant_bytes += sum(shared.values())
    nbytes = costs.weight_bytes + kv_bytes + variant_bytes
    floor_s = max(nbytes / roofline.copy_bytes_per_s, flops / roofline.matmul_flops_per_s)
    return StepFloor(nbytes, flops, floor_s)


def scheduled_floor(
    costs: ModelCosts,
    roofline: Roofline,
    scheduled: Sequence[tuple[RequestState, int]],
    pools: Mapping[VariantKind, VariantPool],
) -> StepFloor:
    """The floor of the step the executor is about to launch: ``scheduled`` as ``requests.admit`` returns
    it (requests not yet advanced by the step), variant costs from the pools that hold them."""
    runs = [
        StepRun(s.variant_id, s.num_computed, n, s.num_computed + n == len(s.token_ids) + s.pending)
        for s, n in scheduled
    ]
    variants: dict[int, VariantCost] = {}
    for v in {r.variant_id for r in runs if r.variant_id != 0}:
        for pool in pools.values():
            cost = pool.step_cost(v)
            if cost is not None:
                variants[v] = cost
    return step_floor(costs, roofline, runs, variants)


__all__ = [
    "ROOFLINE_ENV",
    "ModelCosts",
    "Roofline",
    "StepFloor",
    "StepRun",
    "causal_pairs",
    "measure_roofline",
    "parse_roofline",
    "scheduled_floor",
    "step_floor",
]
