"""SGMV (prefill): the LoRA shrink and expand over segments, one program per token tile with an adapter.

The grid runs over ``LoraMeta.tiles`` (``SGMV_TILE`` tokens of one segment each), times rank tiles
(shrink) or output column groups (expand: ``sgmv_col_steps`` column tiles a program), times the
slices of a stack. The kernels use ``tl.dot`` on
[16+, 16+] tiles (Tensor Cores on the GPU). Compute is never padded to the largest rank in the batch:
every program loops to (in tiles of BLOCK_R) its own adapter's rank, and shrink programs whose rank
tile lies past the rank exit at once. Under the interpreter the tiles are fp32 (its low-precision
dot is wrong); fp32 inputs use IEEE precision, not TF32. Launch configs: configs/launch.json.

Stacked (one module, n slices)::

    shrink grid (token tiles, n_slices * rank tiles, SPLIT) -> v [n_slices, T, r_max] (SPLIT = 1)
                                              or float32 partials [n_slices, CHUNKS, T, r_max]
    expand grid (token tiles, n_slices * column groups of the widest slice); a group past its slice's
    width (GQA k / v next to q) or a slice of rank 0 for the segment's adapter exits at once

Split-K (``sgmv_delta_shrink``): a short chunk has a handful of tiles, and each shrink program would loop
over the whole input width (64 steps of BLOCK_K at K = 4096) alone. The input columns are cut into
CHUNKS = cdiv(K, CHUNK_K) fixed chunks; a program of split s computes chunks s, s + SPLIT, ... and
writes each chunk's float32 sum on its own (no atomics), and the expand sums a row's CHUNKS partials
in chunk order, rounds v to the out dtype and applies it. The unsplit shrink (SPLIT = 1, v in the
out dtype) accumulates in the same chunks and adds them in the same order, so **v, and the delta,
are bit for bit the same whatever SPLIT is**: an eager step and its graph bucket may pick different
SPLITs (their tile counts differ) and still agree. ``sgmv_split`` picks SPLIT from shapes only
(CUDA-graph safe): the chunk's tiles (at most cdiv(tokens, SGMV_TILE), the static bound of a graph's
tile list overcounts) times the slices; 1 from ``min_programs_per_sm`` x SMs programs up (the chunk
fills the GPU; no partials), else enough splits to reach that many, at most CHUNKS.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..common import needs_rne_by_hand, read_launch_configs, round_to, sm_count
from .layout import LoraStack, LoraWeights
from .meta import SGMV_TILE, LoraMeta
from .tables import LaunchTables, align, col_align

_SHRINK = read_launch_configs(__file__)["sgmv_shrink"]
"""SGMV shrink launch: BLOCK_R rank rows per tile, BLOCK_K input columns per reduction step, num_warps."""
_EXPAND = read_launch_configs(__file__)["sgmv_expand"]
"""SGMV expand launch: BLOCK_R rank rows per step of the rank loop, BLOCK_N output columns per step of
a program's column loop, at most max_col_steps steps a program (``sgmv_col_steps``), fewer where the
grid would fall below min_programs_per_sm x the SMs."""
SGMV_SPLIT: dict = read_launch_configs(__file__)["sgmv_split"]
"""Split-K of the SGMV shrink (module docstring): CHUNK_K input columns per chunk (a multiple of
BLOCK_K), min_programs_per_sm, max_partials_mb (no split whose partials would take more),
cpu_sms (the SM count assumed off the GPU, for the interpreter)."""


def _check_chunk_k() -> None:
    """The split shrink's chunk sums need whole BLOCK_K steps a chunk (at import, for launch.json, and
    at every launch, for a tuning run that swaps either)."""
    if SGMV_SPLIT["CHUNK_K"] % _SHRINK["BLOCK_K"]:
        raise ValueError(
            f"SGMV shrink: CHUNK_K {SGMV_SPLIT['CHUNK_K']} is not a multiple of BLOCK_K {_SHRINK['BLOCK_K']} "
            "(kernels/lora/configs/launch.json)"
        )


_check_chunk_k()

_FORCED = os.environ.get("DELTASERVE_SGMV_SPLIT", "auto")
"""``auto`` (the rule) or a SPLIT every launch takes (capped at the chunks; 1: never split), for
benchmarks comparing splits (read at import)."""
if _FORCED != "auto" and not (_FORCED.isdigit() and int(_FORCED) >= 1):
    raise ValueError(f"DELTASERVE_SGMV_SPLIT={_FORCED!r}: want auto or a positive integer")
_FORCED_COLS = os.environ.get("DELTASERVE_SGMV_COL_STEPS", "auto")
"""``auto`` (``sgmv_col_steps``) or the column steps every expand program takes (1: one BLOCK_N tile a
program, the layout before the column loop), for benchmarks (read at import)."""
if _FORCED_COLS != "auto" and not (_FORCED_COLS.isdigit() and int(_FORCED_COLS) >= 1):
    raise ValueError(f"DELTASERVE_SGMV_COL_STEPS={_FORCED_COLS!r}: want auto or a positive integer")


@triton.jit
def _row_offsets(off_row_ptr, rs, r_ok, ALIGN: tl.constexpr):
    """int64 element offsets of rank rows ``rs`` (0 where masked), with the alignment promise."""
    off = tl.load(off_row_ptr + rs, mask=r_ok, other=0)
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return off


@triton.jit
def _shrink_step(
    x_rows, a_rows, k0, K, row_ok, r_ok, acc, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr
):
    """One BLOCK_K step of the shrink: ``acc += x[rows, k0 ..] A[rs, k0 ..]^T``."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    at = tl.load(a_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 tiles everywhere there
        xt = xt.to(tl.float32)
        at = at.to(tl.float32)
    return tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)


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
    SPLIT,
    CHUNKS,
    x_stride,
    v_slice_stride,
    v_chunk_stride,
    v_stride,
    off_slice_stride,
    off_stride,
    rank_slice_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
    ALIGN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE: tl.constexpr,
    PARTIALS: tl.constexpr,
):
    """Program (token tile, slice * R_TILES + r tile, s): ``v[slice, rows, r tile] = x[rows] A^T``,
    the tile's (segment, first row) from ``tiles_ptr``, summed over CHUNK_K-column chunks in chunk
    order. PARTIALS: chunks s, s + SPLIT, ... each into its float32 partial
    ``v[slice, chunk, rows, r tile]``; else (SPLIT = 1) the chunks' sum rounded into v (v's dtype)."""
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
    v_ptrs = v_ptr + sl.to(tl.int64) * v_slice_stride + rows.to(tl.int64)[:, None] * v_stride + rs[None, :]
    mask = row_ok[:, None] & r_ok[None, :]
    if PARTIALS:
        for c in range(tl.program_id(2), CHUNKS, SPLIT):
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(c * CHUNK_K, tl.minimum(c * CHUNK_K + CHUNK_K, K), BLOCK_K):
                acc = _shrink_step(x_rows, a_rows, k0, K, row_ok, r_ok, acc, BLOCK_K, UPCAST, DOT_PREC)
            tl.store(v_ptrs + c * v_chunk_stride, acc, mask=mask)
    else:  # one flat loop (pipelined); a chunk's sum joins the total at the chunk's last step
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = _shrink_step(x_rows, a_rows, k0, K, row_ok, r_ok, acc, BLOCK_K, UPCAST, DOT_PREC)
            flush = ((k0 + BLOCK_K) % CHUNK_K == 0) | (k0 + BLOCK_K >= K)
            total = tl.where(flush, total + acc, total)
            acc = tl.where(flush, 0.0, acc)
        ty = v_ptr.dtype.element_ty
        tl.store(v_ptrs, round_to(total, ty, RNE).to(ty), mask=mask)


