"""MBGMV (decode): the LoRA shrink and expand over rows of any adapters, bandwidth kernels (no ``tl.dot``).

Compute follows the sum of the rows' ranks (S-LoRA's MBGMV), not batch x max rank (BGMV): every
program loops to its rows' own ranks. The shrink splits each row's input columns over programs
(program (row block, s) writes float32 partial sums of columns s*BLOCK_K.. for all of its rows' rank
rows; no atomics, so results are deterministic) and the expand, tiled over output columns, sums a
row's partials in a fixed order, rounds v to the activation dtype and applies it (``lora_delta``: two
launches, no zero fill). ``lora_shrink`` at decode finishes v with a third small kernel summing the
same partials (``mbgmv_shrink``), so the fused path and shrink-then-expand agree up to the order of
that float32 sum. A program takes BLOCK_T consecutive rows (``MB_SHRINK_LAUNCH`` /
``MB_EXPAND_LAUNCH``, by step size); it is latency-bound (its weight rows are found through two table
lookups), so each kernel issues its loads in three dependent rounds (adapters and x / out / partials;
ranks and the first rank tile's offsets; the weight rows) and the tuned launches favour many small
one-warp programs.

Stacked (one module, n slices; each kernel is the per-slice one with a slice grid axis)::

    shrink grid (row blocks, SPLIT, n_slices) -> float32 partials [n_slices, SPLIT, T, r_max]
    expand grid (row blocks, tiles of the widest slice, n_slices); a tile past its slice's width
    (GQA k / v next to q) or a slice of rank 0 for the row's adapter exits at once

The grids depend only on T, in_dim, r_max, n_slices and the widest slice (shapes), never on the
tables: the slices' widths and first columns come from small static device tensors (CUDA graphs).

Mixed steps (``LoraMeta.mixed``): the kernels run over the meta's row list instead of every token
(GATHER): MBGMV row i is token ``rows[i]`` of x / out / v, with adapter ``row_adapter[i]``, and the
partials are indexed by i. Every row's program computes what it computes in a decode step of the
same launch; the launch is the any-size entry of each table whatever R, so an eager mixed step (R =
its rows) and a replayed one (R = the graph's static bound, padding rows of -1) agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import needs_rne_by_hand, read_launch_configs, round_to
from .layout import LoraStack, LoraWeights
from .meta import LoraMeta
from .tables import LaunchTables, align, col_align


def _launch_table(entries: list[dict], width: str) -> tuple[tuple[int, tuple[int, int, int, int]], ...]:
    """A configs/launch.json MBGMV table as ``(up to T tokens, (BLOCK_T, BLOCK_R, <width>, num_warps))``
    entries; ``max_tokens`` null: any step size."""
    return tuple(
        (
            1 << 30 if e["max_tokens"] is None else e["max_tokens"],
            (e["BLOCK_T"], e["BLOCK_R"], e[width], e["num_warps"]),
        )
        for e in entries
    )


_CONFIGS = read_launch_configs(__file__)
MB_SHRINK_LAUNCH: tuple[tuple[int, tuple[int, int, int, int]], ...] = _launch_table(_CONFIGS["mbgmv_shrink"], "BLOCK_K")
"""MBGMV shrink launch by step size: ``(up to T tokens, (BLOCK_T, BLOCK_R, BLOCK_K, num_warps))``,
the first entry whose bound holds, from configs/launch.json (which says how it was tuned). Shape-only
(CUDA-graph safe). Module-level so a tuning run can swap it."""
MB_EXPAND_LAUNCH: tuple[tuple[int, tuple[int, int, int, int]], ...] = _launch_table(_CONFIGS["mbgmv_expand"], "BLOCK_N")
"""MBGMV expand launch by step size: ``(up to T tokens, (BLOCK_T, BLOCK_R, BLOCK_N, num_warps))``, as
``MB_SHRINK_LAUNCH``."""
_FINISH = _CONFIGS["mbgmv_finish"]
"""MBGMV finish (``lora_shrink`` at decode): BLOCK_R rank columns per program, num_warps."""


@triton.jit
def _block_row_offsets(off_rows, rs, r_ok, ALIGN: tl.constexpr):
    """``_row_offsets`` for a row block: [BLOCK_T, BLOCK_R] offsets of rank rows ``rs`` of each
    row's adapter, ``off_rows`` [BLOCK_T] pointing at the adapters' rows of the offsets table."""
    off = tl.load(off_rows[:, None] + rs[None, :], mask=r_ok, other=0)
    if ALIGN > 1:
        off = tl.multiple_of(off, [ALIGN, ALIGN])
    return off


@triton.jit
def _block_rows(row_adapter_ptr, rows_ptr, T, BLOCK_T: tl.constexpr, GATHER: tl.constexpr):
    """This program's row block (axis 0): its rows ``ts`` (int64; the partials' index), their token
    rows ``tok`` (of x / out / v: ``rows_ptr[ts]`` when GATHER, else ``ts``), which exist
    (``t_ok``), which have an adapter (``has``) and their adapter slots (0 where none). One
    dependent load."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = ts < T
    ts = ts.to(tl.int64)
    adapter = tl.load(row_adapter_ptr + ts, mask=t_ok, other=-1)
    tok = ts
    if GATHER:
        tok = tl.load(rows_ptr + ts, mask=t_ok, other=0).to(tl.int64)
    return ts, tok, t_ok, adapter >= 0, tl.maximum(adapter, 0).to(tl.int64)


