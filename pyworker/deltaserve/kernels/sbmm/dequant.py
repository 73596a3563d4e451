"""A delta slot as a dense tensor (``dequantize_slot``), and the dense prefill segments built on it.

``dequant_tile`` is THE dequantised delta tile of the Triton kernels (the tl.dot tiles multiply it;
``_dequant_kernel`` writes it out): ``(code - zero) * scale`` in float32 where kept, else 0, as
``formats.packed_delta.dequantize`` computes it. ``dequantize_slot`` writes one slot's whole delta
``[out, in]`` in the activation dtype: csrc/sbmm.cu's ``deltaserve_dequant`` where it is built
(float16 / bfloat16 on CUDA, either slot layout: csrc/sbmm_dequant.cuh; bound here, next to the Triton
kernel it replaces), else ``_dequant_kernel`` (over a repacked pool, on the slot unpacked first).
``dequantize_at`` does the same for a slot named by its offsets in a device tensor (a CUDA graph's
replay dequantises the slot the step wrote there: the dense lane of captured mixed steps).

**Dense segments** (``DeltaMeta.dense``, prefill only: ``segments(dense_min_m=)``; the worker sets it
on CUDA, ``dense_min_m``). A segment of at least that many tokens of one delta is in no work tile:
``dequantize_slot`` writes the delta once as a dense ``[out, in]`` tensor, and one cuBLAS matmul adds
``x[a:b] Δ̃^T`` to ``out[a:b]`` (fp32 accumulation, one rounding). A long prompt then pays one
dequantisation of its delta instead of one per work tile. ``sbmm_triton`` and ``sbmm_cuda`` run the
dense segments (``dense_segments``) first, then their work tiles.
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl

from .. import cuda_ext
from ..common import needs_rne_by_hand, read_launch_configs, round_to
from .checks import DTYPES
from .layout import DeltaWeights
from .meta import DeltaMeta
from .tiles import qindices_arg, slot_rows


@triton.jit
def dequant_tile(
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
    BITS: tl.constexpr,
    SPARSE: tl.constexpr,
    G: tl.constexpr,
    KEPT: tl.constexpr,
    WORDS: tl.constexpr,
    IWORDS: tl.constexpr,
    GROUPS_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """THE dequantised delta tile of the Triton kernels: rows ``ns`` (``n_ok``: real; row pointers from
    ``slot_rows``), columns k0 .. k0 + BLOCK_K, as float32 ``(code - zero) * scale`` where kept, else
    0 (past K too). KEPT: kept values per row in the tile (BLOCK_K, or half of it with 2:4); WORDS /
    IWORDS: the qvalues / qindices words that hold them (32 / BITS codes, 16 positions per word)."""
    PER: tl.constexpr = 32 // BITS
    CMASK: tl.constexpr = (1 << BITS) - 1
    shifts = tl.arange(0, PER) * BITS
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    # Codes of the tile's kept values: [BN, WORDS] words -> [BN, WORDS, PER] -> [BN, KEPT].
    widx = (k0 * KEPT // BLOCK_K) // PER + tl.arange(0, WORDS)
    words = tl.load(qv_rows + widx[None, :], mask=n_ok[:, None] & (widx < QV_ROW)[None, :], other=0)
    codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & CMASK, (BLOCK_N, KEPT))
    if SPARSE:
        iidx = k0 // 32 + tl.arange(0, IWORDS)
        iw = tl.load(qi_rows + iidx[None, :], mask=n_ok[:, None] & (iidx < QI_ROW)[None, :], other=0)
        pos = tl.reshape((iw[:, :, None] >> (tl.arange(0, 16) * 2)[None, None, :]) & 3, (BLOCK_N, KEPT))
        # The two kept values of each group of 4 columns, then each dense position's code / keep.
        c0, c1 = tl.split(tl.reshape(codes, (BLOCK_N, BLOCK_K // 4, 2)))
        p0, p1 = tl.split(tl.reshape(pos, (BLOCK_N, BLOCK_K // 4, 2)))
        q = tl.arange(0, 4)[None, None, :]
        at0 = p0[:, :, None] == q
        at1 = p1[:, :, None] == q
        code = tl.reshape(tl.where(at0, c0[:, :, None], c1[:, :, None]), (BLOCK_N, BLOCK_K))
        keep = tl.reshape((at0 | at1).to(tl.int32), (BLOCK_N, BLOCK_K)) != 0
        keep = keep & k_ok[None, :]
    else:
        code = codes
        keep = tl.broadcast_to(k_ok[None, :], (BLOCK_N, BLOCK_K))
    if G % BLOCK_K == 0:  # the whole tile is in one quantisation group: one scale / zero per row
        gi = g_off + k0 // G
        sc = tl.load(sc_ptr + gi, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        zr = tl.load(zr_ptr + gi, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    elif GROUPS_PER_TILE > 0:  # whole groups (G a power of two): load [BN, groups], broadcast to columns
        gs = k0 // G + tl.arange(0, GROUPS_PER_TILE)
        gi = g_off[:, None] + gs[None, :]
        gmask = n_ok[:, None] & (gs < NGROUPS)[None, :]
        sc = tl.load(sc_ptr + gi, mask=gmask, other=0.0).to(tl.float32)
        zr = tl.load(zr_ptr + gi, mask=gmask, other=0.0).to(tl.float32)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, GROUPS_PER_TILE, G)), (BLOCK_N, BLOCK_K))
        zr = tl.reshape(tl.broadcast_to(zr[:, :, None], (BLOCK_N, GROUPS_PER_TILE, G)), (BLOCK_N, BLOCK_K))
    else:  # any other G: gather one scale / zero per column
        gi = g_off[:, None] + (ks // G)[None, :]
        gmask = n_ok[:, None] & k_ok[None, :]
        sc = tl.load(sc_ptr + gi, mask=gmask, other=0.0).to(tl.float32)
        zr = tl.load(zr_ptr + gi, mask=gmask, other=0.0).to(tl.float32)
    return tl.where(keep, (code.to(tl.float32) - zr) * sc, 0.0)


@triton.jit
def _dequant_kernel(
    dst_ptr,
    qv_ptr,
    qi_ptr,
    sc_ptr,
    zr_ptr,
    qv_off_ptr,
    qi_off_ptr,
    g_off_ptr,
    slot,
    N,
    K,
    dst_stride,
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RNE: tl.constexpr,
):
    """dst[n, k] = Δ̃_slot[n, k] in dst's dtype: one [BLOCK_N, BLOCK_K] tile per program (axis 0: rows,
    axis 1: columns), the tile ``dequant_tile`` gives the tl.dot kernel."""
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    k0 = tl.program_id(1) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    qv_rows, qi_rows, g_off = slot_rows(
        qv_ptr, qi_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, ns, QV_ROW, QI_ROW, NGROUPS
    )
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
    )
    ty = dst_ptr.dtype.element_ty
    dst = dst_ptr + ns.to(tl.int64)[:, None] * dst_stride + ks[None, :]
    tl.store(dst, round_to(wt, ty, RNE).to(ty), mask=n_ok[:, None] & (ks < K)[None, :])


def tile_constexprs(w: DeltaWeights, block_k: int) -> dict[str, int | bool]:
    """``dequant_tile``'s pool and K-tile constexprs for ``w`` and ``BLOCK_K = block_k``: KEPT values per
    row and tile, the WORDS / IWORDS holding them, and GROUPS_PER_TILE (scales per tile: one per row when
    G % BLOCK_K == 0, whole power-of-two groups broadcast, or 0: gathered per column)."""
    group = w.group_size
    kept = block_k // 2 if w.sparse else block_k
    groups_per_tile = block_k // group if block_k % group == 0 and group & (group - 1) == 0 else 0
    return {"BITS": w.bits, "SPARSE": w.sparse, "G": group, "KEPT": kept, "WORDS": kept * w.bits // 32,
            "IWORDS": max(kept // 16, 1) if w.sparse else 1, "GROUPS_PER_TILE": groups_per_tile,
            "BLOCK_K": block_k}  # fmt: skip


_DEQUANT = read_launch_configs(__file__)["dequant"]
"""Launch config of ``_dequant_kernel`` (BLOCK_K a power of two >= 32 and >= G), from configs/launch.json."""
_CUDA_DEQUANT_ARGS = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 8 + [ctypes.c_void_p]
"""``deltaserve_dequant``'s C signature (csrc/sbmm.cu)."""


