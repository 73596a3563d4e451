"""SBMM's FMA tiles: work tiles of at most ``FMA_MAX_M`` = 4 tokens (decode, few rows per delta).

Per K tile, load ``[BN, W]`` qvalues words (and for 2:4 the position words, 8 groups each). Plane i is
the i-th code (dense) or i-th group of 4 columns (2:4) of every word. For 2:4, shift out the group's
two codes v0, v1 and positions p0 < p1; each of its 4 columns takes v0, v1 or 0, and is multiplied
with the x column of the same index by plain FMAs into ``[BM, BN, W]``, summed over W at the end.
There are no reshapes, and no 16-row tensor-core tile is padded for one token. Scales come one per
row when ``G % BLOCK_K == 0``, one per (row, word) when a word's columns share a group, else gathered
per plane. When one or two deltas would leave SMs idle, K is split over programs (``launch_config``):
float32 partials go to a workspace, and ``_splitk_reduce_kernel`` adds them in a fixed order with one
rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import needs_rne_by_hand, round_to
from .layout import DeltaWeights
from .meta import DeltaMeta
from .tiles import add_to_out, qindices_arg, slot_rows, tile_tokens, work_tile


@triton.jit
def _fma_plane(acc, x_rows, row_ok, cols, K, w):
    """acc [BM, BN, W] += x[:, cols] * w for one weight plane ``w`` [BN, W] (float32 holding x-dtype
    values); summed over W once at the end."""
    xt = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    return acc + xt.to(tl.float32)[:, None, :] * w[None, :, :]


@triton.jit
def _sbmm_fma_kernel(
    x_ptr,
    out_ptr,
    ws_ptr,
    order_ptr,
    tiles_ptr,
    qv_ptr,
    qi_ptr,
    sc_ptr,
    zr_ptr,
    qv_off_ptr,
    qi_off_ptr,
    g_off_ptr,
    N,
    K,
    K_SPLIT,
    WS_ROWS,
    x_stride,
    out_stride,
    QV_ROW,
    QI_ROW,
    NGROUPS,
    BITS: tl.constexpr,
    SPARSE: tl.constexpr,
    G: tl.constexpr,
    W: tl.constexpr,
    SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    RNE: tl.constexpr,
):
    slot, start, end = work_tile(tiles_ptr)
    if slot < 0:  # a padding row of the tile table
        return

    # PER codes per qvalues word; a word's codes cover STEP input columns (2:4: PER / 2 groups of 4).
    # Plane i of a K tile = the i-th code (dense) or group (2:4) of each of its W words.
    PER: tl.constexpr = 32 // BITS
    CMASK: tl.constexpr = (1 << BITS) - 1
    PLANES: tl.constexpr = PER // 2 if SPARSE else PER
    STEP: tl.constexpr = 4 * PLANES if SPARSE else PER
    BLOCK_K: tl.constexpr = STEP * W

    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    qv_rows, qi_rows, g_off = slot_rows(
        qv_ptr, qi_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, ns, QV_ROW, QI_ROW, NGROUPS
    )
    at, row_ok, rows = tile_tokens(order_ptr, start, end, BLOCK_M)
    x_rows = x_ptr + rows[:, None] * x_stride
    ty = x_ptr.dtype.element_ty
    ws = tl.arange(0, W)

    acc = tl.zeros((BLOCK_M, BLOCK_N, W), dtype=tl.float32)
    k_lo = tl.program_id(2) * K_SPLIT  # this program's share of the reduction (split-K)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
        widx = k0 // STEP + ws
        words = tl.load(qv_rows + widx[None, :], mask=n_ok[:, None] & (widx < QV_ROW)[None, :], other=0)  # [BN, W]
        base = k0 + STEP * ws  # [W] first input column of each word
        if SCALES == 0:  # the whole K tile is in one quantisation group: one scale / zero per row
            sc = tl.load(sc_ptr + g_off + k0 // G, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            zr = tl.load(zr_ptr + g_off + k0 // G, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        elif SCALES == 1:  # a word's columns are in one group: one scale / zero per (row, word)
            gmask = n_ok[:, None] & (base < K)[None, :]
            sc = tl.load(sc_ptr + g_off[:, None] + (base // G)[None, :], mask=gmask, other=0.0).to(tl.float32)
            zr = tl.load(zr_ptr + g_off[:, None] + (base // G)[None, :], mask=gmask, other=0.0).to(tl.float32)
        if SPARSE:
            # The 2:4 position words: 8 groups per word, so the PLANES groups of a code word share one.
            gidx = k0 // 4 + PLANES * ws  # [W] first group of each word
            iw = tl.load(qi_rows + (gidx // 8)[None, :], mask=n_ok[:, None] & (gidx // 8 < QI_ROW)[None, :], other=0)
        for i in tl.static_range(PLANES):
            if SPARSE:
                cols = base + 4 * i  # group i of each word: columns cols .. cols + 3
            else:
                cols = base + i
            if SCALES == 2:  # gathered per plane
                gmask = n_ok[:, None] & (cols < K)[None, :]
                sc = tl.load(sc_ptr + g_off[:, None] + (cols // G)[None, :], mask=gmask, other=0.0).to(tl.float32)
                zr = tl.load(zr_ptr + g_off[:, None] + (cols // G)[None, :], mask=gmask, other=0.0).to(tl.float32)
            if SPARSE:
                # The group's two kept codes and their positions p0 < p1; each of its 4 columns takes
                # v0, v1 or 0.
                v0 = round_to((((words >> (2 * i * BITS)) & CMASK).to(tl.float32) - zr) * sc, ty, RNE)
                v1 = round_to((((words >> ((2 * i + 1) * BITS)) & CMASK).to(tl.float32) - zr) * sc, ty, RNE)
                sh = (((gidx + i) % 8) * 4)[None, :]
                p0 = (iw >> sh) & 3
                p1 = (iw >> (sh + 2)) & 3
                acc = _fma_plane(acc, x_rows, row_ok, cols, K, tl.where(p0 == 0, v0, 0.0))
                acc = _fma_plane(acc, x_rows, row_ok, cols + 1, K, tl.where(p0 == 1, v0, tl.where(p1 == 1, v1, 0.0)))
                acc = _fma_plane(acc, x_rows, row_ok, cols + 2, K, tl.where(p1 == 2, v1, tl.where(p0 == 2, v0, 0.0)))
                acc = _fma_plane(acc, x_rows, row_ok, cols + 3, K, tl.where(p1 == 3, v1, 0.0))
            else:
                v = round_to((((words >> (i * BITS)) & CMASK).to(tl.float32) - zr) * sc, ty, RNE)
                acc = _fma_plane(acc, x_rows, row_ok, cols, K, v)
    total = tl.sum(acc, axis=2)  # [BM, BN]
    mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        add_to_out(out_ptr + rows[:, None] * out_stride + ns[None, :], total, mask, RNE)
    else:  # float32 partial sums, [split, position in order, column]; _splitk_reduce adds them to out
        w_ptrs = ws_ptr + (tl.program_id(2) * WS_ROWS + at.to(tl.int64))[:, None] * N + ns[None, :]
        tl.store(w_ptrs, total, mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    out_ptr, ws_ptr, order_ptr, N, WS_ROWS, out_stride, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, RNE: tl.constexpr
):
    """out[order[p]] = round(out[order[p]] + sum over splits of the partials of position p): one rounding,
    summed in a fixed order."""
    at = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(ws_ptr + (s * WS_ROWS + at) * N + ns, mask=n_ok, other=0.0)
    row = tl.load(order_ptr + at).to(tl.int64)
    add_to_out(out_ptr + row * out_stride + ns, total, n_ok, RNE)


def fma_step(w: DeltaWeights) -> int:
    """Input columns one qvalues word covers (the FMA kernel's STEP): 32/bits codes, twice that with 2:4."""
    per = 32 // w.bits
    return 2 * per if w.sparse else per


def launch_fma(
    x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta, cfg: dict[str, int]
) -> torch.Tensor:
    """The FMA tiles' launch of ``sbmm_triton`` (after its checks; ``cfg`` from ``launch_config``), plus the
    split-K reduction when the launch splits K; in place on ``out``."""
    block_n, block_k, group = cfg["BLOCK_N"], cfg["BLOCK_K"], w.group_size
    qv, _, g = w.slot_shapes()
    qi_buf, qi_row = qindices_arg(w)
    rne = needs_rne_by_hand(out)
    n_tiles = triton.cdiv(w.out_features, block_n)
    step, split = fma_step(w), cfg["SPLIT_K"]
    # Scales: one per row of a K tile, one per (row, qvalues word), or gathered per plane.
    scales = 0 if group % block_k == 0 else 1 if group % step == 0 else 2
    k_split = triton.cdiv(triton.cdiv(w.in_features, block_k), split) * block_k
    rows = meta.num_delta_tokens
    # Partials workspace; without a split the kernel never touches it (out stands in, no allocation).
    ws = torch.empty((split, rows, w.out_features), dtype=torch.float32, device=x.device) if split > 1 else out
    _sbmm_fma_kernel[(meta.grid_tiles, n_tiles, split)](
        x, out, ws, meta.order, meta.tiles, w.qvalues, qi_buf, w.scales, w.zeros, w.qvalues_offsets,
        w.qindices_offsets, w.group_offsets, w.out_features, w.in_features, k_split, rows, x.stride(0),
        out.stride(0), qv[1], qi_row, g[1], BITS=w.bits, SPARSE=w.sparse, G=group, W=block_k // step,
        SCALES=scales, BLOCK_M=meta.block_m, BLOCK_N=block_n, SPLIT_K=split, RNE=rne,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    if split > 1:
        _splitk_reduce_kernel[(rows, triton.cdiv(w.out_features, 256))](
            out, ws, meta.order, w.out_features, rows, out.stride(0), SPLIT_K=split, BLOCK_N=256, RNE=rne
        )
    return out
