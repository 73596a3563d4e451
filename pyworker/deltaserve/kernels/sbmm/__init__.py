"""SBMM: the compressed full-fine-tune deltas of one linear for every token of a step, in one launch.

DeltaZip's decoupled forward (§5.1-5.2): an adapted linear computes ``y = x W_base^T`` once for the
whole batch, then adds each token's delta ``x Δ̃_d^T``, where ``Δ̃_d`` is the packed 2/4-bit,
optionally 2:4-sparse delta of the token's variant ``d`` (``deltaserve.formats.packed_delta``: THE
format and THE reference value ``dequantize``). ``W_base + Δ̃`` is never materialised: the kernels
stream the packed words, dequantise and expand 2:4 in registers, and multiply.

The package::

    layout.py       DeltaWeights: one linear's delta pool (slots in flat buffers); make_delta_weights
    repack.py       the repacked (fragment-order) slot layout the CUDA op reads: repack, unpack, fits
    repack_triton.py  repack / unpack in one Triton launch per linear (on CUDA; repack.py's torch code is its reference)
    meta.py         DeltaMeta: which tokens use which slot in one step, cut into work tiles
    checks.py       DTYPES, and what every entry point checks of a call
    ref.py          sbmm_ref: the torch reference, the CPU path
    tiles.py        what the Triton kernels share: a program's work tile, its tokens, a slot's rows
    triton_fma.py   FMA tiles (runs of at most 4 tokens of one delta: decode), split-K
    triton_dot.py   tl.dot tiles (16 or 64 tokens)
    dequant.py      a slot's delta as a dense tensor (by slot, or by offsets on the device); dense prefill
                    segments (one dequantisation + cuBLAS)
    cuda.py         csrc/sbmm.cu through ctypes: sbmm_cuda, sbmm_stacked_cuda, cuda_supports, cuda_split
    configs/launch.json   the Triton kernels' tuned launch configs (``LAUNCH``, the dequant kernel's)
    __init__.py     the entry points (below), ``launch_config``

Semantics::

    for each token t of a segment with slot d >= 0:
        D = dequantize(packed(d), dtype=x.dtype)           # [out, in]; packed_delta.py, rounded to x's dtype
        out[t, :] = dtype(out[t, :] + sum_k x[t, k] * D[:, k])   # fp32 accumulation, one rounding
    tokens with slot -1 keep out unchanged

Shape:
    x:        [T, in]          float32 / float16 / bfloat16, last dim contiguous (copied otherwise)
    out:      [T, out_width]   dtype of x, last dim contiguous, updated in place; out_width = out
    seg_start: [S + 1] int32;  seg_delta: [S] int32 (decode: S = T)
    pool tensors: 1-D (layout.py); offsets [num_slots] int64

Entry point ``sbmm`` runs, on CUDA tensors, the CUDA op where it is built and fits the call, else the
Triton kernels (``sbmm_triton``: FMA or tl.dot tiles by ``DeltaMeta.block_m``; ``use_triton=True``
forces Triton; CPU tensors then need ``TRITON_INTERPRET=1``), and ``sbmm_ref`` (a loop over the step's
deltas: dequantize, then one matmul per delta over its tokens; the CPU path) otherwise. ``sbmm_stacked``
is ``sbmm`` over a fused module's slices (columns of one ``out``), in one CUDA launch where the op takes
them all. Metadata is validated when built, weights when built; a call checks shapes and that every
slot it uses holds a delta.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from .. import cuda_ext
from ..common import read_launch_configs, sm_count, want_triton
from .checks import DTYPES, check_call, check_stacked
from .cuda import (
    CUDA_MAX_SLICES,
    cuda_shape_problem,
    cuda_split,
    cuda_supports,
    cuda_tile_cap,
    launch_cuda,
    sbmm_cuda,
    sbmm_stacked_cuda,
)
from .dequant import dense_min_m, dense_segments, dequantize_at, dequantize_slot
from .layout import DeltaWeights, make_delta_weights
from .meta import FMA_MAX_M, DeltaMeta
from .ref import sbmm_ref
from .triton_dot import launch_dot
from .triton_fma import fma_step, launch_fma

__all__ = [
    "DTYPES", "LAUNCH", "DeltaMeta", "DeltaWeights", "FMA_MAX_M", "cuda_shape_problem", "cuda_split", "cuda_supports",
    "cuda_tile_cap", "dense_min_m", "dequantize_at", "dequantize_slot", "launch_config", "launch_cuda", "make_delta_weights",
    "sbmm", "sbmm_cuda", "sbmm_ref", "sbmm_stacked", "sbmm_stacked_cuda", "sbmm_triton",
]  # fmt: skip

LAUNCH = {int(block_m): dict(cfg) for block_m, cfg in read_launch_configs(__file__)["sbmm"].items()}
"""Launch config per BLOCK_M (work-tile tokens), from configs/launch.json (``bench_sbmm.py --tune`` sweeps
them; the file says where each was tuned). BLOCK_K is in input columns, a power of two: >= 32 for tl.dot
tiles (a 2:4 index word covers 32 columns); FMA tiles raise it to one qvalues word and take SPLIT_K (0:
``launch_config`` picks). Module-level so a tuning run can swap it."""
_MIN_WAVES = 2
"""A launch splits K (FMA tiles) or narrows BLOCK_N (tl.dot tiles) until it has this many programs per SM."""


def launch_config(meta: DeltaMeta, w: DeltaWeights) -> dict[str, int]:
    """The launch config of one call: ``LAUNCH[meta.block_m]``, adjusted to the call on CUDA so the launch
    has at least ``_MIN_WAVES`` programs per SM (one or two deltas): FMA tiles split the reduction
    (SPLIT_K 0 = pick: the fewest of 1, 2, 4, 8, 16 splits that fill the SMs, each split >= 2 K tiles),
    tl.dot tiles halve BLOCK_N (down to 16). FMA tiles take BLOCK_K >= one qvalues word."""
    cfg = dict(LAUNCH[meta.block_m])
    cuda = w.device.type == "cuda"
    want = _MIN_WAVES * sm_count(w.device) if cuda else 0
    if meta.block_m <= FMA_MAX_M:
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], fma_step(w))
        if cfg.get("SPLIT_K", 0) == 0:
            programs = meta.num_tiles * triton.cdiv(w.out_features, cfg["BLOCK_N"])
            k_tiles = triton.cdiv(w.in_features, cfg["BLOCK_K"])
            split = 1
            while cuda and split < 16 and programs * split < want and k_tiles >= 4 * split:
                split *= 2
            cfg["SPLIT_K"] = split
        return cfg
    while cuda and cfg["BLOCK_N"] > 16 and meta.num_tiles * triton.cdiv(w.out_features, cfg["BLOCK_N"]) < want:
        cfg["BLOCK_N"] //= 2
    return cfg


def sbmm_triton(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> torch.Tensor:
    """Triton kernels for ``sbmm`` (no dispatch), in place on ``out``: one launch for all deltas (plus a
    reduction launch when FMA tiles split K). They read the format's layout: over a repacked pool, a
    plain copy of the slots the call uses (``DeltaWeights.plain_copy``: the tests' and forced runs'
    path, not a fast one)."""
    check_call(x, out, w, meta)
    w = w.plain_copy({d for d, _ in meta.slot_tokens} | {d for _, _, d in meta.dense})
    if meta.block_m not in LAUNCH:
        raise ValueError(
            f"sbmm_triton: work tiles of {meta.block_m} tokens (the Triton kernels take "
            f"{', '.join(map(str, sorted(LAUNCH)))}; metadata capped there is the CUDA op's)"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    if meta.dense:
        dense_segments(x, out, w, meta)
    if meta.num_tiles == 0:
        return out
    cfg = launch_config(meta, w)
    if meta.block_m <= FMA_MAX_M:
        return launch_fma(x, out, w, meta, cfg)
    return launch_dot(x, out, w, meta, cfg)


def sbmm(
    x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta, *, use_triton: bool | None = None
) -> torch.Tensor:
    """``out[t] += x[t] @ Δ̃_{slot(t)}^T`` in place for every token with a slot (module docstring);
    returns ``out``. On CUDA the kernels run: csrc/sbmm.cu where it is built and fits the call, else
    Triton (``use_triton=True`` forces Triton); the reference elsewhere."""
    if want_triton("sbmm", x, use_triton):
        lib = cuda_ext.library("sbmm") if use_triton is None else None
        if lib is not None and cuda_supports(x, w, meta) is None:
            check_call(x, out, w, meta)
            return launch_cuda(lib, x, out, [(w, 0)], meta)
        return sbmm_triton(x, out, w, meta)
    return sbmm_ref(x, out, w, meta)


def sbmm_stacked(
    x: torch.Tensor,
    out: torch.Tensor,
    slices: Sequence[tuple[DeltaWeights, int]],
    meta: DeltaMeta,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``sbmm(x, out[:, col : col + w.out_features], w, meta)`` for every ``(w, col)`` of ``slices`` (the
    projections of a fused module: q, k, v or gate, up, each its own pool, same in_features and config),
    in place; returns ``out``. On CUDA, where the op fits every slice, one launch computes them all (up to
    ``CUDA_MAX_SLICES``); otherwise each slice runs as ``sbmm`` does."""
    check_stacked(x, out, slices, meta)
    if want_triton("sbmm", x, use_triton):
        lib = cuda_ext.library("sbmm") if use_triton is None else None
        if (
            lib is not None
            and len(slices) <= CUDA_MAX_SLICES
            and all(cuda_supports(x, w, meta) is None for w, _ in slices)
            and len({w.layout for w, _ in slices}) == 1
        ):
            return launch_cuda(lib, x, out, slices, meta)
    for w, col in slices:
        sbmm(x, out[:, col : col + w.out_features], w, meta, use_triton=use_triton)
    return out