def dequantize_slot(
    w: DeltaWeights, slot: int, dtype: torch.dtype, out: torch.Tensor | None = None, *, use_triton: bool | None = None
) -> torch.Tensor:
    """Slot ``slot``'s delta as a dense ``[out_features, in_features]`` tensor of ``dtype`` on ``w``'s
    device: ``packed_delta.dequantize(w.packed(slot), dtype)`` bit for bit, the value every SBMM kernel
    multiplies by. ``out``: a contiguous tensor of that shape and dtype to write into (a reused
    scratch). csrc/sbmm.cu's ``deltaserve_dequant`` where it is built (float16 / bfloat16 on CUDA),
    else the Triton ``_dequant_kernel`` (``use_triton=True`` forces it)."""
    w.check_loaded(slot)
    offsets = (w.qvalues_offsets, w.qindices_offsets, w.group_offsets)
    return _dequantize(w, offsets, slot, dtype, out, use_triton, "dequantize_slot", host_slot=slot)


def dequantize_at(
    w: DeltaWeights, offsets: torch.Tensor, dtype: torch.dtype, out: torch.Tensor, *, use_triton: bool | None = None
) -> torch.Tensor:
    """``dequantize_slot`` of the slot whose (qvalues, qindices, group) offsets ``offsets`` holds on the
    device (``[3]`` int64, contiguous; a row of ``w``'s ``slot_offsets``): a *device-side slot*. The kernels
    read the offsets when they run, so a CUDA graph captured over ``offsets`` dequantises whichever loaded
    slot the step wrote there before the replay (``adapters/delta_graphs.py``'s dense lane). The caller
    vouches that the offsets are a loaded slot's (no host read here). Over a repacked pool only csrc's
    ``deltaserve_dequant`` runs (the Triton kernel would need the slot on the host to unpack it)."""
    if offsets.shape != (3,) or offsets.dtype != torch.int64 or offsets.device != w.device or offsets.stride(0) != 1:
        raise ValueError(f"sbmm: dequantize_at offsets {list(offsets.shape)} {offsets.dtype} on {offsets.device}: "
                         f"want a contiguous [3] int64 on {w.device}")  # fmt: skip
    return _dequantize(w, (offsets[0:1], offsets[1:2], offsets[2:3]), 0, dtype, out, use_triton, "dequantize_at",
                       host_slot=None)  # fmt: skip


