"""The repacked (fragment-order) layout of one delta slot: ``repack`` at upload, ``unpack`` back to the format.

The packed format (formats/packed_delta.py) stores each row's codes in order. csrc/sbmm.cu's decode
kernel consumes them as ``mma`` A fragments: 128 output rows per block (4 warps of 32 rows, each two
16-row MMA tiles ``mt``), 256 input columns per pipelined stage, one k-step of 32 (2:4) or 16 (dense)
columns per MMA. Lane ``(g, t)`` (lane = 4g + t) holds four registers ``j`` of two halves ``h``:
row ``16 mt + g + 8 (j & 1)``, 2:4 chunk ``t + 4 (j >> 1)`` of the k-step (its kept value h) or dense
column ``2t + 8 (j >> 1) + h``. The repacked layout stores every word in the order the lanes consume
it, so that a block's stage is one contiguous run (plain 16-byte copies) and a lane turns one word into
its A registers with a shift and a LOP3 each (``(w >> s) & 0x000F000F | 0x64006400``: fp16 1024 +
code in both halves, Marlin's trick)::

    qvalues   [out/128 row blocks][in/256 stages][4 warps][KP][2 mt][8 g][4 t]  words
              4-bit: KP = k-steps of the stage; field (h, j) at bit 16 h + 4 j
              2-bit: KP = pairs of k-steps (ko = 0, 1); field (h, ko, j) at bit 16 h + 8 ko + 2 j
    qindices  [out/128][in/256][4 warps][8 k-steps][2 mt][8 g][2 halves] words (2:4 only): the MMA
              metadata of lane (g, t = 0 / 1) as it is: the row-g and row-(g + 8) 16-bit halves t of
              the plain qindices words (what ``__byte_perm(ia, ib, 0x5410 / 0x7632)`` built)
    scales,   [out/128][in/256][4 warps][256/G groups][8 g][2 mt][2 (row g, row g + 8)]  float16
    zeros     (same order): lane g reads its four rows' values of a group as one 8-byte word

A slot repacks when its pool's shape fits the CUDA op's tiles (``fits``: out % 128 == 0, in % 256 == 0,
G in 32 / 64 / 128); the words are a permutation of the format's, same sizes, so slot offsets and the
worker's arenas are unchanged. ``unpack`` is the exact inverse: ``DeltaWeights.packed`` gives the
format's tensors back, which is what the reference (``dequantize``), the Triton kernels and the dense
dequantiser read over a repacked pool (this module is the one owner of the permutation).

Where Triton runs (``kernels.common``: CUDA tensors by default) ``repack`` and ``unpack`` are one launch
of ``repack_triton.py`` per linear (a ``store`` into a repacked pool was launch-bound); the torch code
here (the reshapes of ``_codes_view`` by ``_CODE_ORDER``, ``_QI_ORDER``, ``_G_ORDER``) is the CPU path
and the reference that kernel is tested against word for word.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch

from ...formats.packed_delta import PackedLinear
from ..common import want_triton

ROWS = 128
"""Output rows per block of csrc/sbmm.cu (its ``ROWS``)."""
KS = 256
"""Input columns per pipelined stage of csrc/sbmm.cu (its ``KS``)."""
GROUPS = (32, 64, 128)
"""Group sizes the repacked layout (and csrc/sbmm.cu) takes."""


def fits(bits: int, sparse: bool, group_size: int, out_features: int, in_features: int) -> str | None:
    """None when a delta of this config and shape can take the repacked layout, else why not."""
    if out_features % ROWS or in_features % KS or group_size not in GROUPS:
        return (
            f"shape [{out_features}, {in_features}] / group size {group_size} (the repacked layout wants "
            f"out % {ROWS} == 0, in % {KS} == 0, group size in {GROUPS})"
        )
    return None


def _codes_view(bits: int, sparse: bool, out: int, inf: int) -> tuple[int, ...]:
    """The shape that splits a plain [out, kept] code matrix into (rb, warp, mt, jrow, g, stage, KP, KO, jhi,
    t2, t1, h): the format's order, code by code (lane t = 2 t2 + t1)."""
    steps = KS // (32 if sparse else 16)  # k-steps per stage
    ko = 2 if bits == 2 else 1
    return (out // ROWS, 4, 2, 2, 8, inf // KS, steps // ko, ko, 2, 2, 2, 2)


_CODE_ORDER = (0, 5, 1, 6, 2, 4, 9, 10, 11, 7, 8, 3)
"""(rb, stage, warp, KP, mt, g, t2, t1 | h, KO, jhi, jrow): words, then the fields of a word from bit 0."""
_QI_ORDER = (0, 5, 1, 6, 2, 4, 7, 3)
"""qindices halves (rb, warp, mt, jrow, g, stage, ks, t01) -> (rb, stage, warp, ks, mt, g, t01 | jrow)."""
_G_ORDER = (0, 5, 1, 6, 4, 2, 3)
"""scales (rb, warp, mt, jrow, g, stage, gi) -> (rb, stage, warp, gi, g, mt, jrow)."""

TEMP_BUDGET = 2
"""``repack`` / ``unpack`` hold at most this many times the linear's own bytes in temporaries (one byte per
code, a row range at a time when a whole linear's codes would exceed it: 2-bit dense): a delta is stored on a
GPU whose KV pool already took most of the memory."""


def _orders(order: tuple[int, ...], to_frag: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(source, destination) orders of a view's dims: plain (identity) -> ``order`` or back."""
    plain = tuple(range(len(order)))
    return (plain, order) if to_frag else (order, plain)


def _move_halves(src: torch.Tensor, dst: torch.Tensor, view: tuple[int, ...], order: tuple[int, ...], to_frag: bool):
    """``dst`` = the 16-bit elements of ``src`` (int32 words as halves, or float16) permuted: one strided copy."""
    s_order, d_order = _orders(order, to_frag)
    halves = src.contiguous().view(torch.int16)
    moved = halves.reshape([view[d] for d in s_order]).permute([s_order.index(d) for d in d_order])
    dst.view(torch.int16).view([view[d] for d in d_order]).copy_(moved)


_SHIFTS: dict[tuple[int, torch.device], torch.Tensor] = {}
"""(bits, device) -> [8 / bits] uint8: each code's shift in its byte (made once: a store is launch-bound)."""


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    key = (bits, device)
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(0, 8, bits, dtype=torch.uint8).to(device)
    return _SHIFTS[key]


def _move_codes(src: torch.Tensor, dst: torch.Tensor, bits: int, view: tuple[int, ...], to_frag: bool) -> None:
    """``dst`` (int32 words, contiguous) = the codes of ``src`` (int32 words) permuted, ``8 / bits`` per byte.

    The byte view is little-endian (code i of a word at bits i * bits: byte i // (8 / bits)). One strided
    shift writes every code into its own byte in the destination's order (each source byte broadcast over
    its codes, shifted by the code's position in it), a mask keeps the code, and ``8 / bits - 1`` shift /
    or pairs fold each destination byte's codes together: a fixed handful of launches per linear, exact."""
    per_byte = 8 // bits
    s_order, d_order = _orders(_CODE_ORDER, to_frag)
    s_shape, d_shape = [view[d] for d in s_order], [view[d] for d in d_order]
    inner = next(k for k in range(1, len(s_shape) + 1) if math.prod(s_shape[-k:]) == per_byte)
    src_bytes = src.contiguous().view(torch.uint8).reshape(s_shape[:-inner] + [1] * inner).expand(s_shape)
    shifts = _shifts(bits, src.device).reshape(s_shape[-inner:])
    to_dst = [s_order.index(d) for d in d_order]
    codes = torch.empty(d_shape, dtype=torch.uint8, device=src.device)
    torch.bitwise_right_shift(src_bytes.permute(to_dst), shifts.expand(s_shape).permute(to_dst), out=codes)
    codes &= (1 << bits) - 1
    fields = codes.view(-1, per_byte)
    out = dst.view(torch.uint8).view(-1)
    torch.bitwise_left_shift(fields[:, 1], bits, out=out)
    out |= fields[:, 0]
    for i in range(2, per_byte):  # 2-bit: disjoint fields, | builds the byte
        fields[:, i] <<= i * bits
        out |= fields[:, i]


def _convert(
    p: PackedLinear, to_frag: bool, what: str, out: PackedLinear | None, use_triton: bool | None
) -> PackedLinear:
    why = fits(p.bits, p.sparse, p.group_size, p.out_features, p.in_features)
    if why is not None:
        raise ValueError(f"sbmm {what}: {why}")
    if sys.byteorder != "little":
        raise RuntimeError(f"sbmm {what}: reads int32 words as bytes, which needs a little-endian host")

    def new(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    dst = out if out is not None else PackedLinear(
        p.bits, p.sparse, p.group_size, p.out_features, p.in_features, new(p.qvalues),
        None if p.qindices is None else new(p.qindices), new(p.scales), new(p.zeros),
    )  # fmt: skip
    wanted = dst.tensors()
    for name, t in p.tensors().items():
        d = wanted.get(name)
        if d is None or d.shape != t.shape or d.dtype != t.dtype or d.device != t.device or not d.is_contiguous():
            raise ValueError(f"sbmm {what}: out's {name} must be a contiguous {list(t.shape)} {t.dtype} on {t.device}")
    if want_triton(f"sbmm {what}", p.qvalues, use_triton):
        from .repack_triton import convert_triton  # imports this module: the layout's one owner

        if not all(t.is_contiguous() for t in p.tensors().values()):
            qi = None if p.qindices is None else p.qindices.contiguous()
            p = dataclasses.replace(
                p, qvalues=p.qvalues.contiguous(), qindices=qi, scales=p.scales.contiguous(), zeros=p.zeros.contiguous()
            )
        return convert_triton(p, dst, to_frag)
    out_f, inf, kept = p.out_features, p.in_features, p.kept
    rows = max(ROWS, TEMP_BUDGET * p.nbytes() // kept // ROWS * ROWS)  # one byte per code of a row range
    for r0 in range(0, out_f, rows):  # row blocks are outermost in both layouts
        r1 = min(out_f, r0 + rows)
        _move_codes(p.qvalues[r0:r1], dst.qvalues[r0:r1], p.bits, _codes_view(p.bits, p.sparse, r1 - r0, inf), to_frag)
    head = (out_f // ROWS, 4, 2, 2, 8, inf // KS)
    if p.qindices is not None:
        assert dst.qindices is not None
        _move_halves(p.qindices, dst.qindices, (*head, 8, 2), _QI_ORDER, to_frag)
    for name in ("scales", "zeros"):
        _move_halves(getattr(p, name), getattr(dst, name), (*head, KS // p.group_size), _G_ORDER, to_frag)
    return dst


def repack(p: PackedLinear, out: PackedLinear | None = None, *, use_triton: bool | None = None) -> PackedLinear:
    """``p`` in the repacked layout (module docstring): same config, shapes and dtypes, words permuted, into
    ``out`` (contiguous tensors of ``p``'s shapes on its device, not overlapping it: a pool slot's views) or
    new tensors. Raises ``ValueError`` when the shape does not fit it (``fits``). Where Triton runs
    (``kernels.common``: CUDA tensors by default; ``use_triton`` forces it or this module's torch code for
    one call) one launch writes it (``repack_triton.py``); the torch code here is its reference."""
    return _convert(p, True, "repack", out, use_triton)


def unpack(p: PackedLinear, out: PackedLinear | None = None, *, use_triton: bool | None = None) -> PackedLinear:
    """The inverse of ``repack``: the format's tensors of a repacked ``p``, into ``out`` or new tensors (one
    Triton launch or torch, as ``repack`` picks)."""
    return _convert(p, False, "unpack", out, use_triton)