@triton.jit
def _expand_v(
    v_rows,
    rs,
    v_mask,
    CHUNKS,
    v_chunk_stride,
    out_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RNE: tl.constexpr,
    UPCAST: tl.constexpr,
    PARTIALS: tl.constexpr,
):
    """One rank tile of v for the expand's dot, in out's dtype: v itself, or (PARTIALS) the split
    shrink's float32 partials summed over the CHUNKS in chunk order and rounded, as the unsplit shrink
    stores it; float32 under the interpreter (UPCAST)."""
    if PARTIALS:
        vf = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for c in range(0, CHUNKS):
            vf += tl.load(v_rows + c * v_chunk_stride + rs[None, :], mask=v_mask, other=0.0)
        ty = out_ptr.dtype.element_ty
        vt = round_to(vf, ty, RNE).to(ty)
    else:
        vt = tl.load(v_rows + rs[None, :], mask=v_mask, other=0.0)
    if UPCAST:
        vt = vt.to(tl.float32)
    return vt


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
    N_GROUPS,
    COL_STEPS,
    CHUNKS,
    v_slice_stride,
    v_chunk_stride,
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
    COL_ALIGN: tl.constexpr,
    PARTIALS: tl.constexpr,
):
    """Program (token tile, slice * N_GROUPS + column group): ``out[rows, cols] += scale v B^T`` over
    the group's COL_STEPS tiles of BLOCK_N columns of the slice, the tile's (segment, first row) from
    ``tiles_ptr``. The first rank tile of v (and of B's row offsets) is loaded once for the group;
    ranks past BLOCK_R load theirs per column tile. STACKED: the slice's width and first column of out
    come from ``dims_ptr`` / ``cols_ptr`` (groups past a narrower slice's width exit at once); else
    one slice of N columns at column 0. PARTIALS: ``v`` is the split shrink's float32 partials
    [slice, chunk, T, r_max] (``_expand_v``); else v itself (out's dtype). Every output element is
    the same sum in the same order whatever COL_STEPS is."""
    seg = tl.load(tiles_ptr + 2 * tl.program_id(0))
    m0 = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    sl = tl.program_id(1) // N_GROUPS
    adapter = tl.load(seg_adapter_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    if adapter < 0 or m0 >= end:
        return
    n_first = (tl.program_id(1) % N_GROUPS) * COL_STEPS * BLOCK_N
    width = N
    col0 = 0
    if STACKED:
        width = tl.multiple_of(tl.load(dims_ptr + sl), COL_ALIGN)  # vector loads and stores of out
        col0 = tl.multiple_of(tl.load(cols_ptr + sl), COL_ALIGN)
    rank = tl.minimum(tl.load(rank_ptr + sl * rank_slice_stride + adapter), R_MAX)
    if n_first >= width or rank <= 0:  # past this slice's columns, or the slice not adapted by this adapter
        return
    scale = tl.load(scale_ptr + sl * scale_slice_stride + adapter)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    v_rows = v_ptr + sl.to(tl.int64) * v_slice_stride + rows.to(tl.int64)[:, None] * v_stride
    off_row = b_off_ptr + sl.to(tl.int64) * off_slice_stride + adapter.to(tl.int64) * off_stride
    ty = out_ptr.dtype.element_ty
    rs0 = tl.arange(0, BLOCK_R)
    r0_ok = rs0 < rank
    off0 = _row_offsets(off_row, rs0, r0_ok, ALIGN)
    v0 = _expand_v(
        v_rows,
        rs0,
        row_ok[:, None] & r0_ok[None, :],
        CHUNKS,
        v_chunk_stride,
        out_ptr,
        BLOCK_M,
        BLOCK_R,
        RNE,
        UPCAST,
        PARTIALS,
    )
    o_rows = out_ptr + col0 + rows.to(tl.int64)[:, None] * out_stride
    for n0 in range(n_first, tl.minimum(n_first + COL_STEPS * BLOCK_N, width), BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_ok = ns < width
        mask = row_ok[:, None] & n_ok[None, :]
        o_ptrs = o_rows + ns[None, :]
        o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)  # issued with B's load, not after the dot
        bt = tl.load(b_ptr + off0[:, None] + ns[None, :], mask=r0_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            bt = bt.to(tl.float32)
        acc = tl.dot(v0, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), input_precision=DOT_PREC)
        for r0 in range(BLOCK_R, rank, BLOCK_R):  # the segment's own rank, in tiles of BLOCK_R
            rs = r0 + tl.arange(0, BLOCK_R)
            r_ok = rs < rank
            off = _row_offsets(off_row, rs, r_ok, ALIGN)
            v_mask = row_ok[:, None] & r_ok[None, :]
            vt = _expand_v(v_rows, rs, v_mask, CHUNKS, v_chunk_stride, out_ptr, BLOCK_M, BLOCK_R, RNE, UPCAST, PARTIALS)
            bt = tl.load(b_ptr + off[:, None] + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                bt = bt.to(tl.float32)
            acc = tl.dot(vt, bt, acc, input_precision=DOT_PREC)
        tl.store(o_ptrs, round_to(o + scale * acc, ty, RNE).to(ty), mask=mask)


def _dot_flags(t: torch.Tensor) -> tuple[bool, str]:
    """(UPCAST, DOT_PREC): fp32 tiles under the interpreter; fp32 dots in IEEE precision, not TF32."""
    upcast = not t.is_cuda
    return upcast, "ieee" if upcast or t.dtype == torch.float32 else "tf32"


def sgmv_chunks(in_dim: int) -> int:
    """CHUNKS of the split shrink's partials: the input columns in chunks of CHUNK_K."""
    return triton.cdiv(in_dim, SGMV_SPLIT["CHUNK_K"])


def sgmv_split(in_dim: int, num_tiles: int, num_tokens: int, n_slices: int, r_max: int, device: torch.device) -> int:
    """SPLIT of the SGMV shrink from shapes only (module docstring): 1 once the chunk's tiles (at
    most ``cdiv(num_tokens, SGMV_TILE)``: a graph's static tile list is mostly idle) times
    ``n_slices`` reach ``min_programs_per_sm`` x the SMs, else enough splits to reach them, at most
    ``sgmv_chunks(in_dim)``; 1 as well where the float32 partials [n_slices, CHUNKS, tokens, r_max]
    would pass ``max_partials_mb`` (a long eager prefill next to a wide r_max: memory the worker's
    profile run may not have seen). ``DELTASERVE_SGMV_SPLIT=N`` forces N. The result never depends
    on it (chunked sums, fixed order)."""
    if _FORCED != "auto":
        return min(int(_FORCED), sgmv_chunks(in_dim))
    if n_slices * sgmv_chunks(in_dim) * num_tokens * r_max * 4 > SGMV_SPLIT["max_partials_mb"] << 20:
        return 1
    sms = sm_count(device) if device.type == "cuda" else SGMV_SPLIT["cpu_sms"]
    want = SGMV_SPLIT["min_programs_per_sm"] * sms
    work = max(1, min(num_tiles, triton.cdiv(num_tokens, SGMV_TILE)) * n_slices)
    return 1 if work >= want else min(sgmv_chunks(in_dim), triton.cdiv(want, work))


def sgmv_col_steps(col_tiles: int, num_tiles: int, num_tokens: int, n_slices: int, device: torch.device) -> int:
    """Column tiles (of BLOCK_N) per SGMV expand program, from shapes only (CUDA-graph safe): the most,
    a power of two up to ``max_col_steps``, that keeps the grid at ``min_programs_per_sm`` x the SMs
    programs or more, counting the chunk's token tiles as ``sgmv_split`` does; 1 for a chunk too short
    to fill the GPU even so. Longer column loops read v, the tile's metadata and B's row offsets once
    for more columns. ``DELTASERVE_SGMV_COL_STEPS=N`` forces N. The result never depends on it."""
    if _FORCED_COLS != "auto":
        return min(int(_FORCED_COLS), max(1, col_tiles))
    sms = sm_count(device) if device.type == "cuda" else SGMV_SPLIT["cpu_sms"]
    want = _EXPAND["min_programs_per_sm"] * sms
    work = max(1, min(num_tiles, triton.cdiv(num_tokens, SGMV_TILE)) * n_slices)
    steps = 1
    while steps * 2 <= min(_EXPAND["max_col_steps"], col_tiles) and work * triton.cdiv(col_tiles, steps * 2) >= want:
        steps *= 2
    return steps


def _shrink_launch(
    x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, v: torch.Tensor, split: int, partials: bool
) -> None:
    _check_chunk_k()
    tab = LaunchTables.of(w)
    upcast, prec = _dot_flags(x)
    r_tiles = triton.cdiv(w.r_max, _SHRINK["BLOCK_R"])
    vs = v if partials else (v if v.dim() == 3 else v[None])[:, None]  # [n_slices, chunks or 1, T, r_max]
    _sgmv_shrink_kernel[(meta.num_tiles, tab.n * r_tiles, split)](
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
        split,
        sgmv_chunks(w.in_dim),
        x.stride(0),
        vs.stride(0),
        vs.stride(1),
        vs.stride(2),
        tab.a_off_slice,
        tab.a_off_row,
        tab.rank_slice,
        BLOCK_M=SGMV_TILE,
        BLOCK_R=_SHRINK["BLOCK_R"],
        BLOCK_K=_SHRINK["BLOCK_K"],
        CHUNK_K=SGMV_SPLIT["CHUNK_K"],
        ALIGN=align(w, w.a_pool),
        UPCAST=upcast,
        DOT_PREC=prec,
        RNE=needs_rne_by_hand(v),
        PARTIALS=partials,
        num_warps=_SHRINK["num_warps"],
    )


def sgmv_shrink(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, v: torch.Tensor) -> None:
    """Launches the unsplit SGMV shrink (SPLIT = 1) into ``v`` ([T, r_max] for one slice,
    [n_slices, T, r_max] stacked), grid (token tiles with an adapter, n_slices * rank tiles, 1)."""
    if meta.num_tiles:
        _shrink_launch(x, w, meta, v, 1, False)


def sgmv_shrink_partials(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, split: int) -> torch.Tensor:
    """Launches the split SGMV shrink, grid (token tiles with an adapter, n_slices * rank tiles,
    ``split``); returns its float32 partials [n_slices, CHUNKS, T, r_max] (only the entries of the
    tiles' rows below their adapter's rank in that slice are written; ``sgmv_expand`` reads those)."""
    n = w.num_slices if isinstance(w, LoraStack) else 1
    part = torch.empty(n, sgmv_chunks(w.in_dim), x.shape[0], w.r_max, dtype=torch.float32, device=x.device)
    if meta.num_tiles:
        _shrink_launch(x, w, meta, part, split, True)
    return part


def sgmv_delta_shrink(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta) -> torch.Tensor | None:
    """The shrink of a delta: launches the meta's tiles' shrink, split-K as ``sgmv_split`` picks,
    and returns what ``sgmv_expand`` reads (the float32 partials, or the unsplit v; the expand gives
    the same out for every SPLIT); None when the meta has no tiles. The unsplit v needs no zero
    fill: the expand reads only what the shrink wrote (the same tiles and ranks)."""
    if not meta.num_tiles:
        return None
    n = w.num_slices if isinstance(w, LoraStack) else 1
    split = sgmv_split(w.in_dim, meta.num_tiles, x.shape[0], n, w.r_max, x.device)
    if split > 1:
        return sgmv_shrink_partials(x, w, meta, split)
    v = torch.empty(n, x.shape[0], w.r_max, dtype=x.dtype, device=x.device)
    sgmv_shrink(x, w, meta, v)
    return v


def sgmv_expand(v: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, out: torch.Tensor) -> None:
    """Launches the SGMV expand from ``v`` (as ``sgmv_shrink`` writes it, in out's dtype, or the
    float32 partials [n_slices, CHUNKS, T, r_max] of ``sgmv_shrink_partials``) into ``out`` (the
    slice's columns, or the whole output for a stack), grid (token tiles with an adapter, n_slices *
    column groups of the widest slice: ``sgmv_col_steps`` tiles of BLOCK_N columns each)."""
    if not meta.num_tiles:
        return
    tab = LaunchTables.of(w)
    upcast, prec = _dot_flags(out)
    col_tiles = triton.cdiv(tab.max_width, _EXPAND["BLOCK_N"])
    col_steps = sgmv_col_steps(col_tiles, meta.num_tiles, out.shape[0], tab.n, out.device)
    n_groups = triton.cdiv(col_tiles, col_steps)
    partials = v.dim() == 4
    vs = v if partials else (v if v.dim() == 3 else v[None])[:, None]
    grid = (meta.num_tiles, tab.n * n_groups)
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
        n_groups,
        col_steps,
        vs.shape[1],
        vs.stride(0),
        vs.stride(1),
        vs.stride(2),
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
        COL_ALIGN=col_align(tab, out),
        PARTIALS=partials,
        num_warps=_EXPAND["num_warps"],
    )
