"""The SBMM kernel (``deltaserve.kernels.sbmm``): Triton kernel = torch reference = dense per-token delta.

Three checks:

- the Triton kernel equals ``sbmm_ref`` for 2 and 4 bits, with and without 2:4 sparsity, over the
  delta-popularity shapes of Punica's tests (identical: one delta; distinct: every request its own;
  uniform: ceil(sqrt(n)) deltas; skewed: Zipf-1.5 draws) with base-only requests (-1) mixed in, for
  prefill segments (1..40 tokens, so both work-tile sizes run) and decode rows, float32 / float16 /
  bfloat16, input widths 64 / 96 / 128 / 192 (partial K tiles), output widths that are not a multiple of
  the column tile, and group sizes 32 / 64 / 128 / 96 (every path that loads scales);
- the reference equals ``x @ dequantize(p).T`` computed per token from the original ``PackedLinear``s
  (not from the pool), so the pool layout, the slot mapping and the empty slot are checked too; the
  kernel follows the offset tables (slot regions permuted in the buffers);
- dense segments (a long prefill segment's delta dequantised once by ``dequantize_slot``, one
  matmul): ``dequantize_slot`` equals ``pack.dequantize`` bit for bit, and metadata mixing dense
  segments with work tiles equals the reference over the popularity shapes (CUDA op too, on CUDA);
- bad metadata, mismatched shapes and pools get ``ValueError``s naming the problem.

On CPU the kernel runs under the Triton interpreter; with ``DELTASERVE_TEST_GPU=1`` on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import zlib

import numpy as np
import pytest
import torch

from deltaserve.formats.packed_delta import PackedLinear, dequantize, pack
from deltaserve.kernels import sbmm as sbmm_mod
from deltaserve.kernels.common import sm_count
from deltaserve.kernels.sbmm import (
    DeltaMeta,
    DeltaWeights,
    dequantize_at,
    dequantize_slot,
    make_delta_weights,
    sbmm,
    sbmm_ref,
    sbmm_triton,
)
from deltaserve.kernels.sbmm import cuda as sbmm_cuda_mod

pytestmark = pytest.mark.gpu_sbmm  # `make test-gpu-sbmm` selects it on a GPU

DEVICE = torch.device("cuda" if os.environ.get("DELTASERVE_TEST_GPU") == "1" else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POPULARITY = ["identical", "distinct", "uniform", "skewed"]
SHAPES = [(64, 48, 64), (96, 80, 32), (128, 40, 128), (192, 24, 96)]
"""(in_features, out_features, group_size): K tiles only partly filled; group sizes for each scale
path (whole groups broadcast, one scale per row of a tile, gathered per column at G = 96); output
widths off the 32 / 64-column tiles."""
NUM_SLOTS = 6
EMPTY_SLOT = 4
"""A slot left empty (None) in every pool: requests never pick it."""
# Kernel vs reference: both round Δ̃ to x's dtype, accumulate in fp32 and round once; only the
# summation order differs, so outputs differ by about one unit in the last place of the dtype.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def retarget(static: DeltaMeta, new: DeltaMeta) -> None:
    """A step's device metadata copied into the static tensors a captured launch reads (the same grid):
    what a replay of another step's rows does (``adapters.delta_graphs`` for the worker's graphs)."""
    assert new.grid_tiles == static.grid_tiles, "a captured launch keeps its grid"
    assert static.order is not None and static.tiles is not None and static.tile_count is not None
    assert new.order is not None and new.tiles is not None and new.tile_count is not None
    static.order.copy_(new.order)
    static.tiles.copy_(new.tiles)
    static.tile_count.copy_(new.tile_count)


def random_packed(
    out_f: int, in_f: int, bits: int, sparse: bool, group: int, seed: int, integral_zeros: bool = False
) -> PackedLinear:
    """Random codes / 2:4 mask / scales / fractional zeros (or integral ones, as the compressor writes
    them), packed by packed_delta.py."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g)
    mask = None
    if sparse:
        keep = torch.rand(out_f, in_f // 4, 4, generator=g).argsort(-1)[..., :2]
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(out_f, in_f)
    scales = torch.rand(out_f, in_f // group, generator=g) * 0.05 + 0.005
    zeros = torch.rand(out_f, in_f // group, generator=g) * (2**bits - 1)
    if integral_zeros:
        zeros = zeros.round()
    return pack(codes, mask, scales, zeros, bits, group).to(DEVICE)


@functools.cache
def deltas(
    bits: int, sparse: bool, shape: tuple[int, int, int], integral_zeros: bool = False
) -> tuple[PackedLinear | None, ...]:
    in_f, out_f, group = shape
    seed = zlib.crc32(f"{bits}/{sparse}/{shape}".encode())
    return tuple(None if s == EMPTY_SLOT else random_packed(out_f, in_f, bits, sparse, group, seed + s, integral_zeros)
                 for s in range(NUM_SLOTS))  # fmt: skip


def pool(bits: int, sparse: bool, shape: tuple[int, int, int], integral_zeros: bool = False) -> DeltaWeights:
    return make_delta_weights(deltas(bits, sparse, shape, integral_zeros))


def request_deltas(popularity: str, n: int, seed: int, base_every: int = 4) -> list[int]:
    """Delta slot of each of ``n`` requests (never EMPTY_SLOT); every ``base_every``-th has none (-1)."""
    rng = np.random.default_rng(seed)
    slots = [s for s in range(NUM_SLOTS) if s != EMPTY_SLOT]
    if popularity == "identical":
        ids = [slots[2]] * n
    elif popularity == "distinct":
        ids = [slots[i % len(slots)] for i in rng.permutation(n)]
    elif popularity == "uniform":
        k = math.ceil(math.sqrt(n))
        ids = [slots[int(i) % k] for i in rng.permutation(n)]
    elif popularity == "skewed":  # Zipf-1.5 over the slots: a few deltas take most requests
        p = 1.0 / np.arange(1, len(slots) + 1) ** 1.5
        ids = [slots[int(i)] for i in rng.choice(len(slots), size=n, p=p / p.sum())]
    else:
        raise AssertionError(popularity)
    return [-1 if base_every and i % base_every == base_every - 1 else a for i, a in enumerate(ids)]


def make_meta(mode: str, slots: list[int], seed: int) -> DeltaMeta:
    """segments: one segment per request of 1..40 tokens; rows: one row each."""
    if mode == "rows":
        return DeltaMeta.rows(slots, DEVICE)
    lens = [int(n) for n in np.random.default_rng(seed).integers(1, 41, size=len(slots))]
    return DeltaMeta.segments(lens, slots, DEVICE)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def token_deltas(meta: DeltaMeta) -> list[int]:
    out = []
    for s, d in enumerate(meta.seg_delta_host):
        out += [d] * (meta.seg_start_host[s + 1] - meta.seg_start_host[s])
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=RTOL[want.dtype], atol=ATOL[want.dtype])


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "2:4"])
@pytest.mark.parametrize("bits", [2, 4])
def test_kernel_equals_reference(bits: int, sparse: bool, dtype: torch.dtype, popularity: str) -> None:
    for mode in ("segments", "rows"):
        seed = zlib.crc32(f"{bits}/{sparse}/{dtype}/{popularity}/{mode}".encode()) % 10_000
        shape = SHAPES[seed % len(SHAPES)]
        w = pool(bits, sparse, shape)
        meta = make_meta(mode, request_deltas(popularity, 6 if mode == "segments" else 12, seed), seed)
        x = randn(meta.num_tokens, shape[0], dtype=dtype, seed=seed + 1)
        base = randn(meta.num_tokens, shape[1], dtype=dtype, seed=seed + 2)

        want = sbmm_ref(x, base.clone(), w, meta)
        got = sbmm_triton(x, base.clone(), w, meta)
        close(got, want)
        ids = torch.tensor(token_deltas(meta), device=DEVICE)
        assert torch.equal(got[ids < 0], base[ids < 0]), "tokens without a delta must keep out unchanged"
        assert not torch.equal(want[ids >= 0], base[ids >= 0])


