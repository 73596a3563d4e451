"""The packed format of one compressed linear delta: ``PackedLinear``, ``pack``, ``unpack``, ``dequantize``.

This module is the single owner of the bit layout (spec: issue 5, "compressed-delta packed format");
the compressor (``deltaserve.compress``) writes it, the serving path and the SBMM kernels
(``deltaserve.kernels.sbmm``) read it, and ``dequantize`` is THE reference semantics every consumer is
tested against. It imports torch only, so every layer may depend on it.

A delta ``Δ̃ ≈ W_ft − W_base`` of a linear with HF weight ``[out, in]`` (``y = x @ W.T``), with
bits ``b ∈ {2, 4}``, 2:4 sparsity on or off, and a quantization group size ``G``::

    sparsity  along the INPUT dimension: in each row, each group of 4 input columns [4k, 4k+4)
              keeps exactly 2 positions; kept = in / 2 per row (sparse) or in (dense)
    quant     asymmetric per (row, group of G ORIGINAL input columns):
              value = (code − zero) · scale,  code ∈ [0, 2^b − 1] unsigned,
              scale, zero float16 (zero in code units, may be fractional); pruned → exactly 0

    qvalues   int32 [out, kept·b/32]   kept value i of a row = bits [(i % (32/b))·b, +b) of
                                        word i // (32/b)  (little end first; top bit may be set)
    qindices  int32 [out, kept/16]     (sparse only) position 0..3 of kept value i inside its
                                        group of 4, 2 bits each, 16 per word, same order; the two
                                        kept positions of a group are increasing
    scales    float16 [out, in/G]
    zeros     float16 [out, in/G]

    e.g. 4-bit 2:4, in = 8, one row, kept columns {0, 3, 5, 6} with codes {7, 1, 15, 2}:
         qvalues[0] word 0 = 7 | 1<<4 | 15<<8 | 2<<12 ;  qindices[0] word 0 = 0 | 3<<2 | 1<<4 | 2<<6

Requirements (``ValueError`` naming the shape otherwise): ``in % G == 0``, ``G % 4 == 0``,
``(kept · b) % 32 == 0``, and for sparse ``kept % 16 == 0`` (so ``in % 32 == 0``).

``dequantize`` computes in float32: ``((code − float(zero)) · float(scale))`` where kept, else 0,
then casts to the requested dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4)


def check_layout(bits: int, sparse: bool, group_size: int, out_features: int, in_features: int) -> int:
    """Validates the format's shape rules (module docstring, "Requirements"); returns ``kept`` (values
    stored per row). Raises ``ValueError`` naming the shape."""
    shape = f"[{out_features}, {in_features}]"
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"packed delta {shape}: bits must be 2 or 4, got {bits}")
    if out_features <= 0 or in_features <= 0:
        raise ValueError(f"packed delta: shape {shape} must be non-empty")
    if group_size <= 0 or group_size % 4 != 0:
        raise ValueError(f"packed delta {shape}: group_size {group_size} must be a positive multiple of 4")
    if in_features % group_size != 0:
        raise ValueError(
            f"packed delta {shape}: in_features {in_features} is not a multiple of group_size {group_size}"
        )
    if sparse and in_features % 4 != 0:
        raise ValueError(f"packed delta {shape}: 2:4 sparsity needs in_features % 4 == 0")
    kept = in_features // 2 if sparse else in_features
    if (kept * bits) % 32 != 0:
        raise ValueError(
            f"packed delta {shape}: {kept} kept values x {bits} bits per row do not fill whole int32 words "
            f"(need kept*bits % 32 == 0)"
        )
    if sparse and kept % 16 != 0:
        raise ValueError(
            f"packed delta {shape}: 2:4 indices need kept % 16 == 0 (in_features % 32 == 0), kept = {kept}"
        )
    return kept


@dataclass(frozen=True)
class PackedLinear:
    """One compressed linear delta in the packed format (tensors contiguous, on one device)."""

    bits: int
    """Bits per stored code (2 or 4): 32/bits codes share one int32 word of ``qvalues``."""
    sparse: bool
    """True when 2:4-sparse along the input dimension (``qindices`` present, half the columns kept)."""
    group_size: int
    """Input columns sharing one (scale, zero) per row; a multiple of 4 that divides ``in_features``."""
    out_features: int
    """Rows of the HF weight ``[out, in]``."""
    in_features: int
    """Columns of the HF weight ``[out, in]`` (the reduction dimension of ``x @ W.T``)."""
    qvalues: torch.Tensor
    """int32 ``[out, kept*bits/32]``: the kept codes, little end first."""
    qindices: torch.Tensor | None
    """int32 ``[out, kept/16]``: 2-bit position in its group of 4 of each kept value; None when dense."""
    scales: torch.Tensor
    """float16 ``[out, in/group_size]``: per (row, group) quantization step."""
    zeros: torch.Tensor
    """float16 ``[out, in/group_size]``: per (row, group) zero point, in code units."""

    def __post_init__(self) -> None:
        kept = check_layout(self.bits, self.sparse, self.group_size, self.out_features, self.in_features)
        shape = f"[{self.out_features}, {self.in_features}]"
        n_groups = self.in_features // self.group_size
        expect: dict[str, tuple[torch.Tensor | None, tuple[int, int] | None, torch.dtype]] = {
            "qvalues": (self.qvalues, (self.out_features, kept * self.bits // 32), torch.int32),
            "qindices": (self.qindices, (self.out_features, kept // 16) if self.sparse else None, torch.int32),
            "scales": (self.scales, (self.out_features, n_groups), torch.float16),
            "zeros": (self.zeros, (self.out_features, n_groups), torch.float16),
        }
        for name, (t, want, dtype) in expect.items():
            if want is None:
                if t is not None:
                    raise ValueError(f"packed delta {shape}: dense (sparse=False) must have qindices=None")
                continue
            if t is None:
                raise ValueError(f"packed delta {shape}: 2:4-sparse delta is missing {name}")
            if tuple(t.shape) != want:
                raise ValueError(f"packed delta {shape}: {name} has shape {list(t.shape)}, expected {list(want)}")
            if t.dtype != dtype:
                raise ValueError(f"packed delta {shape}: {name} has dtype {t.dtype}, expected {dtype}")

    @property
    def kept(self) -> int:
        """Stored values per row: ``in/2`` when sparse, else ``in``."""
        return self.in_features // 2 if self.sparse else self.in_features

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by suffix (``qvalues``, ``qindices`` when sparse, ``scales``, ``zeros``)."""
        out = {"qvalues": self.qvalues, "scales": self.scales, "zeros": self.zeros}
        if self.qindices is not None:
            out["qindices"] = self.qindices
        return out

    def nbytes(self) -> int:
        """Bytes of all stored tensors (what the delta costs in memory / on disk before lossless coding)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedLinear:
        """The same delta with every tensor on ``device`` (``non_blocking``: as ``Tensor.to``; from pinned
        memory the copies are queued on the current stream and the caller keeps the source until they ran)."""

        def moved(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return PackedLinear(
            self.bits, self.sparse, self.group_size, self.out_features, self.in_features,
            moved(self.qvalues), None if self.qindices is None else moved(self.qindices),
            moved(self.scales), moved(self.zeros),
        )  # fmt: skip


def _pack_words(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] ints in [0, 2^bits) -> int32 [rows, n*bits/32], little end first."""
    per = 32 // bits
    rows, n = vals.shape
    v = vals.to(torch.int64).reshape(rows, n // per, per)
    shifts = torch.arange(per, dtype=torch.int64, device=vals.device) * bits
    words = (v << shifts).sum(dim=-1)  # < 2^32, exact in int64
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement view
    return words.to(torch.int32).contiguous()


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, w] -> int32 [rows, w*32/bits] codes, inverse of ``_pack_words``."""
    per = 32 // bits
    rows, w = words.shape
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    # Arithmetic shifts of the signed words: the mask keeps exactly the code's low bits.
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(rows, w * per)


def pack(
    codes: torch.Tensor,
    mask: torch.Tensor | None,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
) -> PackedLinear:
    """Pack quantized codes (and a 2:4 mask) into a ``PackedLinear`` on the codes' device.

    ``codes`` int ``[out, in]`` in ``[0, 2^bits − 1]`` (ignored where ``mask`` is False);
    ``mask`` bool ``[out, in]`` with exactly 2 True in every group of 4 input columns, or None for
    dense; ``scales`` / ``zeros`` ``[out, in/group_size]`` (stored as float16).
    """
    if codes.dim() != 2:
        raise ValueError(f"pack: codes must be 2-D [out, in], got shape {list(codes.shape)}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.is_complex():
        raise ValueError(f"pack: codes must be an integer tensor, got {codes.dtype} of shape {list(codes.shape)}")
    out_f, in_f = codes.shape
    sparse = mask is not None
    check_layout(bits, sparse, group_size, out_f, in_f)
    shape = f"[{out_f}, {in_f}]"
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (out_f, in_f // group_size):
            raise ValueError(
                f"pack {shape}: {name} has shape {list(t.shape)}, expected {[out_f, in_f // group_size]} "
                f"(group_size {group_size})"
            )
    codes = codes.to(torch.int64)
    if sparse:
        assert mask is not None
        if tuple(mask.shape) != (out_f, in_f) or mask.dtype != torch.bool:
            raise ValueError(
                f"pack {shape}: mask must be bool {list(codes.shape)}, got {mask.dtype} {list(mask.shape)}"
            )
        per_group = mask.reshape(out_f, in_f // 4, 4).sum(dim=-1)
        if not bool((per_group == 2).all()):
            bad = (per_group != 2).nonzero()[0].tolist()
            raise ValueError(
                f"pack {shape}: mask is not 2:4: row {bad[0]} columns [{4 * bad[1]}, {4 * bad[1] + 4}) "
                f"keep {int(per_group[bad[0], bad[1]])} values"
            )
        kept_codes = codes[mask].reshape(out_f, in_f // 2)
        cols = torch.arange(in_f, device=codes.device).expand(out_f, in_f)
        positions = (cols[mask] % 4).reshape(out_f, in_f // 2)
        qindices: torch.Tensor | None = _pack_words(positions, 2)
    else:
        kept_codes = codes
        qindices = None
    lo, hi = int(kept_codes.min()), int(kept_codes.max())
    if lo < 0 or hi > (1 << bits) - 1:
        raise ValueError(f"pack {shape}: codes must lie in [0, {(1 << bits) - 1}] for {bits} bits, got [{lo}, {hi}]")
    return PackedLinear(
        bits=bits,
        sparse=sparse,
        group_size=group_size,
        out_features=out_f,
        in_features=in_f,
        qvalues=_pack_words(kept_codes, bits),
        qindices=qindices,
        scales=scales.to(torch.float16).contiguous(),
        zeros=zeros.to(torch.float16).contiguous(),
    )


def unpack(p: PackedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack``: codes int32 ``[out, in]`` (0 where pruned) and the keep mask bool ``[out, in]``."""
    kept_codes = _unpack_words(p.qvalues, p.bits)
    out_f, in_f = p.out_features, p.in_features
    dev = p.qvalues.device
    if not p.sparse:
        return kept_codes, torch.ones(out_f, in_f, dtype=torch.bool, device=dev)
    assert p.qindices is not None
    positions = _unpack_words(p.qindices, 2).to(torch.int64)  # [out, in/2]
    group_base = torch.arange(in_f // 2, device=dev, dtype=torch.int64) // 2 * 4
    cols = group_base + positions
    codes = torch.zeros(out_f, in_f, dtype=torch.int32, device=dev)
    codes.scatter_(1, cols, kept_codes)
    mask = torch.zeros(out_f, in_f, dtype=torch.bool, device=dev)
    mask.scatter_(1, cols, True)
    return codes, mask


def dequantize(p: PackedLinear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """THE reference value of the delta: ``[out, in]``, ``(code − zero)·scale`` where kept, 0 where pruned.

    Computed in float32 from the float16 scales/zeros, then cast to ``dtype``. Kept values only are
    computed (then scattered to their columns when 2:4), which is ``unpack`` followed by the formula.
    """
    out_f, in_f, g = p.out_features, p.in_features, p.group_size
    kept = _unpack_words(p.qvalues, p.bits).float()
    if not p.sparse:
        value = (kept.reshape(out_f, in_f // g, g) - p.zeros.float().unsqueeze(-1)) * p.scales.float().unsqueeze(-1)
        return value.reshape(out_f, in_f).to(dtype)
    assert p.qindices is not None
    dev = p.qvalues.device
    cols = torch.arange(in_f // 2, device=dev, dtype=torch.int64) // 2 * 4 + _unpack_words(p.qindices, 2).long()
    group = cols // g
    value = (kept - p.zeros.float().gather(1, group)) * p.scales.float().gather(1, group)
    return torch.zeros(out_f, in_f, dtype=torch.float32, device=dev).scatter_(1, cols, value).to(dtype)