def _dequantize(
    w: DeltaWeights,
    offsets: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slot: int,
    dtype: torch.dtype,
    out: torch.Tensor | None,
    use_triton: bool | None,
    what: str,
    host_slot: int | None,
) -> torch.Tensor:
    """Entry ``slot`` of the (qvalues, qindices, group) offset tables ``offsets`` of pool ``w`` as a dense
    tensor: csrc's ``deltaserve_dequant`` where it runs, else the Triton kernel. ``host_slot``: the pool
    slot this is, where the host knows it (None: a device-side slot), which the Triton kernel needs over a
    repacked pool (the slot is unpacked on the host first)."""
    if dtype not in DTYPES:
        raise ValueError(f"sbmm: {what} dtype {dtype}: want one of float32, float16, bfloat16")
    shape = (w.out_features, w.in_features)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=w.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != w.device or not out.is_contiguous():
        raise ValueError(f"sbmm: {what} out {list(out.shape)} {out.dtype} on {out.device}: want a contiguous "
                         f"{list(shape)} {dtype} on {w.device}")  # fmt: skip
    cuda = use_triton is None and out.is_cuda and dtype in cuda_ext.DTYPE_CODES
    readable = not w.repacked or w.cuda_alignment_problem() is None  # repacked scales: 8-byte loads
    lib = cuda_ext.library("sbmm") if cuda and readable else None
    if lib is not None:  # either layout: csrc/sbmm_dequant.cuh reads the repacked words as they are
        fn = lib.deltaserve_dequant
        if fn.argtypes is None:
            fn.argtypes, fn.restype = _CUDA_DEQUANT_ARGS, ctypes.c_int
        qv_off, qi_off, g_off = (t.data_ptr() for t in offsets)
        code = fn(out.data_ptr(), w.qvalues.data_ptr(), w.qindices.data_ptr() if w.sparse else None,
                  w.scales.data_ptr(), w.zeros.data_ptr(), qv_off, qi_off, g_off, slot, w.out_features,
                  w.in_features, w.group_size, w.bits, int(w.sparse), cuda_ext.DTYPE_CODES[dtype], int(w.repacked),
                  torch.cuda.current_stream(out.device).cuda_stream)  # fmt: skip
        cuda_ext.check(lib, code, what)
        return out
    # The Triton kernel reads the format's layout: the pool's buffers, or the slot unpacked from the repacked one.
    qv_buf, qi_buf, qi_row = w.qvalues, *qindices_arg(w)
    sc_buf, zr_buf, at = w.scales, w.zeros, slot
    if w.repacked:
        if host_slot is None:
            raise ValueError(f"sbmm: {what} over a repacked pool needs csrc's deltaserve_dequant (float16 / "
                             "bfloat16 on CUDA, the op built)")  # fmt: skip
        p = w.packed(host_slot)
        qv_buf, sc_buf, zr_buf = p.qvalues.reshape(-1), p.scales.reshape(-1), p.zeros.reshape(-1)
        qi_buf = p.qindices.reshape(-1) if p.qindices is not None else qv_buf
        zero = torch.zeros(1, dtype=torch.int64, device=w.device)
        offsets, at = (zero, zero, zero), 0
    cfg = _DEQUANT
    block_n, block_k = cfg["BLOCK_N"], max(cfg["BLOCK_K"], w.group_size)
    qv, _, g = w.slot_shapes()
    _dequant_kernel[(triton.cdiv(w.out_features, block_n), triton.cdiv(w.in_features, block_k))](
        out, qv_buf, qi_buf, sc_buf, zr_buf, *offsets, at,
        w.out_features, w.in_features, out.stride(0), qv[1], qi_row, g[1], **tile_constexprs(w, block_k),
        BLOCK_N=block_n, RNE=needs_rne_by_hand(out), num_warps=cfg["num_warps"])  # fmt: skip
    return out


