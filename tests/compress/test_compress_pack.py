"""The packed compressed-delta format (deltaserve.formats.packed_delta): exact round-trips, the dequantize
semantics written out by hand, a hand-packed example from the module docstring, and shape refusals."""

from __future__ import annotations

import pytest
import torch

from deltaserve.formats.packed_delta import PackedLinear, dequantize, pack, unpack


def _random_mask(out_f: int, in_f: int, gen: torch.Generator) -> torch.Tensor:
    """A random 2:4 mask along the input dimension."""
    scores = torch.rand(out_f, in_f // 4, 4, generator=gen)
    top = scores.topk(2, dim=-1).indices
    mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool)
    mask.scatter_(-1, top, True)
    return mask.reshape(out_f, in_f)


def _random_case(out_f: int, in_f: int, bits: int, sparse: bool, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=gen, dtype=torch.int32)
    mask = _random_mask(out_f, in_f, gen) if sparse else None
    scales = (torch.rand(out_f, in_f // group, generator=gen) * 0.1 + 1e-3).half()
    zeros = (torch.rand(out_f, in_f // group, generator=gen) * (2**bits - 1)).half()
    return codes, mask, scales, zeros


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize(
    "out_f,in_f,group", [(1, 32, 32), (3, 64, 64), (17, 128, 64), (8, 96, 32), (5, 256, 128), (2, 64, 16)]
)
def test_pack_unpack_round_trip(bits: int, sparse: bool, out_f: int, in_f: int, group: int) -> None:
    codes, mask, scales, zeros = _random_case(out_f, in_f, bits, sparse, group, seed=out_f * 1000 + in_f + bits)
    p = pack(codes, mask, scales, zeros, bits=bits, group_size=group)
    kept = in_f // 2 if sparse else in_f
    assert p.qvalues.dtype == torch.int32 and tuple(p.qvalues.shape) == (out_f, kept * bits // 32)
    if sparse:
        assert p.qindices is not None and tuple(p.qindices.shape) == (out_f, kept // 16)
    else:
        assert p.qindices is None
    assert p.scales.dtype == torch.float16 and p.zeros.dtype == torch.float16
    got_codes, got_mask = unpack(p)
    want_mask = mask if mask is not None else torch.ones(out_f, in_f, dtype=torch.bool)
    assert torch.equal(got_mask, want_mask)
    assert torch.equal(got_codes, torch.where(want_mask, codes, 0))
    assert p.nbytes() == sum(t.numel() * t.element_size() for t in p.tensors().values())
    # Re-packing what came out gives identical words.
    p2 = pack(got_codes, got_mask if sparse else None, p.scales, p.zeros, bits=bits, group_size=group)
    for name, t in p.tensors().items():
        assert torch.equal(t, p2.tensors()[name]), name


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("sparse", [True, False])
def test_dequantize_semantics(bits: int, sparse: bool) -> None:
    out_f, in_f, group = 6, 128, 32
    codes, mask, scales, zeros = _random_case(out_f, in_f, bits, sparse, group, seed=7 + bits)
    p = pack(codes, mask, scales, zeros, bits=bits, group_size=group)
    got = dequantize(p)
    assert got.dtype == torch.float32 and tuple(got.shape) == (out_f, in_f)
    for r in range(out_f):
        for c in range(in_f):
            kept = True if mask is None else bool(mask[r, c])
            g = c // group
            want = (float(codes[r, c]) - float(zeros[r, g])) * float(scales[r, g]) if kept else 0.0
            assert float(got[r, c]) == pytest.approx(want, rel=1e-6, abs=1e-7), (r, c)
    if sparse:
        assert (got.reshape(out_f, in_f // 4, 4) != 0).sum(-1).max() <= 2
    assert dequantize(p, torch.float16).dtype == torch.float16


def test_hand_packed_words_match_docstring_example() -> None:
    # 4-bit 2:4, in = 32, row 0 keeps columns {0, 3, 5, 6, ...} with codes {7, 1, 15, 2, 0...}.
    in_f = 32
    mask = torch.zeros(1, in_f, dtype=torch.bool)
    codes = torch.zeros(1, in_f, dtype=torch.int32)
    for col, code in [(0, 7), (3, 1), (5, 15), (6, 2)]:
        mask[0, col] = True
        codes[0, col] = code
    for g in range(2, in_f // 4):  # remaining groups keep positions 0 and 1 with code 0
        mask[0, 4 * g] = mask[0, 4 * g + 1] = True
    p = pack(codes, mask, torch.ones(1, 1), torch.zeros(1, 1), bits=4, group_size=32)
    assert int(p.qvalues[0, 0]) == 7 | 1 << 4 | 15 << 8 | 2 << 12
    assert int(p.qindices[0, 0]) & 0xFF == 0 | 3 << 2 | 1 << 4 | 2 << 6  # type: ignore[index]
    # Top bit set: word 0 of an all-15 row is 0xFFFFFFFF, read back as int32 -1.
    full = pack(torch.full((1, 8), 15), None, torch.ones(1, 1), torch.zeros(1, 1), bits=4, group_size=8)
    assert int(full.qvalues[0, 0]) == -1
    assert torch.equal(unpack(full)[0], torch.full((1, 8), 15, dtype=torch.int32))


@pytest.mark.parametrize(
    "shape,bits,group,sparse,match",
    [
        ((4, 48), 4, 16, True, r"\[4, 48\].*in_features % 32"),  # kept 24 not a multiple of 16
        ((4, 64), 4, 48, False, r"\[4, 64\].*group_size 48"),  # G does not divide in
        ((4, 64), 4, 6, False, r"\[4, 64\].*multiple of 4"),  # G not a multiple of 4
        ((4, 4), 4, 4, False, r"\[4, 4\].*int32 words"),  # 4 values x 4 bits = 16 bits
        ((4, 64), 3, 64, False, r"\[4, 64\].*bits must be 2 or 4"),
    ],
)
def test_bad_shapes_raise_naming_the_shape(shape, bits: int, group: int, sparse: bool, match: str) -> None:
    out_f, in_f = shape
    codes = torch.zeros(out_f, in_f, dtype=torch.int32)
    mask = None
    if sparse:
        mask = torch.zeros(out_f, in_f, dtype=torch.bool)
        mask[:, 0::4] = True
        mask[:, 1::4] = True
    n_groups = max(1, in_f // group)
    with pytest.raises(ValueError, match=match):
        pack(codes, mask, torch.ones(out_f, n_groups), torch.zeros(out_f, n_groups), bits=bits, group_size=group)


def test_bad_inputs_raise() -> None:
    codes = torch.zeros(4, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"scales has shape \[4, 2\], expected \[4, 1\]"):
        pack(codes, None, torch.ones(4, 2), torch.zeros(4, 1), bits=4, group_size=64)
    mask = torch.zeros(4, 64, dtype=torch.bool)
    mask[:, 0::4] = True
    with pytest.raises(ValueError, match=r"not 2:4: row 0 columns \[0, 4\) keep 1"):
        pack(codes, mask, torch.ones(4, 1), torch.zeros(4, 1), bits=4, group_size=64)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 3\]"):
        pack(torch.full((4, 64), 4), None, torch.ones(4, 1), torch.zeros(4, 1), bits=2, group_size=64)
    with pytest.raises(ValueError, match="2-D"):
        pack(torch.zeros(64, dtype=torch.int32), None, torch.ones(1, 1), torch.zeros(1, 1), bits=4, group_size=64)
    # The dataclass itself checks tensor shapes (what a reader builds from a file).
    good = pack(codes, None, torch.ones(4, 1), torch.zeros(4, 1), bits=4, group_size=64)
    with pytest.raises(ValueError, match=r"qvalues has shape \[4, 7\], expected \[4, 8\]"):
        PackedLinear(4, False, 64, 4, 64, good.qvalues[:, :7], None, good.scales, good.zeros)
    with pytest.raises(ValueError, match="missing qindices"):
        PackedLinear(4, True, 64, 4, 64, good.qvalues[:, :4], None, good.scales, good.zeros)
