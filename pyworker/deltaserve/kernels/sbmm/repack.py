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


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [n] -> int64 [n, 32/bits] fields, bit 0 first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    return (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _words(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [n, 32/bits] fields -> int32 [n] words (two's complement), inverse of ``_fields``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=fields.device)
    w = (fields << shifts).sum(dim=-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _permute_codes(qv: torch.Tensor, p: PackedLinear, order: tuple[int, ...], to_frag: bool) -> torch.Tensor:
    view = _codes_view(p.bits, p.sparse, p.out_features, p.in_features)
    codes = _fields(qv.reshape(-1), p.bits)
    if to_frag:
        moved = codes.reshape(view).permute(order)
    else:
        moved = codes.reshape(tuple(view[d] for d in _CODE_ORDER)).permute(order)
    return _words(moved.reshape(-1, 32 // p.bits), p.bits).reshape(qv.shape)


def _permute_halves(t: torch.Tensor, view: tuple[int, ...], order: tuple[int, ...], to_frag: bool) -> torch.Tensor:
    """A 16-bit-element permutation of ``t`` (int32 words viewed as halves, or float16)."""
    halves = t.contiguous().view(torch.int16) if t.dtype == torch.int32 else t.contiguous()
    shape = view if to_frag else tuple(view[d] for d in order)
    moved = halves.reshape(shape).permute(order if to_frag else _inverse(order)).contiguous()
    return moved.view(t.dtype).reshape(t.shape) if t.dtype == torch.int32 else moved.reshape(t.shape)


def _groups_view(p: PackedLinear) -> tuple[int, ...]:
    return (p.out_features // ROWS, 4, 2, 2, 8, p.in_features // KS, KS // p.group_size)


def _qi_view(p: PackedLinear) -> tuple[int, ...]:
    return (p.out_features // ROWS, 4, 2, 2, 8, p.in_features // KS, 8, 2)


def repack(p: PackedLinear) -> PackedLinear:
    """``p`` in the repacked layout (module docstring): same config, shapes and dtypes, words permuted.
    Raises ``ValueError`` when the shape does not fit it (``fits``)."""
    why = fits(p.bits, p.sparse, p.group_size, p.out_features, p.in_features)
    if why is not None:
        raise ValueError(f"sbmm repack: {why}")
    gv = _groups_view(p)
    return PackedLinear(
        p.bits, p.sparse, p.group_size, p.out_features, p.in_features,
        _permute_codes(p.qvalues, p, _CODE_ORDER, True),
        None if p.qindices is None else _permute_halves(p.qindices, _qi_view(p), _QI_ORDER, True),
        _permute_halves(p.scales, gv, _G_ORDER, True), _permute_halves(p.zeros, gv, _G_ORDER, True),
    )  # fmt: skip


def unpack(p: PackedLinear) -> PackedLinear:
    """The inverse of ``repack``: the format's tensors of a repacked ``p`` (new tensors)."""
    why = fits(p.bits, p.sparse, p.group_size, p.out_features, p.in_features)
    if why is not None:
        raise ValueError(f"sbmm unpack: {why}")
    gv = _groups_view(p)
    return PackedLinear(
        p.bits, p.sparse, p.group_size, p.out_features, p.in_features,
        _permute_codes(p.qvalues, p, _inverse(_CODE_ORDER), False),
        None if p.qindices is None else _permute_halves(p.qindices, _qi_view(p), _QI_ORDER, False),
        _permute_halves(p.scales, gv, _G_ORDER, False), _permute_halves(p.zeros, gv, _G_ORDER, False),
    )  # fmt: skip
