"""SGMV (prefill): the LoRA shrink and expand over segments, one program per token tile with an adapter.

The grid runs over ``LoraMeta.tiles`` (``SGMV_TILE`` tokens of one segment each), times rank tiles
(shrink) or output column tiles (expand), times the slices of a stack. The kernels use ``tl.dot`` on
[16+, 16+] tiles (Tensor Cores on the GPU). Compute is never padded to the largest rank in the batch:
every program loops to (in tiles of BLOCK_R) its own adapter's rank, and shrink programs whose rank
tile lies past the rank exit at once. Under the interpreter the tiles are fp32 (its low-precision
dot is wrong); fp32 inputs use IEEE precision, not TF32. Launch configs: configs/launch.json.

Stacked (one module, n slices)::

    shrink grid (token tiles, n_slices * rank tiles) -> v [n_slices, T, r_max]
    expand grid (token tiles, n_slices * column tiles of the widest slice); a tile past its slice's
    width (GQA k / v next to q) or a slice of rank 0 for the segment's adapter exits at once
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import needs_rne_by_hand, read_launch_configs, round_to
from .layout import LoraStack, LoraWeights
from .meta import SGMV_TILE, LoraMeta
from .tables import LaunchTables, align

_SHRINK = read_launch_configs(__file__)["sgmv_shrink"]
"""SGMV shrink launch: BLOCK_R rank rows per tile, BLOCK_K input columns per reduction step, num_warps."""
_EXPAND = read_launch_configs(__file__)["sgmv_expand"]
"""SGMV expand launch: BLOCK_R rank rows per step of the rank loop, BLOCK_N output columns per program."""


@triton.jit
def _row_offsets(off_row_ptr, rs, r_ok, ALIGN: tl.constexpr):
    """int64 element offsets of rank rows ``rs`` (0 where masked), with the alignment promise."""
    off = tl.load(off_row_ptr + rs, mask=r_ok, other=0)
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return off


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    v_ptr,
    seg_start_ptr,
    seg_adapter_ptr,
    tiles_ptr,
    a_off_ptr,
    rank_ptr,
    K,
    R_MAX,
    R_TILES,
    x_stride,
    v_slice_stride,
    v_stride,
    off_slice_stride,
    off_stride,
    rank_slice_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE: tl.constexpr,
):
    """Program (token tile, slice * R_TILES + r tile): ``v[slice, rows, r tile] = x[rows] A^T``, the
    tile's (segment, first row) from ``tiles_ptr``."""
    seg = tl.load(tiles_ptr + 2 * tl.program_id(0))
    m0 = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    sl = tl.program_id(1) // R_TILES
    adapter = tl.load(seg_adapter_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    rank = tl.minimum(tl.load(rank_ptr + sl * rank_slice_stride + tl.maximum(adapter, 0)), R_MAX)
    r0 = (tl.program_id(1) % R_TILES) * BLOCK_R
    if (adapter < 0 or m0 >= end) or r0 >= rank:  # pairs: triton 3.6 refuses chained and/or
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rs = r0 + tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    off_row = a_off_ptr + sl.to(tl.int64) * off_slice_stride + adapter.to(tl.int64) * off_stride
    off = _row_offsets(off_row, rs, r_ok, ALIGN)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    a_rows = a_ptr + off[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 tiles everywhere there
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)
    ty = v_ptr.dtype.element_ty
    v_ptrs = v_ptr + sl.to(tl.int64) * v_slice_stride + rows.to(tl.int64)[:, None] * v_stride + rs[None, :]
    tl.store(v_ptrs, round_to(acc, ty, RNE).to(ty), mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _sgmv_expand_kernel(
    v_ptr,
    b_ptr,
    out_ptr,
    seg_start_ptr,
    seg_adapter_ptr,
    tiles_ptr,
    b_off_ptr,
    rank_ptr,
    scale_ptr,
    dims_ptr,
    cols_ptr,
    N,
    R_MAX,
    N_TILES,
    v_slice_stride,
    v_stride,
    out_stride,
    off_slice_stride,
    off_stride,
    rank_slice_stride,
    scale_slice_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE: tl.constexpr,
    STACKED: tl.constexpr,
):
    """Program (token tile, slice * N_TILES + n tile): ``out[rows, slice's n tile] += scale v B^T``,
    the tile's (segment, first row) from ``tiles_ptr``. STACKED: the slice's width and first column
    of out come from ``dims_ptr`` / ``cols_ptr`` (tiles past a narrower slice's width exit at once);
    else one slice of N columns at column 0."""
    seg = tl.load(tiles_ptr + 2 * tl.program_id(0))
    m0 = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    sl = tl.program_id(1) // N_TILES
    adapter = tl.load(seg_adapter_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    if adapter < 0 or m0 >= end:
        return
    n0 = (tl.program_id(1) % N_TILES) * BLOCK_N
    width = N
    col0 = 0
    if STACKED:
        width = tl.load(dims_ptr + sl)
        col0 = tl.load(cols_ptr + sl)
    rank = tl.minimum(tl.load(rank_ptr + sl * rank_slice_stride + adapter), R_MAX)
    if n0 >= width or rank <= 0:  # past this slice's columns, or the slice not adapted by this adapter
        return
    scale = tl.load(scale_ptr + sl * scale_slice_stride + adapter)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < width
    v_rows = v_ptr + sl.to(tl.int64) * v_slice_stride + rows.to(tl.int64)[:, None] * v_stride
    off_row = b_off_ptr + sl.to(tl.int64) * off_slice_stride + adapter.to(tl.int64) * off_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # the segment's own rank, in tiles of BLOCK_R
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        off = _row_offsets(off_row, rs, r_ok, ALIGN)
        vt = tl.load(v_rows + rs[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + off[:, None] + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            vt = vt.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(vt, bt, acc, input_precision=DOT_PREC)
    ty = out_ptr.dtype.element_ty
    o_ptrs = out_ptr + col0 + rows.to(tl.int64)[:, None] * out_stride + ns[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + scale * acc, ty, RNE).to(ty), mask=mask)


def _dot_flags(t: torch.Tensor) -> tuple[bool, str]:
    """(UPCAST, DOT_PREC): fp32 tiles under the interpreter; fp32 dots in IEEE precision, not TF32."""
    upcast = not t.is_cuda
    return upcast, "ieee" if upcast or t.dtype == torch.float32 else "tf32"


def sgmv_shrink(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, v: torch.Tensor) -> None:
    """Launches the SGMV shrink into ``v`` ([T, r_max] for one slice, [n_slices, T, r_max] stacked),
    grid (token tiles with an adapter, n_slices * rank tiles)."""
    if not meta.num_tiles:
        return
    tab = LaunchTables.of(w)
    upcast, prec = _dot_flags(x)
    r_tiles = triton.cdiv(w.r_max, _SHRINK["BLOCK_R"])
    vs = v if v.dim() == 3 else v[None]
    grid = (meta.num_tiles, tab.n * r_tiles)
    _sgmv_shrink_kernel[grid](
        x,
        w.a_pool,
        vs,
        meta.seg_start,
        meta.seg_adapter,
        meta.tiles,
        tab.a_off,
        tab.rank,
        w.in_dim,
        w.r_max,
        r_tiles,
        x.stride(0),
        vs.stride(0),
        vs.stride(1),
        tab.a_off_slice,
        tab.a_off_row,
        tab.rank_slice,
        BLOCK_M=SGMV_TILE,
        BLOCK_R=_SHRINK["BLOCK_R"],
        BLOCK_K=_SHRINK["BLOCK_K"],
        ALIGN=align(w, w.a_pool),
        UPCAST=upcast,
        DOT_PREC=prec,
        RNE=needs_rne_by_hand(v),
        num_warps=_SHRINK["num_warps"],
    )


def sgmv_expand(v: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, out: torch.Tensor) -> None:
    """Launches the SGMV expand from ``v`` (as ``sgmv_shrink`` writes it) into ``out`` (the slice's
    columns, or the whole output for a stack), grid (token tiles with an adapter, n_slices * column
    tiles of the widest slice)."""
    if not meta.num_tiles:
        return
    tab = LaunchTables.of(w)
    upcast, prec = _dot_flags(v)
    n_tiles = triton.cdiv(tab.max_width, _EXPAND["BLOCK_N"])
    vs = v if v.dim() == 3 else v[None]
    grid = (meta.num_tiles, tab.n * n_tiles)
    _sgmv_expand_kernel[grid](
        vs,
        w.b_pool,
        out,
        meta.seg_start,
        meta.seg_adapter,
        meta.tiles,
        tab.b_off,
        tab.rank,
        tab.scale,
        tab.dims,
        tab.cols,
        tab.max_width,
        w.r_max,
        n_tiles,
        vs.stride(0),
        vs.stride(1),
        out.stride(0),
        tab.b_off_slice,
        tab.b_off_row,
        tab.rank_slice,
        tab.scale_slice,
        BLOCK_M=SGMV_TILE,
        BLOCK_R=_EXPAND["BLOCK_R"],
        BLOCK_N=_EXPAND["BLOCK_N"],
        ALIGN=align(w, w.b_pool),
        UPCAST=upcast,
        DOT_PREC=prec,
        RNE=needs_rne_by_hand(out),
        STACKED=tab.stacked,
        num_warps=_EXPAND["num_warps"],
    )