def dense_segments(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> torch.Tensor:
    """The metadata's dense segments (``DeltaMeta.dense``): per segment, its delta dequantised once
    (``dequantize_slot``) and one matmul ``out[a:b] += x[a:b] Δ̃^T`` (fp32 accumulation, one rounding:
    cuBLAS's ``beta = 1``), instead of one dequantisation per work tile. Consecutive segments of one
    slot share the dequantised delta."""
    scratch: torch.Tensor | None = None
    held = -1
    for start, end, slot in meta.dense:
        if scratch is None or slot != held:
            scratch = dequantize_slot(w, slot, x.dtype, out=scratch)
            held = slot
        out[start:end].addmm_(x[start:end], scratch.t())
    return out


_DENSE_MIN_M = 64
"""Prefill segments of a delta with at least this many tokens run dense on CUDA (``dense_min_m``)."""


def dense_min_m(device: torch.device) -> int | None:
    """``DeltaMeta.segments``' ``dense_min_m`` on ``device``: ``_DENSE_MIN_M`` on CUDA, where one
    dequantisation plus a cuBLAS matmul beats a work tile per 16 (or 64) tokens that each dequantise
    the delta again; None elsewhere (the CPU reference computes every segment that way already)."""
    return _DENSE_MIN_M if device.type == "cuda" else None
