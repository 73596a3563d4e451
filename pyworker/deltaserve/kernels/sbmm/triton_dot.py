"""SBMM's tl.dot tiles: work tiles of 16 or 64 tokens (prefill, long runs of one delta).

Per K tile, dequantise the delta tile (``dequant.dequant_tile``: shift/mask every code out of the
qvalues words of ``BLOCK_N`` rows; for 2:4 place the two kept codes of each group of 4 at their
positions from the qindices words, zeros elsewhere; scale with the tile's scales / zeros), round it to
x's dtype, and ``tl.dot`` it with the x tile. Under the interpreter the tiles are fp32, because its
low-precision dot is wrong; fp32 inputs use IEEE precision, not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import needs_rne_by_hand, round_to
from .dequant import dequant_tile, tile_constexprs
from .layout import DeltaWeights
from .meta import DeltaMeta
from .tiles import add_to_out, qindices_arg, slot_rows, tile_tokens, work_tile


@triton.jit
def _sbmm_dot_kernel(
    x_ptr,
    out_ptr,
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
    x_stride,
    out_stride,
    QV_ROW,
    QI_ROW,
    NGROUPS,
    BITS: tl.constexpr,
    SPARSE: tl.constexpr,
    G: tl.constexpr,
    KEPT: tl.constexpr,
    WORDS: tl.constexpr,
    IWORDS: tl.constexpr,
    GROUPS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE: tl.constexpr,
):
    slot, start, end = work_tile(tiles_ptr)
    if slot < 0:  # a padding row of the tile table
        return

    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    qv_rows, qi_rows, g_off = slot_rows(
        qv_ptr, qi_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, ns, QV_ROW, QI_ROW, NGROUPS
    )
    at, row_ok, rows = tile_tokens(order_ptr, start, end, BLOCK_M)
    x_rows = x_ptr + rows[:, None] * x_stride
    ty = x_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        wt = dequant_tile(
            qv_rows,
            qi_rows,
            g_off,
            sc_ptr,
            zr_ptr,
            n_ok,
            k0,
            K,
            QV_ROW,
            QI_ROW,
            NGROUPS,
            BITS,
            SPARSE,
            G,
            KEPT,
            WORDS,
            IWORDS,
            GROUPS_PER_TILE,
            BLOCK_N,
            BLOCK_K,
        )  # [BN, BK] fp32, Δ̃ rows
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's low-precision dot is wrong: fp32 tiles holding dtype values
            wt = round_to(wt, ty, RNE)
            xt = xt.to(tl.float32)
        else:
            wt = wt.to(ty)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PREC)
    add_to_out(out_ptr + rows[:, None] * out_stride + ns[None, :], acc, row_ok[:, None] & n_ok[None, :], RNE)


def launch_dot(
    x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta, cfg: dict[str, int]
) -> torch.Tensor:
    """The tl.dot tiles' launch of ``sbmm_triton`` (after its checks; ``cfg`` from ``launch_config``), in
    place on ``out``."""
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    qv, _, g = w.slot_shapes()
    qi_buf, qi_row = qindices_arg(w)
    rne = needs_rne_by_hand(out)
    n_tiles = triton.cdiv(w.out_features, block_n)
    upcast = not x.is_cuda
    prec = "ieee" if upcast or x.dtype == torch.float32 else "tf32"
    _sbmm_dot_kernel[(meta.grid_tiles, n_tiles)](
        x, out, meta.order, meta.tiles, w.qvalues, qi_buf, w.scales, w.zeros, w.qvalues_offsets, w.qindices_offsets,
        w.group_offsets, w.out_features, w.in_features, x.stride(0), out.stride(0), qv[1], qi_row, g[1],
        **tile_constexprs(w, block_k), BLOCK_M=meta.block_m, BLOCK_N=block_n, UPCAST=upcast, DOT_PREC=prec, RNE=rne,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    return out