@pytest.mark.parametrize("shape", SHAPES, ids=[f"in{i}-out{o}-g{g}" for i, o, g in SHAPES])
@pytest.mark.parametrize("config", [(2, False), (2, True), (4, False), (4, True)], ids=["2b", "2b-2:4", "4b", "4b-2:4"])
def test_shapes_and_long_segments(config: tuple[int, bool], shape: tuple[int, int, int]) -> None:
    """Every shape with every config, float16, segments longer than one 64-token work tile."""
    bits, sparse = config
    w = pool(bits, sparse, shape)
    meta = DeltaMeta.segments([70, 3, 17, 1], [1, -1, 3, 1], DEVICE)
    # slot 1: tokens 0..69 and 90 (one run of 71 = 64 + 7 in ``order``), slot 3: 17 tokens
    assert meta.block_m == 64 and meta.num_tiles == 3
    assert meta.order.tolist() == [*range(70), 90, *range(73, 90), 0, 0, 0]  # padded to T
    x = randn(meta.num_tokens, shape[0], dtype=torch.float16, seed=1)
    base = randn(meta.num_tokens, shape[1], dtype=torch.float16, seed=2)
    close(sbmm(x, base.clone(), w, meta, use_triton=True), sbmm(x, base.clone(), w, meta, use_triton=False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [(2, False), (2, True), (4, False), (4, True)], ids=["2b", "2b-2:4", "4b", "4b-2:4"])
def test_dequantize_slot_equals_dequantize(config: tuple[int, bool], dtype: torch.dtype) -> None:
    """Every loaded slot of every shape (each scale path, partial column tiles), bit for bit, by the CUDA
    op (on CUDA, float16 / bfloat16) and the Triton kernel; into a reused ``out``; named by its offsets
    on the device (``dequantize_at``) too; an empty slot, a wrong ``out`` and wrong offsets are refused."""
    bits, sparse = config
    for shape in SHAPES:
        w = pool(bits, sparse, shape)
        scratch = torch.full((shape[1], shape[0]), float("nan"), dtype=dtype, device=DEVICE)
        for s, p in enumerate(deltas(bits, sparse, shape)):
            if p is None:
                with pytest.raises(ValueError, match=f"slot {s} holds no delta"):
                    dequantize_slot(w, s, dtype)
                continue
            want = dequantize(p, dtype)
            for kw in ({}, {"use_triton": True}):  # on CUDA: csrc/sbmm.cu's deltaserve_dequant, then Triton
                assert torch.equal(dequantize_slot(w, s, dtype, **kw), want), (shape, s, kw)
                scratch.fill_(float("nan"))
                assert dequantize_slot(w, s, dtype, out=scratch, **kw) is scratch and torch.equal(scratch, want)
            # The same slot named by its offsets on the device (a captured dense lane's device-side slot).
            offsets = torch.tensor([o[s] for o in w.slot_offsets], dtype=torch.int64, device=DEVICE)
            for kw in ({}, {"use_triton": True}):
                scratch.fill_(float("nan"))
                if kw and w.repacked:  # the Triton kernel reads a repacked slot only once unpacked on the host
                    with pytest.raises(ValueError, match="repacked pool needs csrc"):
                        dequantize_at(w, offsets, dtype, scratch, **kw)
                    continue
                assert dequantize_at(w, offsets, dtype, scratch, **kw) is scratch, (shape, s, kw)
                assert torch.equal(scratch, want), (shape, s, kw)
        with pytest.raises(ValueError, match="dequantize_at offsets"):
            dequantize_at(w, offsets[:2], dtype, scratch)
    with pytest.raises(ValueError, match="dequantize_slot out"):
        dequantize_slot(w, 0, dtype, out=scratch[:, :-1])
    with pytest.raises(ValueError, match="dequantize_slot dtype"):
        dequantize_slot(w, 0, torch.int32)


def test_dense_segments_metadata() -> None:
    """Segments of at least ``dense_min_m`` tokens of a delta go to ``dense`` (sorted by slot), the
    rest to work tiles; ``slot_tokens`` (the reference's groups, the slot checks) keeps them all."""
    meta = DeltaMeta.segments([40, 3, 20, 1, 16], [0, 1, 0, -1, 2], DEVICE, max_block_m=16, dense_min_m=16)
    assert meta.dense == ((0, 40, 0), (43, 63, 0), (64, 80, 2))
    assert meta.tiles.tolist() == [[0, 3, 1]] and meta.num_tiles == 1 and meta.num_delta_tokens == 3
    assert meta.order.tolist()[:3] == [40, 41, 42]
    assert meta.slots == {0, 1, 2} and dict(meta.slot_tokens)[0] == (*range(40), *range(43, 63))
    assert DeltaMeta.segments([40], [0], DEVICE).dense == ()
    with pytest.raises(ValueError, match="dense_min_m 0"):
        DeltaMeta.segments([40], [0], DEVICE, dense_min_m=0)


def test_dense_segments_into_a_column_slice() -> None:
    """A fused projection's slice of the output (rows strided by the full width), as ``DeltaLinear``
    passes it: dense segments and tiles update only the slice."""
    shape = SHAPES[1]
    w = pool(4, True, shape)
    meta = DeltaMeta.segments([20, 3, 17], [0, 1, 0], DEVICE, max_block_m=16, dense_min_m=16)
    x = randn(meta.num_tokens, shape[0], dtype=torch.float16, seed=5)
    wide = randn(meta.num_tokens, shape[1] + 24, dtype=torch.float16, seed=6)
    want = wide.clone()
    sbmm_ref(x, want[:, 8 : 8 + shape[1]], w, meta)
    got = wide.clone()
    sbmm_triton(x, got[:, 8 : 8 + shape[1]], w, meta)
    close(got, want)
    assert torch.equal(got[:, :8], wide[:, :8]) and torch.equal(got[:, 8 + shape[1] :], wide[:, 8 + shape[1] :])


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("config", [(2, False), (2, True), (4, False), (4, True)], ids=["2b", "2b-2:4", "4b", "4b-2:4"])
def test_dense_segments_equal_reference(config: tuple[int, bool], popularity: str) -> None:
    """Prefill segments of 1..40 tokens, those of >= 16 dense, the others in work tiles, float16 and
    bfloat16: the Triton kernels (and, on CUDA, the CUDA op) equal ``sbmm_ref``; base tokens unchanged."""
    bits, sparse = config
    for dtype in (torch.float16, torch.bfloat16):
        seed = zlib.crc32(f"dense/{bits}/{sparse}/{dtype}/{popularity}".encode()) % 10_000
        shapes = [SHAPES[seed % len(SHAPES)]]
        impls = [sbmm_triton]
        if DEVICE.type == "cuda" and sbmm_mod.cuda_ext.library("sbmm") is not None:
            shapes.append(CUDA_SHAPES[seed % len(CUDA_SHAPES)])
        for shape in shapes:
            w = pool(bits, sparse, shape)
            slots = request_deltas(popularity, 6, seed)
            rng = np.random.default_rng(seed)  # even segments long (dense), odd ones short (tiles)
            lens = [int(rng.integers(16, 41) if i % 2 == 0 else rng.integers(1, 16)) for i in range(len(slots))]
            meta = DeltaMeta.segments(lens, slots, DEVICE, max_block_m=16, dense_min_m=16)
            assert meta.dense and meta.num_tiles, "the draw must mix dense segments and work tiles"
            x = randn(meta.num_tokens, shape[0], dtype=dtype, seed=seed + 1)
            base = randn(meta.num_tokens, shape[1], dtype=dtype, seed=seed + 2)
            want = sbmm_ref(x, base.clone(), w, meta)
            ids = torch.tensor(token_deltas(meta), device=DEVICE)
            for impl in impls + ([sbmm_mod.sbmm_cuda] if shape in CUDA_SHAPES else []):
                got = impl(x, base.clone(), w, meta)
                close(got, want)
                assert torch.equal(got[ids < 0], base[ids < 0]), "tokens without a delta must keep out unchanged"


@pytest.mark.parametrize("run", [1, 2, 3, 4])
@pytest.mark.parametrize("config", [(2, False), (2, True), (4, False), (4, True)], ids=["2b", "2b-2:4", "4b", "4b-2:4"])
def test_fma_tiles_and_scale_paths(config: tuple[int, bool], run: int) -> None:
    """Decode runs of 1..4 rows per delta take the FMA tiles (BLOCK_M 1, 2, 4), over group sizes that
    load scales once per row of a K tile (G = 128), per qvalues word (G = 32) and per plane (G = 24)."""
    bits, sparse = config
    for shape in ((128, 40, 128), (64, 48, 32), (96, 56, 24)):
        w = pool(bits, sparse, shape)
        slots = [0, -1] * run + [3] * max(run - 1, 1)
        meta = DeltaMeta.rows(slots, DEVICE)
        assert meta.block_m == 1 << (run - 1).bit_length()
        x = randn(meta.num_tokens, shape[0], dtype=torch.bfloat16, seed=run)
        base = randn(meta.num_tokens, shape[1], dtype=torch.bfloat16, seed=run + 1)
        close(sbmm_triton(x, base.clone(), w, meta), sbmm_ref(x, base.clone(), w, meta))


@pytest.mark.parametrize("split", [2, 3])
def test_fma_tiles_split_k(split: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """FMA tiles whose reduction is split over programs (partials summed by a second launch) equal the
    reference, with K tiles of 32 columns so every split holds several (and the last one fewer)."""
    for bm in (1, 2, 4):
        monkeypatch.setitem(
            sbmm_mod.LAUNCH, bm, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2, "SPLIT_K": split}
        )
    meta = DeltaMeta.rows([1, -1, 1, 3, 0, 3, 3, -1], DEVICE)
    for bits, sparse in ((2, True), (4, True), (4, False)):
        shape = SHAPES[3]
        w = pool(bits, sparse, shape)
        assert sbmm_mod.launch_config(meta, w)["SPLIT_K"] == split
        x = randn(meta.num_tokens, shape[0], dtype=torch.float16, seed=1)
        base = randn(meta.num_tokens, shape[1], dtype=torch.float16, seed=2)
        got = sbmm_triton(x, base.clone(), w, meta)
        close(got, sbmm_ref(x, base.clone(), w, meta))
        assert torch.equal(got[[1, 7]], base[[1, 7]])


@pytest.mark.parametrize("block", [(16, 32), (64, 128), (32, 256)], ids=["n16-k32", "n64-k128", "n32-k256"])
def test_other_launch_configs(block: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The configs ``bench_sbmm.py --tune`` sweeps stay right (K tiles spanning several groups)."""
    block_n, block_k = block
    for bm in sbmm_mod.LAUNCH:
        monkeypatch.setitem(
            sbmm_mod.LAUNCH, bm, {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 2}
        )
    meta = DeltaMeta.segments([20, 2, 5, 3], [0, -1, 3, 0], DEVICE)
    for bits, sparse in ((2, True), (4, False)):
        for shape in SHAPES:
            w = pool(bits, sparse, shape)
            x = randn(meta.num_tokens, shape[0], dtype=torch.float16, seed=1)
            base = randn(meta.num_tokens, shape[1], dtype=torch.float16, seed=2)
            close(sbmm_triton(x, base.clone(), w, meta), sbmm_ref(x, base.clone(), w, meta))


@pytest.mark.parametrize("mode", ["segments", "rows"])
@pytest.mark.parametrize("config", [(2, True), (4, False)], ids=["2b-2:4", "4b"])
def test_reference_equals_dense_delta(config: tuple[int, bool], mode: str) -> None:
    """Reference (pool views) = per-token ``out + x @ dequantize(p).T`` from the original deltas, float32."""
    bits, sparse = config
    shape = SHAPES[1]
    meta = make_meta(mode, request_deltas("skewed", 10, 3), 3)
    x = randn(meta.num_tokens, shape[0], dtype=torch.float32, seed=1)
    base = randn(meta.num_tokens, shape[1], dtype=torch.float32, seed=2)
    want = base.clone()
    for t, d in enumerate(token_deltas(meta)):
        if d >= 0:
            want[t] += dequantize(deltas(bits, sparse, shape)[d]) @ x[t]
    got = sbmm(x, base.clone(), pool(bits, sparse, shape), meta, use_triton=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def permuted_pool(shape: tuple[int, int, int]) -> tuple[DeltaWeights, DeltaWeights, DeltaMeta, DeltaMeta]:
    """A 4-bit 2:4 pool ``w``, the same buffers with the slot regions permuted (``wp``), and one step's
    metadata for each that selects the same deltas."""
    w = pool(4, True, shape)
    perm = [3, 0, 5, 1, 4, 2]  # slot s of the permuted pool = slot perm[s] of w
    wp = DeltaWeights(w.qvalues, w.qindices, w.scales, w.zeros, w.qvalues_offsets[perm], w.qindices_offsets[perm],
                      w.group_offsets[perm], w.bits, w.sparse, w.group_size, w.out_features, w.in_features,
                      loaded=[w.loaded[p] for p in perm])  # fmt: skip
    slots = [1, 1, 0, -1, 5, 3, 2]
    meta_p = DeltaMeta.segments([2, 5, 3, 1, 4, 2, 6], slots, DEVICE)
    meta = DeltaMeta.segments([2, 5, 3, 1, 4, 2, 6], [perm[s] if s >= 0 else -1 for s in slots], DEVICE)
    return w, wp, meta, meta_p


def test_kernel_follows_offset_tables() -> None:
    """Slot regions permuted in the buffers: the kernel reads the tables, not slot * size."""
    w, wp, meta, meta_p = permuted_pool(SHAPES[0])
    x = randn(meta.num_tokens, 64, dtype=torch.float32, seed=1)
    base = randn(meta.num_tokens, 48, dtype=torch.float32, seed=2)
    close(sbmm_triton(x, base.clone(), wp, meta_p), sbmm_ref(x, base.clone(), w, meta))


def test_decode_rows_share_tiles() -> None:
    """The rows of one slot share a work tile wherever they sit; the decode grid is T tiles whatever the slots."""
    meta = DeltaMeta.rows([2, 2, 2, -1, 0, 0, 2, -1], DEVICE)
    assert meta.grid_tiles == 8 and meta.num_tiles == 2 and meta.block_m == 4  # runs of 4 and 2: FMA tiles
    assert meta.order.tolist() == [0, 1, 2, 6, 4, 5, 0, 0]
    assert meta.tiles.tolist()[:3] == [[0, 4, 2], [4, 6, 0], [0, 0, -1]]
    assert meta.slots == {0, 2}
    w = pool(2, False, SHAPES[2])
    x = randn(8, SHAPES[2][0], dtype=torch.bfloat16, seed=1)
    base = randn(8, SHAPES[2][1], dtype=torch.bfloat16, seed=2)
    close(sbmm_triton(x, base.clone(), w, meta), sbmm_ref(x, base.clone(), w, meta))


def test_only_base_tokens_and_empty_segments_are_no_ops() -> None:
    w = pool(4, False, SHAPES[0])
    meta = DeltaMeta.segments([3, 0, 4], [-1, 0, -1], DEVICE)
    assert meta.num_tiles == 0 and meta.slots == frozenset()
    x, base = randn(7, 64, dtype=torch.float16, seed=1), randn(7, 48, dtype=torch.float16, seed=2)
    for use_triton in (True, False):
        assert torch.equal(sbmm(x, base.clone(), w, meta, use_triton=use_triton), base)


def test_store_and_clear_refill_a_slot_in_place() -> None:
    w = make_delta_weights(deltas(2, True, SHAPES[0]))  # a fresh pool: this test changes it
    ptr = w.qvalues.data_ptr()
    new = random_packed(48, 64, 2, True, 64, seed=99)
    w.store(EMPTY_SLOT, new)
    assert w.qvalues.data_ptr() == ptr and w.loaded[EMPTY_SLOT]
    meta = DeltaMeta.rows([EMPTY_SLOT, 0, EMPTY_SLOT], DEVICE)
    x, base = randn(3, 64, dtype=torch.float32, seed=1), randn(3, 48, dtype=torch.float32, seed=2)
    got = sbmm_triton(x, base.clone(), w, meta)
    torch.testing.assert_close(got[0], base[0] + dequantize(new) @ x[0], rtol=1e-5, atol=1e-5)
    close(got, sbmm_ref(x, base.clone(), w, meta))
    w.clear(EMPTY_SLOT)
    for use_triton in (True, False):
        with pytest.raises(ValueError, match=f"delta slot {EMPTY_SLOT} holds no delta"):
            sbmm(x, base.clone(), w, meta, use_triton=use_triton)


def test_reference_cache_follows_store_and_clear() -> None:
    """The CPU serving path's cache of dequantised slots gives the uncached result, and a slot
    refilled or cleared through ``store`` / ``clear`` is never served from a stale entry."""
    w = make_delta_weights(deltas(4, True, SHAPES[0]))
    w.cache_reference()
    meta = DeltaMeta.rows([0, 1, 0], DEVICE)
    x, base = randn(3, 64, dtype=torch.float32, seed=3), randn(3, 48, dtype=torch.float32, seed=4)
    want = sbmm_ref(x, base.clone(), make_delta_weights(deltas(4, True, SHAPES[0])), meta)
    assert torch.equal(sbmm_ref(x, base.clone(), w, meta), want)
    assert sorted(w.ref_cache) == [(0, torch.float32), (1, torch.float32)]
    assert torch.equal(sbmm_ref(x, base.clone(), w, meta), want)  # from the cache
    new = random_packed(48, 64, 4, True, 64, seed=98)
    w.store(0, new)
    got = sbmm_ref(x, base.clone(), w, meta)
    torch.testing.assert_close(got[0], base[0] + dequantize(new) @ x[0], rtol=1e-5, atol=1e-5)
    w.clear(1)
    assert (1, torch.float32) not in w.ref_cache
    with pytest.raises(ValueError, match="delta slot 1 holds no delta"):
        sbmm_ref(x, base.clone(), w, meta)


def test_non_contiguous_x() -> None:
    w = pool(4, True, SHAPES[0])
    meta = DeltaMeta.rows([0, 1, -1, 2], DEVICE)
    wide = randn(4, 128, dtype=torch.float32, seed=1)
    x = wide[:, ::2]  # stride 2 in the last dim
    base = randn(4, 48, dtype=torch.float32, seed=2)
    close(sbmm_triton(x, base.clone(), w, meta), sbmm_ref(x.contiguous(), base.clone(), w, meta))


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def small() -> tuple[DeltaWeights, torch.Tensor, torch.Tensor]:
    x, out = randn(4, 64, dtype=torch.float32, seed=1), randn(4, 48, dtype=torch.float32, seed=2)
    return pool(4, False, SHAPES[0]), x, out


@pytest.mark.parametrize("use_triton", [True, False])
def test_slot_out_of_range(small, use_triton: bool) -> None:
    w, x, out = small
    meta = DeltaMeta.rows([0, NUM_SLOTS, -1, 1], DEVICE)
    with pytest.raises(ValueError, match=f"delta slot {NUM_SLOTS} out of range"):
        sbmm(x, out, w, meta, use_triton=use_triton)
    with pytest.raises(ValueError, match="delta slot -2 out of range"):
        DeltaMeta.segments([2, 2], [0, -2], DEVICE)


@pytest.mark.parametrize("use_triton", [True, False])
def test_empty_slot_refused(small, use_triton: bool) -> None:
    w, x, out = small
    meta = DeltaMeta.rows([0, EMPTY_SLOT, -1, 1], DEVICE)
    before = out.clone()
    with pytest.raises(ValueError, match=f"delta slot {EMPTY_SLOT} holds no delta"):
        sbmm(x, out, w, meta, use_triton=use_triton)
    assert torch.equal(out, before), "a refused call changes nothing"


def test_bad_segments() -> None:
    with pytest.raises(ValueError, match="2 segment lengths but 1 segment deltas"):
        DeltaMeta.segments([1, 2], [0], DEVICE)
    with pytest.raises(ValueError, match="negative segment length"):
        DeltaMeta.segments([1, -2], [0, 1], DEVICE)


@pytest.mark.parametrize("use_triton", [True, False])
def test_shape_and_dtype_mismatches(small, use_triton: bool) -> None:
    w, x, out = small
    meta = DeltaMeta.rows([0, 1, 2], DEVICE)  # 3 tokens, x has 4
    with pytest.raises(ValueError, match=r"x \[4, 64\] must be \[T = 3, in_features\]"):
        sbmm(x, out, w, meta, use_triton=use_triton)
    meta = DeltaMeta.rows([0, 1, 2, 3], DEVICE)
    with pytest.raises(ValueError, match="x has 32 columns, the deltas want in_features = 64"):
        sbmm(x[:, :32], out, w, meta, use_triton=use_triton)
    with pytest.raises(ValueError, match=r"out \[4, 40\] must be \[T = 4, out_features = 48\]"):
        sbmm(x, out[:, :40], w, meta, use_triton=use_triton)
    with pytest.raises(ValueError, match="dtype mismatch: x torch.float32, out torch.float16"):
        sbmm(x, out.half(), w, meta, use_triton=use_triton)
    with pytest.raises(ValueError, match="x dtype torch.float64"):
        sbmm(x.double(), out.double(), w, meta, use_triton=use_triton)


def test_pool_config_mismatches() -> None:
    a = random_packed(48, 64, 4, False, 64, 1)
    with pytest.raises(ValueError, match="slot 2 has bits = 2, the pool has 4"):
        make_delta_weights([a, None, random_packed(48, 64, 2, False, 64, 2)])
    with pytest.raises(ValueError, match="slot 1 has sparse = True, the pool has False"):
        make_delta_weights([a, random_packed(48, 64, 4, True, 64, 2)])
    with pytest.raises(ValueError, match="slot 1 has out_features = 32, the pool has 48"):
        make_delta_weights([a, random_packed(32, 64, 4, False, 64, 2)])
    with pytest.raises(ValueError, match="needs at least one delta"):
        make_delta_weights([None, None])
    w = make_delta_weights([a, None])
    with pytest.raises(ValueError, match="slot 1 has group_size = 32, the pool has 64"):
        w.store(1, random_packed(48, 64, 4, False, 32, 3))
    with pytest.raises(ValueError, match="delta slot 2 out of range"):
        w.store(2, a)


def test_bad_pool_tables() -> None:
    w = pool(2, True, SHAPES[0])
    offs = w.qindices_offsets.clone()
    offs[3] = w.qindices.numel() - 1
    with pytest.raises(ValueError, match=r"slot 3's qindices block \[.*\) is outside the"):
        DeltaWeights(w.qvalues, w.qindices, w.scales, w.zeros, w.qvalues_offsets, offs, w.group_offsets,
                     w.bits, w.sparse, w.group_size, w.out_features, w.in_features)  # fmt: skip
    with pytest.raises(ValueError, match="qvalues_offsets"):
        DeltaWeights(w.qvalues, w.qindices, w.scales, w.zeros, w.qvalues_offsets.int(), w.qindices_offsets,
                     w.group_offsets, w.bits, w.sparse, w.group_size, w.out_features, w.in_features)  # fmt: skip
    with pytest.raises(ValueError, match="pool scales"):
        DeltaWeights(w.qvalues, w.qindices, w.scales.float(), w.zeros, w.qvalues_offsets, w.qindices_offsets,
                     w.group_offsets, w.bits, w.sparse, w.group_size, w.out_features, w.in_features)  # fmt: skip
    with pytest.raises(ValueError, match="bits must be 2 or 4, got 3"):
        DeltaWeights(w.qvalues, w.qindices, w.scales, w.zeros, w.qvalues_offsets, w.qindices_offsets,
                     w.group_offsets, 3, w.sparse, w.group_size, w.out_features, w.in_features)  # fmt: skip


# ----------------------------------------------------------------------------- the CUDA C++ op (csrc/sbmm.cu)

CUDA_SHAPES = [(256, 48, 64), (512, 40, 128), (768, 200, 32), (1024, 136, 64)]
"""(in, out, group) the CUDA op takes (in % 256 == 0, group 32 / 64 / 128): one to four stages, one or
two 128-row blocks with a partial last one."""


def test_integral_zero_flags_follow_each_store() -> None:
    """``store`` records per slot whether every zero is an integer in (-1024, 1024) (the CUDA op's half2
    dequantisation is exact only then), in the device flags the op reads per block."""
    shape = CUDA_SHAPES[0]
    w = pool(4, True, shape, integral_zeros=True)
    assert w.half2_ok.device == w.qvalues.device
    assert w.half2_ok.tolist() == [int(s != EMPTY_SLOT) for s in range(NUM_SLOTS)]  # the empty slot: never stored
    frac = deltas(4, True, shape)[1]
    w.store(1, frac)
    assert w.half2_ok[1] == 0 and w.half2_ok[2] == 1
    big = deltas(4, True, shape, integral_zeros=True)[2]
    big = dataclasses.replace(big, zeros=big.zeros + 1024)  # integral, but 1024 + zero is not exact in float16
    w.store(2, big)
    assert w.half2_ok[2] == 0
    assert w.half2_ok.tolist() == [1, 0, 0, 1, 0, 1]


def test_tile_tokens_is_the_fullest_work_tile() -> None:
    """``DeltaMeta.tile_tokens``: the CUDA op's token fragments follow the fullest tile, not ``block_m``."""
    spread = DeltaMeta.rows([i % 8 for i in range(64)], DEVICE)
    assert spread.block_m == 16 and spread.tile_tokens == 8
    assert DeltaMeta.rows([0] * 40, DEVICE, max_block_m=16).tile_tokens == 16
    assert DeltaMeta.rows([0, 0, 1], DEVICE).tile_tokens == 2
    assert DeltaMeta.rows([-1, -1], DEVICE).tile_tokens == 0
    assert DeltaMeta.segments([3, 70], [0, 1], DEVICE, dense_min_m=64).tile_tokens == 3


def cuda_meta(mode: str, slots: list[int], seed: int) -> DeltaMeta:
    """``make_meta`` with segments of 1..4 tokens: work tiles of at most 16 tokens, as the CUDA op takes."""
    if mode == "rows":
        return DeltaMeta.rows(slots, DEVICE)
    lens = [int(n) for n in np.random.default_rng(seed).integers(1, 5, size=len(slots))]
    return DeltaMeta.segments(lens, slots, DEVICE)


def cuda_op_or_skip() -> None:
    if DEVICE.type != "cuda":
        pytest.skip("the CUDA op runs on CUDA only (DELTASERVE_TEST_GPU=1)")
    if sbmm_mod.cuda_ext.library("sbmm") is None:
        pytest.fail(f"csrc/sbmm.cu did not build: {sbmm_mod.cuda_ext.unavailable('sbmm')}")


@pytest.mark.parametrize("zeros", ["fractional", "integral"])
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", [(2, False), (2, True), (4, False), (4, True)], ids=["2b", "2b-2:4", "4b", "4b-2:4"])
def test_cuda_op_equals_reference(config: tuple[int, bool], dtype: torch.dtype, popularity: str, zeros: str) -> None:
    """csrc/sbmm.cu = ``sbmm_ref`` over the popularity shapes, prefill segments (tiles of up to 16 tokens)
    and decode rows (tiles of 1..16), base-only tokens mixed in, every CUDA shape; float16 with integral
    zeros takes the half2 dequantisation, everything else the fp32 one."""
    cuda_op_or_skip()
    bits, sparse = config
    for i, shape in enumerate(CUDA_SHAPES):
        for mode in ("segments", "rows"):
            seed = zlib.crc32(f"cuda/{bits}/{sparse}/{dtype}/{popularity}/{mode}/{i}".encode()) % 10_000
            w = pool(bits, sparse, shape, integral_zeros=zeros == "integral")
            meta = cuda_meta(mode, request_deltas(popularity, 4 if mode == "segments" else 20, seed), seed)
            x = randn(meta.num_tokens, shape[0], dtype=dtype, seed=seed + 1)
            base = randn(meta.num_tokens, shape[1], dtype=dtype, seed=seed + 2)
            assert sbmm_mod.cuda_supports(x, w, meta) is None
            assert bool(w.half2_ok.any()) == (zeros == "integral")
            want = sbmm_ref(x, base.clone(), w, meta)
            got = sbmm_mod.sbmm_cuda(x, base.clone(), w, meta)
            close(got, want)
            ids = torch.tensor(token_deltas(meta), device=DEVICE)
            assert torch.equal(got[ids < 0], base[ids < 0]), "tokens without a delta must keep out unchanged"


@pytest.mark.parametrize("split", [None, 2, 3])
def test_cuda_op_split_k_and_strided_out(split: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """K split over blocks (as chosen for one token of one delta, and forced to 2 and 3: uneven
    splits), partials summed by the split that arrives last; ``out`` a column slice of a wider tensor
    (the fused projections' case) and ``x`` a strided view."""
    cuda_op_or_skip()
    lib = sbmm_mod.cuda_ext.library("sbmm")
    if split is not None:
        monkeypatch.setattr(sbmm_cuda_mod, "_cuda_split", lambda *args: split)
    shape = (1024, 136, 64)
    w = make_delta_weights([random_packed(shape[1], shape[0], 4, True, 64, s) for s in range(3)])
    for slots in ([1], [2, -1, 0, 2]):
        meta = DeltaMeta.rows(slots, DEVICE)
        if split is None:
            slots = sbmm_cuda_mod.cuda_slots(lib, w, meta.tile_tokens, torch.float16)
            assert sbmm_cuda_mod._cuda_split(lib, 2, meta.num_tiles, shape[0], slots) > 1
        x = randn(meta.num_tokens, 2 * shape[0], dtype=torch.float16, seed=1)[:, ::2]
        wide = randn(meta.num_tokens, shape[1] + 40, dtype=torch.float16, seed=2)
        want = sbmm_ref(x, wide[:, 8 : 8 + shape[1]].clone(), w, meta)
        got = wide.clone()
        sbmm_mod.sbmm_cuda(x, got[:, 8 : 8 + shape[1]], w, meta)
        close(got[:, 8 : 8 + shape[1]], want)
        assert torch.equal(got[:, :8], wide[:, :8]) and torch.equal(got[:, 8 + shape[1] :], wide[:, 8 + shape[1] :])


def test_cuda_op_follows_offset_tables_and_is_the_default() -> None:
    """Permuted slot regions are read through the tables; ``sbmm`` picks the CUDA op on CUDA by default."""
    cuda_op_or_skip()
    w, wp, meta, meta_p = permuted_pool(CUDA_SHAPES[0])
    x = randn(meta.num_tokens, CUDA_SHAPES[0][0], dtype=torch.float16, seed=1)
    base = randn(meta.num_tokens, CUDA_SHAPES[0][1], dtype=torch.float16, seed=2)
    want = sbmm_ref(x, base.clone(), w, meta)
    close(sbmm_mod.sbmm_cuda(x, base.clone(), wp, meta_p), want)
    calls = []
    real = sbmm_mod.launch_cuda
    try:
        sbmm_mod.launch_cuda = lambda *a: calls.append(1) or real(*a)
        close(sbmm(x, base.clone(), wp, meta_p), want)
    finally:
        sbmm_mod.launch_cuda = real
    assert calls == [1]


def test_cuda_op_in_a_cuda_graph() -> None:
    """Captured once over static metadata, replayed with new inputs and new slots: still the reference."""
    cuda_op_or_skip()
    shape = CUDA_SHAPES[3]
    w = pool(2, True, shape)
    x = randn(8, shape[0], dtype=torch.bfloat16, seed=1)
    out = torch.zeros(8, shape[1], dtype=torch.bfloat16, device=DEVICE)
    meta = DeltaMeta.rows([0, 0, 1, -1, 2, 3, 3, 3], DEVICE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sbmm_mod.sbmm_cuda(x, out, w, meta)
    for seed, slots in ((5, [3, 3, 3, 3, 1, 1, 0, 2]), (6, [0, 0, 1, 0, 3, 5, 5, 0])):
        new = DeltaMeta.rows(slots, DEVICE)
        assert new.block_m == meta.block_m
        retarget(meta, new)
        x.copy_(randn(8, shape[0], dtype=torch.bfloat16, seed=seed))
        out.zero_()
        graph.replay()
        close(out, sbmm_ref(x, torch.zeros_like(out), w, new))


def test_cuda_split_rule() -> None:
    """csrc/sbmm.cu's split rule (the one copy; ``_cuda_split`` asks the library): the most splits (1, 2, 4 ..)
    whose blocks all fit one wave of the device's ``cuda_slots``, each split keeping at least two stages of 256
    columns. The slots are the kernel's blocks per SM (the CUDA runtime's occupancy) x SMs: fewer for 16-token
    tiles over a plain-layout pool, whose stages hold twice the x rows."""
    cuda_op_or_skip()
    lib = sbmm_mod.cuda_ext.library("sbmm")
    w = pool(4, True, CUDA_SHAPES[0])
    slots = sbmm_cuda_mod.cuda_slots(lib, w, 1, torch.float16)
    assert slots % sm_count(DEVICE) == 0 and slots >= 2 * sm_count(DEVICE)
    assert not w.repacked and sbmm_cuda_mod.cuda_slots(lib, w, 16, torch.float16) < slots  # plain: 3 per SM, not 4

    def split(rb: int, tiles: int, k: int) -> int:
        return sbmm_cuda_mod._cuda_split(lib, rb, tiles, k, slots)

    assert split(1, 1, 4096) == 8  # one block: split while each split keeps >= 2 stages (16 / 8)
    assert split(1, 1, 512) == 1  # two stages: no split leaves each >= 2
    assert split(slots, 1, 4096) == 1  # the SMs are full already
    assert split(slots // 2 + 1, 1, 4096) == 1  # two splits would not fit one wave
    assert split(slots // 2, 1, 4096) == 2 and split(slots // 4, 1, 4096) == 4
    for rb, tiles in ((86, 8), (32, 8), (32, 1), (172, 8), (96, 1), (96, 4), (172, 1)):
        s = split(rb, tiles, 4096)
        assert s == 1 or rb * tiles * s <= slots, "a split launch fits one wave"
        assert s == 8 or rb * tiles * s * 2 > slots, "one more split would not"


def stacked_pools(
    bits: int, sparse: bool, in_f: int, outs: tuple[int, ...], group: int, integral_zeros: bool = False
) -> list[DeltaWeights]:
    """One pool per slice (a fused module's projections), each with its own deltas in every slot."""
    return [make_delta_weights([None if s == EMPTY_SLOT else
                                random_packed(n, in_f, bits, sparse, group, 97 * i + s, integral_zeros)
                                for s in range(NUM_SLOTS)]) for i, n in enumerate(outs)]  # fmt: skip


@pytest.mark.parametrize("popularity", POPULARITY)
def test_stacked_equals_per_slice(popularity: str) -> None:
    """``sbmm_stacked`` over a fused module's slices (q, k, v of a GQA model: different widths, a gap
    between two slices) equals ``sbmm`` on each slice's columns: the Triton path under the interpreter,
    and on CUDA the one-launch CUDA op (float16 with per-slot half2 flags, and bfloat16)."""
    in_f, outs, cols = 256, (136, 40, 40), (0, 136, 184)
    for integral in (False, True):
        ws = stacked_pools(4, True, in_f, outs, 64, integral_zeros=integral)
        slices = list(zip(ws, cols))
        for mode in ("segments", "rows"):
            seed = zlib.crc32(f"stacked/{popularity}/{mode}/{integral}".encode()) % 10_000
            meta = cuda_meta(mode, request_deltas(popularity, 4 if mode == "segments" else 12, seed), seed)
            for dtype in (torch.float16, torch.bfloat16) if DEVICE.type == "cuda" else (torch.float32,):
                x = randn(meta.num_tokens, in_f, dtype=dtype, seed=seed + 1)
                base = randn(meta.num_tokens, 240, dtype=dtype, seed=seed + 2)
                want = base.clone()
                for w, col in slices:
                    sbmm_ref(x, want[:, col : col + w.out_features], w, meta)
                got = sbmm_mod.sbmm_stacked(x, base.clone(), slices, meta, use_triton=True)
                close(got, want)
                assert torch.equal(got[:, 224:], base[:, 224:]), "columns outside every slice stay as they are"
                if DEVICE.type == "cuda":
                    cuda_op_or_skip()
                    close(sbmm_mod.sbmm_stacked_cuda(x, base.clone(), slices, meta), want)
                    one = base.clone()  # the default dispatch takes the one-launch op
                    assert torch.equal(
                        sbmm_mod.sbmm_stacked(x, one, slices, meta),
                        sbmm_mod.sbmm_stacked_cuda(x, base.clone(), slices, meta),
                    )


def test_stacked_refuses_bad_slices() -> None:
    """Overlapping or out-of-range columns, slices of another config or width, and more slices than one
    CUDA launch takes: a ValueError naming it, and ``out`` unchanged."""
    ws = stacked_pools(4, True, 256, (48, 48), 64)
    other = stacked_pools(2, True, 256, (48,), 64)[0]
    meta = DeltaMeta.rows([0, 1, -1], DEVICE)
    x = randn(3, 256, dtype=torch.float16 if DEVICE.type == "cuda" else torch.float32, seed=1)
    out = randn(3, 100, dtype=x.dtype, seed=2)
    keep = out.clone()
    for slices, match in (
        ([(ws[0], 0), (ws[1], 40)], "overlaps"),
        ([(ws[0], 0), (ws[1], 60)], "outside"),
        ([(ws[0], 0), (other, 50)], "has \\(bits"),
        ([], "at least one slice"),
    ):
        with pytest.raises(ValueError, match=match):
            sbmm_mod.sbmm_stacked(x, out, slices, meta, use_triton=True)
        assert torch.equal(out, keep)
    if DEVICE.type == "cuda":
        cuda_op_or_skip()
        four = stacked_pools(4, True, 256, (16, 16, 16, 16), 64)
        with pytest.raises(ValueError, match="at most 3"):
            sbmm_mod.sbmm_stacked_cuda(x, out, [(w, 16 * i) for i, w in enumerate(four)], meta)


def test_cuda_graph_split_follows_the_step() -> None:
    """A launch captured over static decode metadata takes the grid of the most splits any tile count
    wants, and its blocks recompute the split from ``tile_count`` at every replay: the result equals an
    eager launch of the same step bit for bit (same split, same summation order), for steps of 1 to many
    tiles, through one fused launch of two slices."""
    cuda_op_or_skip()
    in_f, outs = 2048, (3072, 2048)  # 40 row blocks: 1 tile splits K by 4, 4 tiles by 2, 10 or more not at all
    ws = stacked_pools(4, True, in_f, outs, 64, integral_zeros=True)
    slices = [(ws[0], 0), (ws[1], 3072)]
    rows = 40
    x = randn(rows, in_f, dtype=torch.float16, seed=1)
    out = torch.zeros(rows, 5120, dtype=torch.float16, device=DEVICE)
    meta = DeltaMeta.rows([-1] * rows, DEVICE, max_block_m=2)  # static buffers: no tile yet
    meta = dataclasses.replace(meta, tile_tokens=2)
    sbmm_mod.sbmm_stacked_cuda(x, out, slices, meta)  # eager warm-up (allocates the split counters)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sbmm_mod.sbmm_stacked_cuda(x, out, slices, meta)
    lib = sbmm_mod.cuda_ext.library("sbmm")
    seen = set()
    for seed, slots in enumerate(
        (
            [0],
            [1] * 8 + [-1] * 4,
            [1] * 20 + [-1] * 4,
            [0, 1, 2, 3, 5] * 4 + [-1] * 4,
            [i % 6 if i % 6 != EMPTY_SLOT else -1 for i in range(rows)],
        )
    ):
        slots = slots + [-1] * (rows - len(slots))
        new = DeltaMeta.rows(slots, DEVICE, max_block_m=2)
        slots = sbmm_cuda_mod.cuda_slots(lib, ws[0], 2, torch.float16)
        seen.add(sbmm_cuda_mod._cuda_split(lib, 40, new.num_tiles, in_f, slots))
        retarget(meta, new)
        x.copy_(randn(rows, in_f, dtype=torch.float16, seed=10 + seed))
        out.zero_()
        graph.replay()
        eager = sbmm_mod.sbmm_stacked_cuda(x, torch.zeros_like(out), slices, dataclasses.replace(new, tile_tokens=2))
        assert torch.equal(out, eager)
    assert seen == {1, 2, 4}, f"the steps should want every split: {seen}"


PART_RUNS = (40, 11, 9, 3, 1)
"""Rows of each delta in a step of 16-token tiles: 16, 16, 8 (two, two and one fragment of the 2-fragment
kernel), 11, 9 (two), 3, 1 (one)."""
PART_TILES = [16, 16, 8, 11, 9, 3, 1]
PART_SHAPE = (768, 256, 64)
"""(in, out, group) of the partly filled tile tests: three stages, two row blocks, a shape both layouts take."""


def part_rows(seed: int) -> list[int]:
    """Decode rows of a step whose deltas hold ``PART_RUNS`` rows each (slots 0, 1, 2, 3, 5), shuffled, with
    base-only rows mixed in."""
    slots = [s for s in range(NUM_SLOTS) if s != EMPTY_SLOT]
    rows = [slots[i] for i, n in enumerate(PART_RUNS) for _ in range(n)] + [-1] * 7
    return [rows[int(i)] for i in np.random.default_rng(seed).permutation(len(rows))]


@pytest.mark.parametrize("layout", ["plain", "repacked"])
@pytest.mark.parametrize("config", [(2, False), (2, True), (4, False), (4, True)], ids=["2b", "2b-2:4", "4b", "4b-2:4"])
def test_cuda_op_partly_filled_tiles_equal_reference(config: tuple[int, bool], layout: str) -> None:
    """Work tiles of up to 16 tokens (``cuda_tile_cap``): one block computes a tile's 8-token fragments from
    one dequantisation of its rows, and only the fragments the tile fills (two or one here, in one launch of
    the 2-fragment kernel; decode rows and prefill segments, runs longer than a tile cut); every output
    equals ``sbmm_ref``, base-only rows stay as they are, float16 (half2 and fp32 dequantisation) and
    bfloat16, both slot layouts."""
    cuda_op_or_skip()
    bits, sparse = config
    shape = PART_SHAPE
    for integral in (False, True):
        w = make_delta_weights(deltas(bits, sparse, shape, integral), layout=layout)
        assert w.layout == layout
        seed = zlib.crc32(f"part/{config}/{layout}/{integral}".encode()) % 10_000
        rows = DeltaMeta.rows(part_rows(seed), DEVICE, max_block_m=sbmm_mod.cuda_tile_cap(DEVICE))
        segs = DeltaMeta.segments([33, 3, 9, 17, 2], [0, -1, 1, 0, 5], DEVICE, max_block_m=16)
        assert sorted(e - s for s, e, _ in rows.tiles.tolist()[: rows.num_tiles]) == sorted(PART_TILES)
        assert rows.tile_tokens == 16 and segs.tile_tokens == 16
        for meta in (rows, segs):
            for dtype in (torch.float16, torch.bfloat16):
                x = randn(meta.num_tokens, shape[0], dtype=dtype, seed=seed + 1)
                base = randn(meta.num_tokens, shape[1], dtype=dtype, seed=seed + 2)
                assert sbmm_mod.cuda_supports(x, w, meta) is None
                got = sbmm_mod.sbmm_cuda(x, base.clone(), w, meta)
                close(got, sbmm_ref(x, base.clone(), w, meta))
                ids = torch.tensor(token_deltas(meta), device=DEVICE)
                assert torch.equal(got[ids < 0], base[ids < 0]), "tokens without a delta must keep out unchanged"


def test_cuda_partly_filled_tiles_in_a_cuda_graph() -> None:
    """A decode step captured with 16-token tiles (``GRAPH_TILE``: the widest, fixed at capture), replayed for
    steps of one delta on every row, 5 deltas of 8 rows, and the mixed runs of ``PART_RUNS``: bit for bit
    an eager launch of the same step (same tiles, same split), and the reference."""
    cuda_op_or_skip()
    from deltaserve.adapters.delta_pool import GRAPH_TILE

    shape = PART_SHAPE
    rows = len(part_rows(0))
    w = make_delta_weights(deltas(4, True, shape, True), layout="repacked")
    x = randn(rows, shape[0], dtype=torch.float16, seed=1)
    out = torch.zeros(rows, shape[1], dtype=torch.float16, device=DEVICE)
    meta = dataclasses.replace(DeltaMeta.rows([-1] * rows, DEVICE, max_block_m=GRAPH_TILE), tile_tokens=GRAPH_TILE)
    sbmm_mod.sbmm_cuda(x, out, w, meta)  # eager warm-up (the split counters, the kernel's attributes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sbmm_mod.sbmm_cuda(x, out, w, meta)
    one = [2] * rows
    eight = [[0, 1, 2, 3, 5][i % 5] for i in range(40)] + [-1] * (rows - 40)
    for seed, slots in enumerate((one, eight, part_rows(3))):
        new = DeltaMeta.rows(slots, DEVICE, max_block_m=GRAPH_TILE)
        retarget(meta, new)
        x.copy_(randn(rows, shape[0], dtype=torch.float16, seed=10 + seed))
        out.zero_()
        graph.replay()
        eager = sbmm_mod.sbmm_cuda(x, torch.zeros_like(out), w, dataclasses.replace(new, tile_tokens=GRAPH_TILE))
        assert torch.equal(out, eager)
        close(out, sbmm_ref(x, torch.zeros_like(out), w, new))


def test_cuda_op_refuses_what_it_cannot_run() -> None:
    """``cuda_supports`` names why a call keeps the Triton kernel; ``sbmm_cuda`` refuses such calls."""
    meta = DeltaMeta.rows([0, 1], DEVICE)
    w = pool(4, True, SHAPES[1])  # in = 96: not a multiple of 256
    x = randn(2, 96, dtype=torch.float16, seed=1)
    why = sbmm_mod.cuda_supports(x, w, meta)
    assert why == "CPU tensors" if DEVICE.type == "cpu" else "in_features 96" in why
    with pytest.raises(ValueError, match="sbmm_cuda: unsupported call"):
        sbmm_mod.sbmm_cuda(x, randn(2, 80, dtype=torch.float16, seed=2), w, meta)
    w = pool(4, True, CUDA_SHAPES[0])
    x32 = randn(2, CUDA_SHAPES[0][0], dtype=torch.float32, seed=1)
    long_runs = dataclasses.replace(DeltaMeta.rows([0] * 17, DEVICE), block_m=72)  # past the widest tile
    if DEVICE.type == "cuda":
        assert "float32" in sbmm_mod.cuda_supports(x32, w, meta)
        assert "work tiles of 72 tokens" in sbmm_mod.cuda_supports(x32.half().repeat(9, 1)[:17], w, long_runs)
        assert "group size 96" in sbmm_mod.cuda_supports(x32.half(), pool(4, True, (384, 24, 96)), meta)


def test_cuda_tile_cap() -> None:
    """``max_block_m`` cuts a long run of one slot into 16-token tiles (the CUDA op's size), in decode
    rows and prefill segments alike; the Triton kernel (and, on CUDA, the CUDA op) still equal the
    reference on such metadata."""
    rows = DeltaMeta.rows([0] * 40 + [-1, 3, 3], DEVICE, max_block_m=16)
    assert rows.block_m == 16 and rows.num_tiles == 4 and rows.grid_tiles == 43
    assert rows.tiles.tolist()[:4] == [[0, 16, 0], [16, 32, 0], [32, 40, 0], [40, 42, 3]]
    # Prefill: a 40-token prompt of slot 0, a base-only one, a 2-token chunk of slot 3.
    segs = DeltaMeta.segments([40, 1, 2], [0, -1, 3], DEVICE, max_block_m=16)
    assert segs.block_m == 16 and segs.num_tiles == 4 and segs.grid_tiles == 4
    assert segs.tiles.tolist() == [[0, 16, 0], [16, 32, 0], [32, 40, 0], [40, 42, 3]]
    assert DeltaMeta.rows([0] * 40, DEVICE).block_m == 64
    assert DeltaMeta.segments([40], [0], DEVICE).block_m == 64
    for meta in (DeltaMeta.rows([0] * 40, DEVICE, max_block_m=8), DeltaMeta.segments([40], [0], DEVICE, max_block_m=8)):
        assert meta.block_m == 8 and meta.num_tiles == 5  # one CUDA MMA fragment per tile: the CUDA op's only
        w8 = pool(4, True, CUDA_SHAPES[0])
        x8 = randn(40, CUDA_SHAPES[0][0], dtype=torch.float16, seed=3)
        with pytest.raises(ValueError, match="work tiles of 8 tokens"):
            sbmm_triton(x8, randn(40, CUDA_SHAPES[0][1], dtype=torch.float16, seed=4), w8, meta)
    with pytest.raises(ValueError, match="max_block_m 0 must be >= 1"):
        DeltaMeta.rows([0] * 40, DEVICE, max_block_m=0)
    shape = CUDA_SHAPES[0]
    w = pool(4, True, shape)
    x = randn(43, shape[0], dtype=torch.float16, seed=1)
    base = randn(43, shape[1], dtype=torch.float16, seed=2)
    for meta in (rows, segs):
        want = sbmm_ref(x, base.clone(), w, meta)
        close(sbmm_triton(x, base.clone(), w, meta), want)
        if DEVICE.type == "cuda" and sbmm_mod.cuda_ext.library("sbmm") is not None:
            assert sbmm_mod.cuda_tile_cap(DEVICE) == 16
            close(sbmm_mod.sbmm_cuda(x, base.clone(), w, meta), want)
        elif DEVICE.type == "cpu":
            assert sbmm_mod.cuda_tile_cap(DEVICE) is None


def test_cuda_op_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA (or nvcc, or the source) no build is tried or it fails with a named reason; ``sbmm``
    then keeps the Triton kernel / the reference."""
    from deltaserve.kernels import cuda_ext

    if not torch.cuda.is_available():
        assert cuda_ext.library("sbmm") is None and cuda_ext.unavailable("sbmm") == "no CUDA device"
    monkeypatch.setattr(cuda_ext, "nvcc", lambda: None)
    with pytest.raises(FileNotFoundError, match="nvcc not found"):
        cuda_ext.build("sbmm")
    with pytest.raises(FileNotFoundError, match="no source"):
        cuda_ext.build("no_such_op")


def test_split_counters_grow_without_freeing_what_graphs_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA op's split-K counters are one buffer per device that captured graphs hold by address:
    a launch wanting more replaces it (outside a capture) and keeps the old one allocated, since graphs
    captured over it still replay (a mixed-step graph of a large bucket captured after the decode graphs)."""
    from deltaserve.kernels.sbmm import cuda as sbmm_cuda

    monkeypatch.setattr(sbmm_cuda, "_counters", {})
    monkeypatch.setattr(sbmm_cuda, "_outgrown", [])
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    dev = torch.device("cpu")  # the bookkeeping is the device's; its memory need not be
    first = sbmm_cuda._split_counters(dev, 10)
    assert first.numel() == 1 << 16 and sbmm_cuda._split_counters(dev, 1 << 16) is first
    grown = sbmm_cuda._split_counters(dev, (1 << 16) + 1)
    assert grown.numel() == (1 << 16) + 1 and grown.data_ptr() != first.data_ptr()
    assert sbmm_cuda._outgrown == [first] and sbmm_cuda._split_counters(dev, 5) is grown
    capturing[0] = True  # inside a capture the buffer cannot move: the launch must have run once before
    with pytest.raises(RuntimeError, match="run the launch once before capturing it"):
        sbmm_cuda._split_counters(dev, 1 << 20)
    assert sbmm_cuda._split_counters(dev, 7) is grown and sbmm_cuda._outgrown == [first]
