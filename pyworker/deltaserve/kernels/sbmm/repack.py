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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...formats.packed_delta import PackedLinear

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


_CHUNK_ROWS = 8 * ROWS
"""Rows repacked at a time: the row-block axis is outermost in both layouts, so row blocks repack on their
own, and a large linear's temporaries stay tens of MB (a delta is stored on a GPU already full of KV)."""


def _codes_view(bits: int, sparse: bool, out: int, inf: int) -> tuple[int, ...]:
    """The shape that splits a plain [out, kept] code matrix into (rb, warp, mt, jrow, g, stage, KP, KO, jhi, t, h)."""
    steps = KS // (32 if sparse else 16)  # k-steps per stage
    ko = 2 if bits == 2 else 1
    return (out // ROWS, 4, 2, 2, 8, inf // KS, steps // ko, ko, 2, 4, 2)


_CODE_ORDER = (0, 5, 1, 6, 2, 4, 9, 10, 7, 8, 3)
"""(rb, stage, warp, KP, mt, g, t | h, KO, jhi, jrow): words, then the fields of a word from bit 0."""
_QI_ORDER = (0, 5, 1, 6, 2, 4, 7, 3)
"""qindices halves (rb, warp, mt, jrow, g, stage, ks, t01) -> (rb, stage, warp, ks, mt, g, t01 | jrow)."""
_G_ORDER = (0, 5, 1, 6, 4, 2, 3)
"""scales (rb, warp, mt, jrow, g, stage, gi) -> (rb, stage, warp, gi, g, mt, jrow)."""


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return tuple(inv)


def _permute(view: tuple[int, ...], order: tuple[int, ...], to_frag: bool, t: torch.Tensor) -> torch.Tensor:
    """``t`` (any shape, ``prod(view)`` elements) permuted: plain -> repacked (``to_frag``) or back."""
    if to_frag:
        return t.reshape(view).permute(order)
    return t.reshape(tuple(view[d] for d in order)).permute(_inverse(order))


def _by_rows(src: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` over ``_CHUNK_ROWS``-row pieces of ``src`` ([out, n]), into a new tensor of its shape."""
    dst = torch.empty_like(src)
    for r0 in range(0, src.shape[0], _CHUNK_ROWS):
        piece = src[r0 : r0 + _CHUNK_ROWS]
        dst[r0 : r0 + piece.shape[0]] = fn(piece).reshape(piece.shape)
    return dst


def _codes(p: PackedLinear, to_frag: bool) -> torch.Tensor:
    """qvalues permuted code by code (a chunk's words rebuilt in int64)."""
    bits, per = p.bits, 32 // p.bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=p.qvalues.device)

    def piece(words: torch.Tensor) -> torch.Tensor:
        fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift, masked: exact
        view = _codes_view(bits, p.sparse, words.shape[0], p.in_features)
        moved = _permute(view, _CODE_ORDER, to_frag, fields).reshape(-1, per).to(torch.int64)
        out = torch.zeros(moved.shape[0], dtype=torch.int64, device=words.device)
        for i in range(per):  # disjoint fields: | builds the word, < 2^32 in int64 (no signed overflow)
            out |= moved[:, i] << (i * bits)
        return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)  # two's complement view

    return _by_rows(p.qvalues, piece)


def _halves(
    t: torch.Tensor, p: PackedLinear, view_tail: tuple[int, ...], order: tuple[int, ...], to_frag: bool
) -> torch.Tensor:
    """A 16-bit-element permutation of ``t`` ([out, n] int32 words viewed as halves, or float16)."""

    def piece(rows: torch.Tensor) -> torch.Tensor:
        halves = rows.contiguous().view(torch.int16) if rows.dtype == torch.int32 else rows
        view = (rows.shape[0] // ROWS, 4, 2, 2, 8, p.in_features // KS, *view_tail)
        moved = _permute(view, order, to_frag, halves).contiguous().reshape(halves.shape)
        return moved.view(torch.int32) if rows.dtype == torch.int32 else moved

    return _by_rows(t, piece)


def _convert(p: PackedLinear, to_frag: bool, what: str) -> PackedLinear:
    why = fits(p.bits, p.sparse, p.group_size, p.out_features, p.in_features)
    if why is not None:
        raise ValueError(f"sbmm {what}: {why}")
    groups = (KS // p.group_size,)
    return PackedLinear(
        p.bits, p.sparse, p.group_size, p.out_features, p.in_features, _codes(p, to_frag),
        None if p.qindices is None else _halves(p.qindices, p, (8, 2), _QI_ORDER, to_frag),
        _halves(p.scales, p, groups, _G_ORDER, to_frag), _halves(p.zeros, p, groups, _G_ORDER, to_frag),
    )  # fmt: skip


def repack(p: PackedLinear) -> PackedLinear:
    """``p`` in the repacked layout (module docstring): same config, shapes and dtypes, words permuted (new
    tensors). Raises ``ValueError`` when the shape does not fit it (``fits``)."""
    return _convert(p, True, "repack")


def unpack(p: PackedLinear) -> PackedLinear:
    """The inverse of ``repack``: the format's tensors of a repacked ``p`` (new tensors)."""
    return _convert(p, False, "unpack")
