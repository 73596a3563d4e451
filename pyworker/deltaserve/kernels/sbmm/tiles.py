"""What every SBMM Triton kernel shares (and ``kernels.dense_delta``): a program's work tile, its tokens,
a slot's row pointers, the add into out, and the qindices argument of a pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import round_to
from .layout import DeltaWeights


@triton.jit
def work_tile(tiles_ptr):
    """This program's work tile (axis 0): its delta slot (int64, -1 for padding) and its range of ``order``."""
    tile = tl.program_id(0).to(tl.int64)
    slot = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    return slot, tl.load(tiles_ptr + tile * 3), tl.load(tiles_ptr + tile * 3 + 1)


@triton.jit
def slot_rows(qv_ptr, qi_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, ns, QV_ROW, QI_ROW, NGROUPS):
    """Where rows ``ns`` of delta ``slot`` start: qvalues and qindices row pointers [BN, 1], group offsets [BN]."""
    n64 = ns.to(tl.int64)
    qv_rows = qv_ptr + tl.load(qv_off_ptr + slot) + n64[:, None] * QV_ROW
    qi_rows = qi_ptr + tl.load(qi_off_ptr + slot) + n64[:, None] * QI_ROW
    g_off = tl.load(g_off_ptr + slot) + n64 * NGROUPS
    return qv_rows, qi_rows, g_off


@triton.jit
def tile_tokens(order_ptr, start, end, BLOCK_M: tl.constexpr):
    """A work tile's positions in ``order`` [BM], which are real, and their token indices (int64)."""
    at = start + tl.arange(0, BLOCK_M)
    row_ok = at < end
    rows = tl.load(order_ptr + at, mask=row_ok, other=0).to(tl.int64)
    return at, row_ok, rows


@triton.jit
def add_to_out(o_ptrs, total, mask, RNE: tl.constexpr):
    """out = dtype(out + total) where ``mask``: the op's one rounding of the float32 sum."""
    oty = o_ptrs.dtype.element_ty
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + total, oty, RNE).to(oty), mask=mask)


def qindices_arg(w: DeltaWeights) -> tuple[torch.Tensor, int]:
    """The kernels' qindices buffer and its row width in words; a dense pool passes qvalues and 1 (never read)."""
    qi = w.slot_shapes()[1]
    return (w.qindices, qi[1]) if qi is not None else (w.qvalues, 1)
