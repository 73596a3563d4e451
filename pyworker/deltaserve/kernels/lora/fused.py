"""Fused MBGMV (decode): a module's whole LoRA delta, shrink and expand of every slice, in ONE launch.

The split decode path (mbgmv.py) launches a shrink and an expand per module and each row's program
reads its own adapter's weights, so 64 rows of one adapter read that adapter 64 times (from L2).
Here rows are grouped by adapter slot on the device, with no metadata beyond ``row_adapter``
(the static buffer CUDA graphs replay), so the weights of an adapter are read once per block of its
rows::

    grid (slot * row blocks, column chunks of the widest slice, n_slices)
    program (slot, row block, chunk, slice):
        rows = the block's BLOCK_M rows whose adapter is ``slot`` (none: exit after one small load;
               the slot's rank 0 in this slice, or the chunk past the slice's width: exit at once)
        v = round(x[rows] A_slot^T)            full input width, tl.dot, fp32 accumulation
        for each BLOCK_N tile of the chunk:    out[rows, tile] = round(out + scale * v B_slot^T[:, tile])

S-LoRA MBGMV semantics for mixed ranks: every program loops (BLOCK_R rank rows a step) to its own
adapter's rank in its slice; nothing is padded to r_max. The first rank tile of v stays in
registers; rank tiles past it (ranks above BLOCK_R) go through a small float32 scratch the program
writes and reads back itself (``[n_slices, chunks, T, r_max]``, each entry written by exactly one
program: deterministic, no atomics). Each chunk program recomputes v of its rows (they are read from
L2 after the first), the price of one launch instead of two: configs/launch.json's ``fused_decode``
CHUNK_N trades that recompute against parallelism.

The grid depends only on T, the slot count, in_dim and the widths (shapes), never on which rows use
which adapter: CUDA-graph safe, no host sync, no per-step host work. The result equals the reference
(``lora_delta_stacked_ref``) up to the order of the float32 sums, as the split path does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import needs_rne_by_hand, read_launch_configs, round_to
from .layout import LoraStack, LoraWeights
from .meta import LoraMeta
from .tables import LaunchTables, align, col_align

FUSED_LAUNCH: dict[str, int] = read_launch_configs(__file__)["fused_decode"]
"""The fused launch: BLOCK_M rows per block, BLOCK_R rank rows per step, BLOCK_K input columns per
reduction step, BLOCK_N output columns per tile, CHUNK_N columns per program (a multiple of BLOCK_N),
num_warps. Module-level so a tuning run can swap it."""


@triton.jit
def _offsets(off_row_ptr, rs, r_ok, ALIGN: tl.constexpr):
    """int64 element offsets of rank rows ``rs`` of one adapter (0 where masked), with the alignment promise."""
    off = tl.load(off_row_ptr + rs, mask=r_ok, other=0)
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return off


@triton.jit
def _shrink(x_rows, mine, a_ptr, off, r_ok, K, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_R] float32: the rows' x times the rank rows at ``off`` of A, over all K columns."""
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x_rows + ks[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + off[None, :] + ks[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's low-precision dot is wrong; fp32 tiles there
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _expand(v, b_ptr, off, r_ok, ns, n_ok, ty: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32: v (one rank tile, already rounded to ``ty``) times the B^T rows at ``off``."""
    bt = tl.load(b_ptr + off[:, None] + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    if UPCAST:
        return tl.dot(v, bt.to(tl.float32), input_precision=DOT_PREC)
    return tl.dot(v.to(ty), bt, input_precision=DOT_PREC)


@triton.jit
def _add_tile(o_rows, ns, mask, scale, acc, ty: tl.constexpr, RNE: tl.constexpr):
    """``out[rows, ns] = round(out + scale * acc)`` where ``mask``."""
    o_ptrs = o_rows + ns[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + scale * acc, ty, RNE).to(ty), mask=mask)


@triton.jit
def _fused_decode_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    v_ptr,
    row_adapter_ptr,
    a_off_ptr,
    b_off_ptr,
    rank_ptr,
    scale_ptr,
    dims_ptr,
    cols_ptr,
    T,
    K,
    N,
    R_MAX,
    ROW_BLOCKS,
    x_stride,
    out_stride,
    v_slice_stride,
    v_chunk_stride,
    v_stride,
    a_off_slice_stride,
    a_off_stride,
    b_off_slice_stride,
    b_off_stride,
    rank_slice_stride,
    scale_slice_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_TILES: tl.constexpr,
    ALIGN_A: tl.constexpr,
    ALIGN_B: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE: tl.constexpr,
    STACKED: tl.constexpr,
    COL_ALIGN: tl.constexpr,
):
    """Program (slot * ROW_BLOCKS + row block, chunk, slice): the module docstring's program.
    STACKED: the slice's width and first column of out from ``dims_ptr`` / ``cols_ptr``; else one
    slice of N columns at column 0 (slice strides 0)."""
    slot = (tl.program_id(0) // ROW_BLOCKS).to(tl.int64)
    m0 = (tl.program_id(0) % ROW_BLOCKS) * BLOCK_M
    chunk = tl.program_id(1)
    sl = tl.program_id(2).to(tl.int64)
    width = N
    col0 = 0
    if STACKED:
        width = tl.multiple_of(tl.load(dims_ptr + sl), COL_ALIGN)  # vector loads and stores of out
        col0 = tl.multiple_of(tl.load(cols_ptr + sl), COL_ALIGN)
    n_start = chunk * (SUB_TILES * BLOCK_N)
    rank = tl.minimum(tl.load(rank_ptr + sl * rank_slice_stride + slot), R_MAX)
    if n_start >= width or rank <= 0:  # past this slice's columns, or the slice not adapted by the slot
        return
    ts = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    mine = tl.load(row_adapter_ptr + ts, mask=ts < T, other=-1).to(tl.int64) == slot
    if tl.max(mine.to(tl.int32), axis=0) == 0:  # no row of this block uses the slot
        return
    scale = tl.load(scale_ptr + sl * scale_slice_stride + slot)
    a_row = a_off_ptr + sl * a_off_slice_stride + slot * a_off_stride
    b_row = b_off_ptr + sl * b_off_slice_stride + slot * b_off_stride
    ty = out_ptr.dtype.element_ty
    x_rows = x_ptr + ts[:, None] * x_stride
    v_rows = v_ptr + sl * v_slice_stride + chunk.to(tl.int64) * v_chunk_stride + ts[:, None] * v_stride
    rs0 = tl.arange(0, BLOCK_R)
    r0_ok = rs0 < rank
    a_off0 = _offsets(a_row, rs0, r0_ok, ALIGN_A)
    b_off0 = _offsets(b_row, rs0, r0_ok, ALIGN_B)
    v0 = round_to(_shrink(x_rows, mine, a_ptr, a_off0, r0_ok, K, BLOCK_M, BLOCK_R, BLOCK_K, UPCAST, DOT_PREC), ty, RNE)
    for r0 in range(BLOCK_R, rank, BLOCK_R):  # rank tiles past the first: into the scratch
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        off = _offsets(a_row, rs, r_ok, ALIGN_A)
        vt = round_to(_shrink(x_rows, mine, a_ptr, off, r_ok, K, BLOCK_M, BLOCK_R, BLOCK_K, UPCAST, DOT_PREC), ty, RNE)
        tl.store(v_rows + rs[None, :], vt, mask=mine[:, None] & r_ok[None, :])
    o_rows = out_ptr + col0 + ts[:, None] * out_stride
    n_end = tl.minimum(n_start + SUB_TILES * BLOCK_N, width)
    if rank <= BLOCK_R:  # one rank tile (the common case): a flat loop the compiler can pipeline
        for n0 in range(n_start, n_end, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            n_ok = ns < width
            acc = _expand(v0, b_ptr, b_off0, r0_ok, ns, n_ok, ty, UPCAST, DOT_PREC)
            _add_tile(o_rows, ns, mine[:, None] & n_ok[None, :], scale, acc, ty, RNE)
    else:
        tl.debug_barrier()  # the scratch rows written above are read back by other threads of the program
        for n0 in range(n_start, n_end, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            n_ok = ns < width
            acc = _expand(v0, b_ptr, b_off0, r0_ok, ns, n_ok, ty, UPCAST, DOT_PREC)
            for r0 in range(BLOCK_R, rank, BLOCK_R):
                rs = r0 + tl.arange(0, BLOCK_R)
                r_ok = rs < rank
                vt = tl.load(v_rows + rs[None, :], mask=mine[:, None] & r_ok[None, :], other=0.0)
                acc += _expand(vt, b_ptr, _offsets(b_row, rs, r_ok, ALIGN_B), r_ok, ns, n_ok, ty, UPCAST, DOT_PREC)
            _add_tile(o_rows, ns, mine[:, None] & n_ok[None, :], scale, acc, ty, RNE)


def fused_decode_grid(t: int, w: LoraWeights | LoraStack) -> tuple[int, int, int]:
    """The launch grid for ``t`` rows: (slots * row blocks, column chunks of the widest slice, slices)."""
    tab = LaunchTables.of(w)
    return (
        w.num_adapters * triton.cdiv(t, FUSED_LAUNCH["BLOCK_M"]),
        triton.cdiv(tab.max_width, FUSED_LAUNCH["CHUNK_N"]),
        tab.n,
    )


def fused_decode(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, out: torch.Tensor) -> None:
    """Launches the fused decode kernel (after the entry point's checks): adds every slice's delta of
    ``x`` into ``out`` (the slice's columns for a ``LoraWeights``, the whole output for a stack)."""
    t = x.shape[0]
    if t == 0:
        return
    cfg = FUSED_LAUNCH
    bn, chunk = cfg["BLOCK_N"], cfg["CHUNK_N"]
    if chunk % bn:
        raise ValueError(f"lora: fused_decode CHUNK_N {chunk} is not a multiple of BLOCK_N {bn}")
    tab = LaunchTables.of(w)
    grid = fused_decode_grid(t, w)
    if w.r_max > cfg["BLOCK_R"]:
        v = torch.empty(tab.n, grid[1], t, w.r_max, dtype=torch.float32, device=x.device)
    else:  # one rank tile: the scratch is never touched
        v = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=x.device)
    upcast = not x.is_cuda
    _fused_decode_kernel[grid](
        x,
        w.a_pool,
        w.b_pool,
        out,
        v,
        meta.seg_adapter,
        tab.a_off,
        tab.b_off,
        tab.rank,
        tab.scale,
        tab.dims,
        tab.cols,
        t,
        w.in_dim,
        tab.max_width,
        w.r_max,
        triton.cdiv(t, cfg["BLOCK_M"]),
        x.stride(0),
        out.stride(0),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        tab.a_off_slice,
        tab.a_off_row,
        tab.b_off_slice,
        tab.b_off_row,
        tab.rank_slice,
        tab.scale_slice,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_R=cfg["BLOCK_R"],
        BLOCK_K=cfg["BLOCK_K"],
        BLOCK_N=bn,
        SUB_TILES=chunk // bn,
        ALIGN_A=align(w, w.a_pool),
        ALIGN_B=align(w, w.b_pool),
        UPCAST=upcast,
        DOT_PREC="ieee" if upcast or x.dtype == torch.float32 else "tf32",
        RNE=needs_rne_by_hand(out),
        STACKED=tab.stacked,
        COL_ALIGN=col_align(tab, out),
        num_warps=cfg["num_warps"],
    )