@triton.jit
def _block_ranks(slot, has, rank_ptr, R_MAX):
    """Each row's rank in the slice whose rank table starts at ``rank_ptr`` (0: no adapter, or the
    slice not adapted by it)."""
    return tl.where(has, tl.minimum(tl.load(rank_ptr + slot, mask=has, other=0), R_MAX), 0)


@triton.jit
def _shrink_rank_tile(a_ptr, off, xk, ks, k_ok, rs, r_ok, p_rows):
    """One rank tile of a row block's shrink: the A rows [BLOCK_T, BLOCK_R, BLOCK_K] at ``off``
    times the rows' x columns ``xk``, summed over the columns into the partials at ``p_rows``."""
    at = tl.load(a_ptr + off[:, :, None] + ks[None, None, :], mask=r_ok[:, :, None] & k_ok[None, None, :], other=0.0)
    tl.store(p_rows[:, None] + rs[None, :], tl.sum(at.to(tl.float32) * xk[:, None, :], axis=2), mask=r_ok)


@triton.jit
def _mbgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    part_ptr,
    row_adapter_ptr,
    rows_ptr,
    a_off_ptr,
    rank_ptr,
    T,
    K,
    R_MAX,
    x_stride,
    part_slice_stride,
    part_split_stride,
    part_stride,
    off_slice_stride,
    off_stride,
    rank_slice_stride,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGN: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Program (row block, s, slice): for each of the block's BLOCK_T rows, its partial dot products
    over input columns s*BLOCK_K .. +BLOCK_K for every rank row up to the row's own rank in that
    slice, into ``part[slice, s, t, :rank]`` (float32, no atomics). One slice: slice strides 0,
    grid (row blocks, SPLIT, 1).

    Latency, not bytes, bounds these small programs, so the dependent loads are kept to three
    rounds: the rows' adapters and x; then their ranks and the first rank tile's offsets (loaded
    before the rank is known: the offsets table is r_max wide); then the A rows, as one
    [BLOCK_T, BLOCK_R, BLOCK_K] gather. Rank tiles past the first (ranks above BLOCK_R) loop after."""
    s = tl.program_id(1)
    sl = tl.program_id(2).to(tl.int64)
    ts, tok, t_ok, has, slot = _block_rows(row_adapter_ptr, rows_ptr, T, BLOCK_T, GATHER)
    ks = s * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    xk = tl.load(x_ptr + tok[:, None] * x_stride + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(
        tl.float32
    )
    off_rows = a_off_ptr + sl * off_slice_stride + slot * off_stride
    rs = tl.arange(0, BLOCK_R)
    off = _block_row_offsets(off_rows, rs, has[:, None] & (rs < R_MAX)[None, :], ALIGN)
    rank = _block_ranks(slot, has, rank_ptr + sl * rank_slice_stride, R_MAX)
    top = tl.max(rank, axis=0)
    if top <= 0:
        return
    p_rows = part_ptr + sl * part_slice_stride + s.to(tl.int64) * part_split_stride + ts * part_stride
    _shrink_rank_tile(a_ptr, off, xk, ks, k_ok, rs, rs[None, :] < rank[:, None], p_rows)
    for r0 in range(BLOCK_R, top, BLOCK_R):  # the block's largest rank; each row masked to its own
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs[None, :] < rank[:, None]
        _shrink_rank_tile(a_ptr, _block_row_offsets(off_rows, rs, r_ok, ALIGN), xk, ks, k_ok, rs, r_ok, p_rows)


@triton.jit
def _expand_rank_tile(b_ptr, off, parts, r_ok, ns, o_mask, ty: tl.constexpr, RNE: tl.constexpr):
    """One rank tile's share of a row block's expand: v = round(sum of the tile's partials) (as
    ``lora_shrink`` rounds it; partials past a row's rank are ignored, they were never written),
    times the B rows [BLOCK_T, BLOCK_R, BLOCK_N], summed over the tile's rank rows."""
    vr = round_to(tl.sum(tl.where(r_ok[None, :, :], parts.to(tl.float32), 0.0), axis=0), ty, RNE)
    bt = tl.load(b_ptr + off[:, :, None] + ns[None, None, :], mask=r_ok[:, :, None] & o_mask[:, None, :], other=0.0)
    return tl.sum(vr[:, :, None] * bt.to(tl.float32), axis=1)


@triton.jit
def _mbgmv_expand_kernel(
    v_ptr,
    b_ptr,
    out_ptr,
    row_adapter_ptr,
    rows_ptr,
    b_off_ptr,
    rank_ptr,
    scale_ptr,
    dims_ptr,
    cols_ptr,
    T,
    N,
    R_MAX,
    SPLIT,
    v_slice_stride,
    v_split_stride,
    v_stride,
    out_stride,
    off_slice_stride,
    off_stride,
    rank_slice_stride,
    scale_slice_stride,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ALIGN: tl.constexpr,
    RNE: tl.constexpr,
    STACKED: tl.constexpr,
    COL_ALIGN: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Program (row block, n, slice): for each of the block's BLOCK_T rows t,
    ``out[t, n tile] += scale * round(sum_s v[s, t, :rank]) B^T[:rank, n tile]``.

    STACKED: the slice's width and first column of out come from ``dims_ptr`` / ``cols_ptr`` and the
    grid covers the widest slice (tiles past a narrower slice's width exit at once); else one slice
    of N columns at column 0 (slice strides 0, grid (row blocks, tiles, 1)).

    ``v`` is either the shrink's float32 partials (SPLIT of them, summed in a fixed order: the result
    is deterministic) or a finished v in the out dtype (SPLIT = 1; the rounding is then exact).
    Three rounds of dependent loads, as in the shrink: the rows' adapters, out tile and first rank
    tile's partials; their ranks, scales and first rank tile's offsets; the B rows, one
    [BLOCK_T, BLOCK_R, BLOCK_N] gather. Rank tiles past the first loop after."""
    sl = tl.program_id(2).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    width = N
    col0 = 0
    if STACKED:
        width = tl.multiple_of(tl.load(dims_ptr + sl), COL_ALIGN)  # vector loads and stores of out
        col0 = tl.multiple_of(tl.load(cols_ptr + sl), COL_ALIGN)
    if n0 >= width:
        return
    ts, tok, t_ok, has, slot = _block_rows(row_adapter_ptr, rows_ptr, T, BLOCK_T, GATHER)
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < width
    o_ptrs = out_ptr + col0 + tok[:, None] * out_stride + ns[None, :]
    o = tl.load(o_ptrs, mask=t_ok[:, None] & n_ok[None, :], other=0.0)
    ss = tl.arange(0, BLOCK_S)
    s_ok = ss < SPLIT
    v_rows = v_ptr + sl * v_slice_stride + ss.to(tl.int64)[:, None] * v_split_stride + ts[None, :] * v_stride
    rs = tl.arange(0, BLOCK_R)
    parts = tl.load(
        v_rows[:, :, None] + rs[None, None, :],
        mask=s_ok[:, None, None] & t_ok[None, :, None] & (rs < R_MAX)[None, None, :],
        other=0.0,
    )
    off_rows = b_off_ptr + sl * off_slice_stride + slot * off_stride
    off = _block_row_offsets(off_rows, rs, has[:, None] & (rs < R_MAX)[None, :], ALIGN)
    rank = _block_ranks(slot, has, rank_ptr + sl * rank_slice_stride, R_MAX)
    scale = tl.load(scale_ptr + sl * scale_slice_stride + slot, mask=has, other=0.0)
    top = tl.max(rank, axis=0)
    if top <= 0:  # no row of the block is adapted in this slice: out stays as it is
        return
    ty = out_ptr.dtype.element_ty
    o_mask = (rank > 0)[:, None] & n_ok[None, :]
    acc = _expand_rank_tile(b_ptr, off, parts, rs[None, :] < rank[:, None], ns, o_mask, ty, RNE)
    for r0 in range(BLOCK_R, top, BLOCK_R):  # the block's largest rank; each row masked to its own
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs[None, :] < rank[:, None]
        parts = tl.load(v_rows[:, :, None] + rs[None, None, :], mask=s_ok[:, None, None] & r_ok[None, :, :], other=0.0)
        off = _block_row_offsets(off_rows, rs, r_ok, ALIGN)
        acc += _expand_rank_tile(b_ptr, off, parts, r_ok, ns, o_mask, ty, RNE)
    tl.store(o_ptrs, round_to(o.to(tl.float32) + scale[:, None] * acc, ty, RNE).to(ty), mask=o_mask)


@triton.jit
def _mbgmv_finish_kernel(
    part_ptr,
    v_ptr,
    row_adapter_ptr,
    rows_ptr,
    rank_ptr,
    R_MAX,
    SPLIT,
    part_split_stride,
    part_stride,
    v_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    RNE: tl.constexpr,
    GATHER: tl.constexpr,
):
    """``v[t, r tile] = round(sum_s part[s, t, r tile])``, 0 past the row's rank and for rows of -1.
    GATHER: into v's row ``rows[t]``, and only for rows with an adapter (padding rows write nothing)."""
    t = tl.program_id(0).to(tl.int64)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    adapter = tl.load(row_adapter_ptr + t)
    rank = tl.where(adapter >= 0, tl.minimum(tl.load(rank_ptr + tl.maximum(adapter, 0)), R_MAX), 0)
    ss = tl.arange(0, BLOCK_S)
    parts = tl.load(
        part_ptr + ss.to(tl.int64)[:, None] * part_split_stride + t * part_stride + rs[None, :],
        mask=(ss < SPLIT)[:, None] & (rs < rank)[None, :],
        other=0.0,
    )
    acc = tl.sum(parts, axis=0)
    ty = v_ptr.dtype.element_ty
    if GATHER:
        tok = tl.load(rows_ptr + t).to(tl.int64)
        tl.store(v_ptr + tok * v_stride + rs, round_to(acc, ty, RNE).to(ty), mask=rs < tl.where(adapter >= 0, R_MAX, 0))
    else:
        tl.store(v_ptr + t * v_stride + rs, round_to(acc, ty, RNE).to(ty), mask=rs < R_MAX)


def _mb_launch(table: tuple[tuple[int, tuple[int, int, int, int]], ...], tokens: int) -> tuple[int, int, int, int]:
    """The launch of ``MB_SHRINK_LAUNCH`` / ``MB_EXPAND_LAUNCH`` for a step of ``tokens`` rows."""
    return next(cfg for bound, cfg in table if tokens <= bound)


def _mb_rows(meta: LoraMeta, tokens: int) -> tuple[int, torch.Tensor, torch.Tensor, bool, int]:
    """(R rows, row_adapter, rows (any int32 tensor when not gathering), GATHER, rows the launch is
    picked for): a decode meta's rows are its tokens; a mixed meta's its row list, launched with the
    any-size entry (module docstring: eager and replayed mixed steps agree)."""
    if meta.rows is None:
        return tokens, meta.seg_adapter, meta.seg_adapter, False, tokens
    assert meta.row_adapter is not None
    return meta.num_rows, meta.row_adapter, meta.rows, True, 1 << 30


def mbgmv_shrink_partials(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta) -> torch.Tensor:
    """Launches the MBGMV shrink, grid (row blocks, SPLIT, n_slices); returns its float32 partials
    [n_slices, SPLIT, T, r_max] (only the entries of rows with an adapter and columns below their
    rank in that slice are written). A ``LoraWeights`` is one slice. Mixed meta: T is R, the meta's
    row list (``num_rows``)."""
    t, row_adapter, rows, gather, launch_rows = _mb_rows(meta, x.shape[0])
    bt, br, bk, warps = _mb_launch(MB_SHRINK_LAUNCH, launch_rows)
    split = triton.cdiv(w.in_dim, bk)
    tab = LaunchTables.of(w)
    part = torch.empty(tab.n, split, t, w.r_max, dtype=torch.float32, device=x.device)
    _mbgmv_shrink_kernel[(triton.cdiv(t, bt), split, tab.n)](
        x,
        w.a_pool,
        part,
        row_adapter,
        rows,
        tab.a_off,
        tab.rank,
        t,
        w.in_dim,
        w.r_max,
        x.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        tab.a_off_slice,
        tab.a_off_row,
        tab.rank_slice,
        BLOCK_T=bt,
        BLOCK_R=br,
        BLOCK_K=bk,
        ALIGN=align(w, w.a_pool),
        GATHER=gather,
        num_warps=warps,
    )
    return part


def mbgmv_expand(v: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, out: torch.Tensor) -> None:
    """Launches the MBGMV expand, grid (row blocks, column tiles of the widest slice, n_slices), over
    ``v`` = partials [n_slices, SPLIT, T, r_max] float32 or a finished [T, r_max] (one slice).
    ``out`` is the slice's columns (``LoraWeights``) or the whole output (``LoraStack``: columns
    from out_offsets). Mixed meta: over its R rows, ``v`` indexed by the row (partials of R rows,
    or a finished [R, r_max])."""
    part = v if v.dim() == 4 else v[None, None]
    tab = LaunchTables.of(w)
    t, row_adapter, rows, gather, launch_rows = _mb_rows(meta, out.shape[0])
    if not t:
        return
    bt, br, bn, warps = _mb_launch(MB_EXPAND_LAUNCH, launch_rows)
    _mbgmv_expand_kernel[(triton.cdiv(t, bt), triton.cdiv(tab.max_width, bn), tab.n)](
        part,
        w.b_pool,
        out,
        row_adapter,
        rows,
        tab.b_off,
        tab.rank,
        tab.scale,
        tab.dims,
        tab.cols,
        t,
        tab.max_width,
        w.r_max,
        part.shape[1],
        part.stride(0),
        part.stride(1),
        part.stride(2),
        out.stride(0),
        tab.b_off_slice,
        tab.b_off_row,
        tab.rank_slice,
        tab.scale_slice,
        BLOCK_T=bt,
        BLOCK_R=br,
        BLOCK_N=bn,
        BLOCK_S=triton.next_power_of_2(part.shape[1]),
        ALIGN=align(w, w.b_pool),
        RNE=needs_rne_by_hand(out),
        STACKED=tab.stacked,
        COL_ALIGN=col_align(tab, out),
        GATHER=gather,
        num_warps=warps,
    )


def mbgmv_shrink(x: torch.Tensor, w: LoraWeights, meta: LoraMeta, v: torch.Tensor | None = None) -> torch.Tensor:
    """``lora_shrink`` at decode (after its checks): the shrink's partials, summed and rounded into
    v [T, r_max] (x's dtype) by ``_mbgmv_finish_kernel``; launched whatever the rows' adapters.
    Mixed meta: into the rows of ``v`` (given: [T, r_max], the SGMV shrink's) its row list names."""
    t, row_adapter, rows, gather, _ = _mb_rows(meta, x.shape[0])
    if v is None:
        v = torch.empty(x.shape[0], w.r_max, dtype=x.dtype, device=x.device)
    if t:
        part = mbgmv_shrink_partials(x, w, meta)[0]
        _mbgmv_finish_kernel[(t, triton.cdiv(w.r_max, _FINISH["BLOCK_R"]))](
            part,
            v,
            row_adapter,
            rows,
            w.rank,
            w.r_max,
            part.shape[0],
            part.stride(0),
            part.stride(1),
            v.stride(0),
            BLOCK_R=_FINISH["BLOCK_R"],
            BLOCK_S=triton.next_power_of_2(part.shape[0]),
            RNE=needs_rne_by_hand(v),
            GATHER=gather,
            num_warps=_FINISH["num_warps"],
        )
    return v
