"""The multi-LoRA kernels (``deltaserve.kernels.lora``): SGMV / MBGMV shrink + expand = reference = dense LoRA.

Two checks, as for the fused ops:

- each Triton kernel (SGMV for prefill segments, MBGMV for decode rows) equals its torch reference
  over the adapter-popularity shapes of Punica's tests (identical: one adapter; distinct: every
  request its own; uniform: ceil(sqrt(n)) adapters; skewed: Zipf-1.5 draws), with mixed ranks
  4 / 8 / 16 / 64 in one batch, requests without an adapter (-1) mixed in, hidden sizes 64, 96
  (not a power of two) and 128, float32 / float16 / bfloat16, rank rows scattered over the flat
  pools (shuffled offsets), and multi-slice expand (qkv-like slices of different sizes, one
  without LoRA); MBGMV also at widths that split the shrink's input columns over several programs;
- rows addressed by element offsets as the unified page pool stores them: A and B^T rows of several
  adapters interleaved in ONE flat buffer at odd offsets, first-fit into page regions; and static
  tables (``check=False``) refilled in place between two calls of one ``LoraWeights``;
- the reference equals a dense per-token LoRA computed from the original ``A``, ``B`` matrices (not
  from the pool), so the pool layout and the semantics are checked, not only kernel = reference.
- stacked slices of one module (``LoraStack``, ``lora_delta_stacked``): equal to the per-slice
  path (exactly under the interpreter) over the popularity shapes and dtypes, mixed ranks, adapters
  that adapt only some slices (rank 0 elsewhere), GQA-style unequal widths, gate_up, one slice,
  untouched columns between slices, split decode widths, tables as strided views inside larger
  tables refilled in place between calls; ``from_slices`` stacks views without a copy.

Bad metadata and weights get ``ValueError``s. On CPU the kernels run under the Triton interpreter;
with ``DELTASERVE_TEST_GPU=1`` on CUDA.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from deltaserve.kernels import lora as lora_kernels
from deltaserve.kernels.lora import (
    LoraMeta,
    LoraSlice,
    LoraStack,
    LoraWeights,
    lora_delta,
    lora_delta_stacked,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink_ref,
    lora_shrink_triton,
    make_weights,
    tables,
)
from deltaserve.kernels.lora import mbgmv as mbgmv_kernels

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU

DEVICE = torch.device("cuda" if os.environ.get("DELTASERVE_TEST_GPU") == "1" else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN = [64, 96, 128]
POPULARITY = ["identical", "distinct", "uniform", "skewed"]
RANKS = (4, 8, 16, 64)
R_MAX = 64
NUM_SLOTS = 12
# Kernel vs reference: both accumulate in fp32 and round once; only the summation order differs,
# so outputs differ by at most about one unit in the last place of the dtype.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def request_adapters(popularity: str, n: int, seed: int, base_every: int = 4) -> list[int]:
    """Adapter slot of each of ``n`` requests; every ``base_every``-th request has none (-1)."""
    rng = np.random.default_rng(seed)
    if popularity == "identical":
        ids = [3] * n
    elif popularity == "distinct":
        ids = list(rng.permutation(NUM_SLOTS)[:n])
    elif popularity == "uniform":
        k = math.ceil(math.sqrt(n))
        ids = [int(i) % k for i in rng.permutation(n)]
    elif popularity == "skewed":  # Zipf-1.5 over the slots: a few adapters take most requests
        p = 1.0 / np.arange(1, NUM_SLOTS + 1) ** 1.5
        ids = list(rng.choice(NUM_SLOTS, size=n, p=p / p.sum()))
    else:
        raise AssertionError(popularity)
    return [-1 if base_every and i % base_every == base_every - 1 else int(a) for i, a in enumerate(ids)]


def dense_adapters(in_dim: int, out_dim: int, dtype: torch.dtype, seed: int) -> list[tuple]:
    """NUM_SLOTS adapters (A [r, in], B [out, r], scale) with ranks cycling over RANKS."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for slot in range(NUM_SLOTS):
        r = RANKS[slot % len(RANKS)]
        a = (torch.randn(r, in_dim, generator=g) / math.sqrt(in_dim)).to(dtype).to(DEVICE)
        b = torch.randn(out_dim, r, generator=g).to(dtype).to(DEVICE)
        out.append((a, b, 2.0 / r if slot % 2 else 0.5))
    return out


def pooled(adapters: list[tuple], seed: int) -> LoraWeights:
    """The adapters in flat pools with spare rows and their rank rows scattered (shuffled offsets)."""
    total = sum(a.shape[0] for a, _, _ in adapters) + 24
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    w = make_weights(adapters, R_MAX, total, perm=perm)
    in_dim = adapters[0][0].shape[1]
    assert not all(torch.equal(w.a_offsets[s, : a.shape[0]].cpu(), torch.arange(a.shape[0]) * in_dim)
                   for s, (a, _, _) in enumerate(adapters))  # fmt: skip
    return w


def make_meta(mode: str, adapters_of_requests: list[int], seed: int) -> LoraMeta:
    """SGMV: one segment per request of 1..24 tokens (some span two 16-token tiles); MBGMV: one row each."""
    if mode == "mbgmv":
        return LoraMeta.mbgmv(adapters_of_requests, DEVICE)
    rng = np.random.default_rng(seed)
    lens = [int(n) for n in rng.integers(1, 25, size=len(adapters_of_requests))]
    return LoraMeta.sgmv(lens, adapters_of_requests, DEVICE)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def token_adapters(meta: LoraMeta) -> list[int]:
    out = []
    for s, a in enumerate(meta.seg_adapter_host):
        out += [a] * (meta.seg_start_host[s + 1] - meta.seg_start_host[s])
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=RTOL[want.dtype], atol=ATOL[want.dtype])


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_kernels_equal_reference(popularity: str, dtype: torch.dtype, hidden: int, mode: str) -> None:
    seed = zlib.crc32(f"{popularity}/{hidden}/{mode}".encode()) % 1000
    n_req = 6 if mode == "sgmv" else 12
    meta = make_meta(mode, request_adapters(popularity, n_req, seed), seed)
    out_dim = hidden + 16  # expand's output need not match the input width
    w = pooled(dense_adapters(hidden, out_dim, dtype, seed), seed)
    x = randn(meta.num_tokens, hidden, dtype=dtype, seed=seed + 1)
    base = randn(meta.num_tokens, out_dim, dtype=dtype, seed=seed + 2)

    v_ref = lora_shrink_ref(x, w, meta)
    close(lora_shrink_triton(x, w, meta), v_ref)
    got = lora_expand_triton(v_ref, w, meta, base.clone())
    want = lora_expand_ref(v_ref, w, meta, base.clone())
    close(got, want)

    ids = torch.tensor(token_adapters(meta), device=DEVICE)
    assert torch.equal(got[ids < 0], base[ids < 0]), "tokens without an adapter must keep out unchanged"
    if (ids >= 0).any():
        assert not torch.equal(want[ids >= 0], base[ids >= 0])


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_reference_equals_dense_lora(popularity: str, mode: str) -> None:
    """Reference (pool gather) = per-token ``out + scale * B (A x)`` from the original matrices, float32."""
    seed = 7
    meta = make_meta(mode, request_adapters(popularity, 8, seed), seed)
    dense = dense_adapters(96, 40, torch.float32, seed)
    w = pooled(dense, seed)
    x = randn(meta.num_tokens, 96, dtype=torch.float32, seed=1)
    base = randn(meta.num_tokens, 40, dtype=torch.float32, seed=2)
    want = base.clone()
    for t, a in enumerate(token_adapters(meta)):
        if a >= 0:
            A, B, scale = dense[a]
            want[t] += scale * (B @ (A @ x[t]))
    got = lora_delta(x, base.clone(), [LoraSlice(0, 40, w)], meta, use_triton=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_slice_expand(dtype: torch.dtype, mode: str) -> None:
    """qkv-like: slices of 64, 32, 48 columns with their own adapters; the middle one has no LoRA."""
    hidden, sizes, seed = 64, (64, 32, 48), 11
    meta = make_meta(mode, request_adapters("skewed", 8, seed), seed)
    slices, off = [], 0
    for i, size in enumerate(sizes):
        w = None if i == 1 else pooled(dense_adapters(hidden, size, dtype, seed + i), seed + i)
        slices.append(LoraSlice(off, size, w))
        off += size
    x = randn(meta.num_tokens, hidden, dtype=dtype, seed=3)
    base = randn(meta.num_tokens, off, dtype=dtype, seed=4)
    got = lora_delta(x, base.clone(), slices, meta, use_triton=True)
    want = lora_delta(x, base.clone(), slices, meta, use_triton=False)
    close(got, want)
    assert torch.equal(got[:, 64:96], base[:, 64:96]), "the slice without LoRA must be untouched"
    ids = torch.tensor(token_adapters(meta), device=DEVICE)
    for lo, hi in ((0, 64), (96, 144)):
        assert not torch.equal(got[ids >= 0, lo:hi], base[ids >= 0, lo:hi])
    # Each slice equals that slice's single-projection op (slices do not bleed into each other).
    for s in (slices[0], slices[2]):
        alone = lora_delta(
            x, base[:, s.offset : s.offset + s.size].clone(), [LoraSlice(0, s.size, s.weights)], meta, use_triton=False
        )
        close(got[:, s.offset : s.offset + s.size], alone)


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
def test_all_tokens_one_adapter_no_base(mode: str) -> None:
    """Identical popularity without base requests, and an empty segment in the SGMV case."""
    seed = 5
    ids = request_adapters("identical", 5, seed, base_every=0)
    meta = LoraMeta.mbgmv(ids, DEVICE) if mode == "mbgmv" else LoraMeta.sgmv([17, 0, 3, 30, 1], ids, DEVICE)
    w = pooled(dense_adapters(96, 96, torch.float16, seed), seed)
    x = randn(meta.num_tokens, 96, dtype=torch.float16, seed=1)
    base = randn(meta.num_tokens, 96, dtype=torch.float16, seed=2)
    close(
        lora_delta(x, base.clone(), [LoraSlice(0, 96, w)], meta, use_triton=True),
        lora_delta(x, base.clone(), [LoraSlice(0, 96, w)], meta, use_triton=False),
    )


def test_sgmv_tiles_cover_exactly_the_adapter_tokens() -> None:
    """The SGMV grid: one program row per 16-token tile of a segment with an adapter, none for base
    segments or empty ones, so its size follows the tokens, not segments x the longest segment."""
    starts, adapters = [0, 40, 41, 41, 58, 60], [2, -1, 5, 0, 7]
    assert lora_kernels.SGMV_TILE == 16
    assert lora_kernels.sgmv_tiles(starts, adapters) == [0, 0, 0, 16, 0, 32, 3, 41, 3, 57, 4, 58]
    meta = LoraMeta.sgmv([40, 1, 0, 17, 2], adapters, DEVICE)
    assert meta.num_tiles == 6 and meta.tiles.tolist() == [[0, 0], [0, 16], [0, 32], [3, 41], [3, 57], [4, 58]]
    assert LoraMeta.mbgmv([1, -1], DEVICE).tiles is None
    assert LoraMeta.sgmv([3, 4], [-1, -1], DEVICE).num_tiles == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sgmv_one_long_prefill_next_to_many_decode_rows(dtype: torch.dtype) -> None:
    """A mixed step as continuous batching forms it: one long prefill segment, then one-token decode
    segments of many distinct adapters and base rows, stacked qkv-like slices; kernel = reference."""
    seed = 11
    lens = [70] + [1] * 14 + [5]
    ids = [1] + [(i * 5) % NUM_SLOTS if i % 4 else -1 for i in range(14)] + [9]
    meta = LoraMeta.sgmv(lens, ids, DEVICE)
    assert meta.num_tiles == 5 + 10 + 1  # 70 tokens = 5 tiles; 10 adapter decode rows; the last segment
    slices = [
        LoraSlice(0, 64, pooled(dense_adapters(96, 64, dtype, seed), seed)),
        LoraSlice(64, 32, pooled(dense_adapters(96, 32, dtype, seed + 1), seed + 1)),
    ]
    x = randn(meta.num_tokens, 96, dtype=dtype, seed=1)
    base = randn(meta.num_tokens, 96, dtype=dtype, seed=2)
    close(
        lora_delta(x, base.clone(), slices, meta, use_triton=True),
        lora_delta(x, base.clone(), slices, meta, use_triton=False),
    )


def test_only_base_requests_is_a_no_op() -> None:
    meta = LoraMeta.sgmv([3, 4], [-1, -1], DEVICE)
    w = pooled(dense_adapters(64, 64, torch.float32, 0), 0)
    x, base = randn(7, 64, dtype=torch.float32, seed=1), randn(7, 64, dtype=torch.float32, seed=2)
    for use_triton in (True, False):
        assert torch.equal(lora_delta(x, base.clone(), [LoraSlice(0, 64, w)], meta, use_triton=use_triton), base)


def dense_delta(x: torch.Tensor, base: torch.Tensor, dense: list, row_adapter: list[int]) -> torch.Tensor:
    """Per-token ``out + scale * B (A x)`` in float32 from the original matrices, rounded to base's dtype."""
    want = base.float().clone()
    for t, a in enumerate(row_adapter):
        if a >= 0 and dense[a] is not None:
            A, B, scale = dense[a]
            want[t] += scale * (B.float() @ (A.float() @ x[t].float()))
    return want.to(base.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,in_dim,out_dim", [(1, 300, 136), (3, 260, 72), (12, 520, 200), (33, 520, 260)])
def test_mbgmv_split_widths(tokens: int, in_dim: int, out_dim: int, dtype: torch.dtype) -> None:
    """Decode rows at input widths the shrink splits over several programs (partials summed by the
    expand), odd widths with a ragged last tile, and several output tiles, in every tier of the
    launch tables (up to 4, up to 32, over 32 tokens: configs/launch.json); lora_delta's split decode
    path equals shrink + expand exactly, and both equal the references (the fused decode path:
    tests/kernels/test_lora_fused.py)."""
    seed = tokens
    meta = LoraMeta.mbgmv(request_adapters("skewed", tokens, seed), DEVICE)
    w = pooled(dense_adapters(in_dim, out_dim, dtype, seed), seed)
    x = randn(tokens, in_dim, dtype=dtype, seed=seed + 1)
    base = randn(tokens, out_dim, dtype=dtype, seed=seed + 2)
    v = lora_shrink_triton(x, w, meta)
    close(v, lora_shrink_ref(x, w, meta))
    two_step = lora_expand_triton(v, w, meta, base.clone())
    close(two_step, lora_expand_ref(v, w, meta, base.clone()))
    previous = lora_kernels.set_decode_path("split")
    try:
        fused = lora_delta(x, base.clone(), [LoraSlice(0, out_dim, w)], meta, use_triton=True)
    finally:
        lora_kernels.set_decode_path(previous)
    if DEVICE.type == "cpu":  # the interpreter sums the partials in one order in both kernels
        assert torch.equal(fused, two_step), "the fused decode path must round v exactly as lora_shrink does"
    else:  # compiled reductions may order the float32 partial sums differently
        close(fused, two_step)


def place_first_fit(rows: list[int], region: int, start_region: int) -> tuple[list[int], int]:
    """The spec's adapter layout: each row (its width) at the current position of the current page
    region if it fits entirely, else at the start of the next region. Returns (region-relative
    offsets as (region index, position) flattened to region * region + position, next region)."""
    offs, reg, pos = [], start_region, 0
    for width in rows:
        assert width <= region
        if pos + width > region:
            reg, pos = reg + 1, 0
        offs.append(reg * region + pos)
        pos += width
    return offs, reg + 1


def unified_pool(
    dense: list, r_max: int, dtype: torch.dtype, region: int, head: int, seed: int, num_regions: int | None = None
) -> LoraWeights:
    """A and B^T rows of every adapter in ONE flat buffer (a_pool is b_pool), first-fit into page
    regions of ``region`` elements starting ``head`` elements into the buffer (odd offsets), adapters
    on non-adjacent regions, every other element filled with junk (KV data of other requests). The
    buffer has ``num_regions`` regions (default: as many as the layout uses)."""
    first = next(d for d in dense if d is not None)
    in_dim, out_dim = first[0].shape[1], first[1].shape[0]
    placed, nxt = {}, 1  # region 0 stays KV junk
    for slot, item in enumerate(dense):
        if item is not None:
            r = item[0].shape[0]
            placed[slot], nxt = place_first_fit([in_dim] * r + [out_dim] * r, region, nxt)
            nxt += 1  # a KV page between adapters
    num_regions = nxt if num_regions is None else num_regions
    assert nxt <= num_regions
    buf = randn(head + num_regions * region, dtype=dtype, seed=seed) * 100
    a_off = torch.zeros(len(dense), r_max, dtype=torch.int64)
    b_off = torch.zeros(len(dense), r_max, dtype=torch.int64)
    ranks, scales = [], []
    for slot, item in enumerate(dense):
        if item is None:
            ranks.append(0)
            scales.append(0.0)
            continue
        A, B, scale = item
        r = A.shape[0]
        for j in range(r):
            oa, ob = head + placed[slot][j], head + placed[slot][r + j]
            buf[oa : oa + in_dim] = A[j]
            buf[ob : ob + out_dim] = B[:, j]
            a_off[slot, j], b_off[slot, j] = oa, ob
        ranks.append(r)
        scales.append(scale)
    assert (a_off % 2).any() and (b_off % 2).any(), "the layout must exercise odd offsets"
    rank = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    return LoraWeights(
        buf,
        buf,
        a_off.to(DEVICE),
        b_off.to(DEVICE),
        rank,
        torch.tensor(scales, dtype=torch.float32, device=DEVICE),
        in_dim,
        out_dim,
    )


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unified_pool_interleaved_odd_offsets(dtype: torch.dtype, mode: str) -> None:
    """Rows of several adapters interleaved in one shared buffer at odd offsets, like adapter pages
    in the KV pool: kernel = reference = dense LoRA, and no junk around the rows leaks in."""
    seed, in_dim, out_dim = 13, 72, 40
    dense = dense_adapters(in_dim, out_dim, dtype, seed)
    dense[5] = None  # an unused slot between used ones
    w = unified_pool(dense, R_MAX, dtype, region=157, head=3, seed=seed)
    assert w.a_pool is w.b_pool
    ids = [a if a != 5 else -1 for a in request_adapters("uniform", 8, seed)]
    meta = make_meta(mode, ids, seed)
    x = randn(meta.num_tokens, in_dim, dtype=dtype, seed=1)
    base = randn(meta.num_tokens, out_dim, dtype=dtype, seed=2)
    got = lora_delta(x, base.clone(), [LoraSlice(0, out_dim, w)], meta, use_triton=True)
    want = lora_delta(x, base.clone(), [LoraSlice(0, out_dim, w)], meta, use_triton=False)
    close(got, want)
    # The reference reads the right rows: it equals LoRA from the original matrices.
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 8e-2}[dtype]
    torch.testing.assert_close(
        want.float(), dense_delta(x, base, dense, token_adapters(meta)).float(), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
def test_tables_refilled_in_place(mode: str) -> None:
    """One LoraWeights(check=False) over static tables and a static pool (the worker's per-layer
    object, built once); the tables and pool contents are refilled in place between calls and every
    call follows the new contents, including slots that go from used to unused and back."""
    in_dim, out_dim, r_max, slots, region, head = 64, 48, 32, 4, 131, 1
    dtype = torch.float16
    pool = torch.zeros(head + 64 * region, dtype=dtype, device=DEVICE)
    a_off = torch.zeros(slots, r_max, dtype=torch.int64, device=DEVICE)
    b_off = torch.zeros(slots, r_max, dtype=torch.int64, device=DEVICE)
    rank = torch.zeros(slots, dtype=torch.int32, device=DEVICE)
    scale = torch.zeros(slots, dtype=torch.float32, device=DEVICE)
    w = LoraWeights(pool, pool, a_off, b_off, rank, scale, in_dim, out_dim, check=False)

    def refill(step_seed: int, step_ranks: list[int]) -> list:
        """Writes fresh adapters of the given ranks (0: unused slot) into the pool and the tables."""
        g = torch.Generator().manual_seed(step_seed)
        dense = [(torch.randn(r, in_dim, generator=g).div(8).to(dtype).to(DEVICE),
                  torch.randn(out_dim, r, generator=g).to(dtype).to(DEVICE), 0.25 * (1 + i)) if r else None
                 for i, r in enumerate(step_ranks)]  # fmt: skip
        fresh = unified_pool(dense, r_max, dtype, region, head, step_seed, num_regions=64)
        pool.copy_(fresh.a_pool)
        for table, new in (
            (a_off, fresh.a_offsets),
            (b_off, fresh.b_offsets),
            (rank, fresh.rank),
            (scale, fresh.scale),
        ):
            table.copy_(new)
        return dense

    ids = [0, 1, -1, 3, 1, 2, 0]
    meta = make_meta(mode, ids, 3)
    x = randn(meta.num_tokens, in_dim, dtype=dtype, seed=1)
    base = randn(meta.num_tokens, out_dim, dtype=dtype, seed=2)
    results = []
    for step, step_ranks in enumerate(([8, 16, 0, 32], [32, 0, 4, 8], [8, 16, 0, 32])):
        dense = refill(100 + step, step_ranks)
        got = lora_delta(x, base.clone(), [LoraSlice(0, out_dim, w)], meta, use_triton=True)
        close(got, lora_delta(x, base.clone(), [LoraSlice(0, out_dim, w)], meta, use_triton=False))
        torch.testing.assert_close(
            got.float(), dense_delta(x, base, dense, token_adapters(meta)).float(), rtol=2e-2, atol=2e-2
        )
        results.append(got)
    assert not torch.equal(results[0], results[1]), "the second fill must change the result"
    assert not torch.equal(results[0], results[2]), "same ranks, new weights: a new result"


def test_unchecked_tables_skip_content_checks_not_shape_checks(small) -> None:
    w, _ = small
    bad_rank = torch.full_like(w.rank, 1000)  # content: only a checked build looks at it
    dataclasses.replace(w, rank=bad_rank, check=False)
    with pytest.raises(ValueError, match="rank 1000, outside"):
        dataclasses.replace(w, rank=bad_rank)
    with pytest.raises(ValueError, match=r"rank \[12\] torch.int64: want \[12\] int32"):
        dataclasses.replace(w, rank=w.rank.long(), check=False)
    with pytest.raises(ValueError, match="must be 1-D contiguous"):
        dataclasses.replace(w, a_pool=w.a_pool.view(-1, 64), check=False)


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
def test_rows_without_adapter_get_zero_v(mode: str) -> None:
    """lora_shrink's v: 0 for rows of -1 and past each row's rank (also with no adapter row at all)."""
    w = pooled(dense_adapters(64, 64, torch.float32, 0), 0)
    for ids in ([-1, -1, -1], [-1, 2, 0]):
        meta = make_meta(mode, ids, 1)
        x = randn(meta.num_tokens, 64, dtype=torch.float32, seed=1)
        v = lora_shrink_triton(x, w, meta)
        close(v, lora_shrink_ref(x, w, meta))
        ranks = w.rank.tolist()
        for t, a in enumerate(token_adapters(meta)):
            assert not v[t, ranks[a] if a >= 0 else 0 :].any()


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def small() -> tuple[LoraWeights, torch.Tensor]:
    w = pooled(dense_adapters(64, 64, torch.float32, 0), 0)
    return w, randn(4, 64, dtype=torch.float32, seed=1)


@pytest.mark.parametrize("use_triton", [True, False])
def test_adapter_id_out_of_range(small, use_triton: bool) -> None:
    w, x = small
    meta = LoraMeta.mbgmv([0, NUM_SLOTS, -1, 1], DEVICE)
    with pytest.raises(ValueError, match=f"adapter id {NUM_SLOTS} out of range"):
        lora_delta(x, torch.zeros(4, 64), [LoraSlice(0, 64, w)], meta, use_triton=use_triton)
    with pytest.raises(ValueError, match="adapter id -2 out of range"):
        LoraMeta.sgmv([2, 2], [0, -2], DEVICE)


def test_rank_above_r_max(small) -> None:
    w, _ = small
    with pytest.raises(ValueError, match="rank 65, outside 0 .. r_max = 64"):
        dataclasses.replace(w, rank=torch.full_like(w.rank, 65))
    a, b = torch.zeros(65, 64), torch.zeros(64, 65)
    with pytest.raises(ValueError, match="rank 65 > r_max = 64"):
        make_weights([(a, b, 1.0)], 64)


@pytest.mark.parametrize("table,pool_attr,dim", [("a_offsets", "a_pool", 64), ("b_offsets", "b_pool", 64)])
def test_offsets_outside_pool(small, table: str, pool_attr: str, dim: int) -> None:
    w, _ = small
    n = getattr(w, pool_attr).numel()
    for bad in (n - dim + 1, -1):
        offs = getattr(w, table).clone()
        offs[2, 0] = bad
        with pytest.raises(ValueError, match=rf"{table}\[2, 0\] = {bad}: row .* outside the pool of {n} elements"):
            dataclasses.replace(w, **{table: offs})
    offs = getattr(w, table).clone()
    offs[2, w.rank[2] :] = n  # past the slot's rank: never read, so allowed
    dataclasses.replace(w, **{table: offs})


def test_offset_align_promise(small) -> None:
    w, _ = small
    assert w.offset_align == 16  # make_weights: the dims 64 / 64 allow it
    offs = w.a_offsets.clone()
    offs[1, 0] = 3
    with pytest.raises(ValueError, match=r"a_offsets\[1, 0\].*not a multiple of offset_align = 16"):
        dataclasses.replace(w, a_offsets=offs)
    dataclasses.replace(w, a_offsets=offs, offset_align=1)
    with pytest.raises(ValueError, match="offset_align 3: want a power of two"):
        dataclasses.replace(w, offset_align=3)
    with pytest.raises(ValueError, match="a_pool starts at an address that is not a multiple of offset_align"):
        dataclasses.replace(w, a_pool=w.a_pool[1:], offset_align=2, check=False)


@pytest.mark.parametrize("use_triton", [True, False])
def test_dtype_mismatch(small, use_triton: bool) -> None:
    w, x = small
    meta = LoraMeta.mbgmv([0, 1, 2, 3], DEVICE)
    with pytest.raises(ValueError, match="dtype mismatch: input torch.float16"):
        lora_delta(x.half(), torch.zeros(4, 64), [LoraSlice(0, 64, w)], meta, use_triton=use_triton)
    with pytest.raises(ValueError, match="dtype mismatch: out torch.float16"):
        lora_delta(x, torch.zeros(4, 64, dtype=torch.float16), [LoraSlice(0, 64, w)], meta, use_triton=use_triton)
    with pytest.raises(ValueError, match="pool dtypes"):
        dataclasses.replace(w, b_pool=w.b_pool.half())


def test_shape_mismatches(small) -> None:
    w, x = small
    meta = LoraMeta.mbgmv([0, 1, 2], DEVICE)  # 3 tokens, x has 4
    with pytest.raises(ValueError, match=r"must be \[T = 3, in_dim\]"):
        lora_delta(x, torch.zeros(4, 64), [LoraSlice(0, 64, w)], meta)
    meta = LoraMeta.mbgmv([0, 1, 2, 3], DEVICE)
    with pytest.raises(ValueError, match="outside out's 64 columns"):
        lora_delta(x, torch.zeros(4, 64), [LoraSlice(32, 64, w)], meta)
    with pytest.raises(ValueError, match="segment lengths"):
        LoraMeta.sgmv([1, 2], [0], DEVICE)


# ----------------------------------------------------------------------------- stacked slices (one module)
#
# ``lora_delta_stacked`` must equal ``lora_delta`` over the stack's slices: exactly under the
# interpreter (every program computes what the per-slice path's does), within the tolerances on GPU.


def stacked_tables(
    dense: list[list],
    in_dim: int,
    dims: tuple[int, ...],
    dtype: torch.dtype,
    seed: int,
    r_max: int = R_MAX,
    head: int = 3,
    pool_elems: int | None = None,
):
    """Every slice's adapters (``dense[i][slot]``: (A, B, scale) or None = rank 0 in that slice) as
    rank rows in ONE junk-filled flat buffer, rows of all slices and adapters in a shuffled order
    with random gaps from an odd ``head`` on. Returns (buf, a_off, b_off, rank, scale) with tables
    [n_slices, slots, r_max] / [n_slices, slots]."""
    n, slots = len(dense), len(dense[0])
    rows = []  # (slice, slot, 0 = A / 1 = B^T, j, width)
    for i, per_slot in enumerate(dense):
        for slot, item in enumerate(per_slot):
            if item is not None:
                r = item[0].shape[0]
                rows += [(i, slot, kind, j, (in_dim, dims[i])[kind]) for kind in (0, 1) for j in range(r)]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(rows))
    gaps = rng.integers(0, 6, size=len(rows))
    pos, placed = head, {}
    for k, g in zip(order, gaps):
        placed[k] = pos + int(g)
        pos = placed[k] + rows[k][4]
    total = pos if pool_elems is None else pool_elems
    assert pos <= total
    buf = randn(total, dtype=dtype, seed=seed) * 100
    a_off = torch.zeros(n, slots, r_max, dtype=torch.int64)
    b_off = torch.zeros(n, slots, r_max, dtype=torch.int64)
    rank = torch.zeros(n, slots, dtype=torch.int32)
    scale = torch.zeros(n, slots, dtype=torch.float32)
    for k, (i, slot, kind, j, width) in enumerate(rows):
        A, B, sc = dense[i][slot]
        o = placed[k]
        buf[o : o + width] = A[j] if kind == 0 else B[:, j]
        (a_off if kind == 0 else b_off)[i, slot, j] = o
        rank[i, slot], scale[i, slot] = A.shape[0], sc
    return buf, a_off.to(DEVICE), b_off.to(DEVICE), rank.to(DEVICE), scale.to(DEVICE)


def stacked_dense(in_dim: int, dims: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[list]:
    """Per slice, NUM_SLOTS adapters of mixed ranks; adapter ``slot`` skips slice ``i`` (rank 0 there)
    when ``(slot + i) % 4 == 3`` (adapters that adapt only some slices) and slot 5 adapts none."""
    out = []
    for i, d in enumerate(dims):
        per = dense_adapters(in_dim, d, dtype, seed + 31 * i)
        out.append([None if (slot + i) % 4 == 3 or slot == 5 else item for slot, item in enumerate(per)])
    return out


def embedded_stack(buf, a_off, b_off, rank, scale, in_dim, dims, offsets, **kw) -> LoraStack:
    """The tables as views inside larger pool-like tables (as ``AdapterPool``'s ``a_off[s0:s1]`` and
    ``rank[layer, s0:s1]``): storage offsets, and slice strides that differ between tables."""
    n, slots, r_max = a_off.shape
    big_a = torch.full((n + 2, slots, r_max), -1, dtype=torch.int64, device=DEVICE)
    big_b = torch.full((n + 3, slots, r_max), -1, dtype=torch.int64, device=DEVICE)
    big_rank = torch.full((2, n + 2, slots), 999, dtype=torch.int32, device=DEVICE)
    big_scale = torch.full((3, n + 1, slots), float("nan"), dtype=torch.float32, device=DEVICE)
    big_a[1 : 1 + n], big_b[2 : 2 + n], big_rank[1, 1 : 1 + n], big_scale[2, :n] = a_off, b_off, rank, scale
    return LoraStack(
        buf,
        buf,
        big_a[1 : 1 + n],
        big_b[2 : 2 + n],
        big_rank[1, 1 : 1 + n],
        big_scale[2, :n],
        in_dim,
        dims,
        offsets,
        **kw,
    )


GQA = (64, 32, 32)
"""qkv of a GQA model in miniature: q wider than k and v."""


def check_stacked(x, base, stack, meta) -> torch.Tensor:
    """Stacked Triton = per-slice Triton (exactly on CPU) = per-slice reference; returns the result."""
    got = lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True)
    per_slice = lora_delta(x, base.clone(), stack.as_slices(), meta, use_triton=True)
    if DEVICE.type == "cpu":
        assert torch.equal(got, per_slice), "the stacked op must compute exactly what the per-slice path does"
    else:
        close(got, per_slice)
    close(got, lora_delta_stacked(x, base.clone(), stack, meta, use_triton=False))
    ids = torch.tensor(token_adapters(meta), device=DEVICE)
    assert torch.equal(got[ids < 0], base[ids < 0]), "tokens without an adapter must keep out unchanged"
    return got


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_stacked_equals_per_slice(popularity: str, dtype: torch.dtype, mode: str) -> None:
    """GQA qkv-like stack over the popularity shapes, mixed ranks, adapters adapting only some
    slices, base rows mixed in; tables as strided views inside larger tables."""
    seed = zlib.crc32(f"stacked/{popularity}/{mode}".encode()) % 1000
    in_dim = 64
    meta = make_meta(mode, request_adapters(popularity, 6 if mode == "sgmv" else 12, seed), seed)
    dense = stacked_dense(in_dim, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, in_dim, GQA, dtype, seed), in_dim, GQA, (0, 64, 96))
    x = randn(meta.num_tokens, in_dim, dtype=dtype, seed=seed + 1)
    base = randn(meta.num_tokens, 128, dtype=dtype, seed=seed + 2)
    got = check_stacked(x, base, stack, meta)
    # Per token and slice: changed iff the token's adapter adapts that slice.
    for t, a in enumerate(token_adapters(meta)):
        for i, (lo, hi) in enumerate(((0, 64), (64, 96), (96, 128))):
            adapted = a >= 0 and dense[i][a] is not None
            assert torch.equal(got[t, lo:hi], base[t, lo:hi]) != adapted, (t, a, i)


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
@pytest.mark.parametrize("layout", ["gate_up", "single", "gaps"])
def test_stacked_layouts(layout: str, mode: str) -> None:
    """gate_up (two equal slices), one slice (o / down), and slices with untouched columns between
    and after them (a projection of the module without LoRA): kernel = per-slice = dense LoRA."""
    dims, offsets, width = {
        "gate_up": ((80, 80), (0, 80), 160),
        "single": ((48,), (0,), 48),
        "gaps": ((40, 24), (8, 72), 104),
    }[layout]
    seed, in_dim, dtype = 17, 96, torch.float32
    meta = make_meta(mode, request_adapters("skewed", 8, seed), seed)
    dense = stacked_dense(in_dim, dims, dtype, seed)
    buf, *tables = stacked_tables(dense, in_dim, dims, dtype, seed)
    stack = LoraStack(buf, buf, *tables, in_dim, dims, offsets)
    x = randn(meta.num_tokens, in_dim, dtype=dtype, seed=1)
    base = randn(meta.num_tokens, width, dtype=dtype, seed=2)
    got = check_stacked(x, base, stack, meta)
    want = base.clone()
    for i, (d, o) in enumerate(zip(dims, offsets)):
        want[:, o : o + d] = dense_delta(x, base[:, o : o + d], dense[i], token_adapters(meta))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    covered = torch.zeros(width, dtype=torch.bool)
    for d, o in zip(dims, offsets):
        covered[o : o + d] = True
    assert torch.equal(got[:, ~covered], base[:, ~covered]), "columns outside every slice must be untouched"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,in_dim", [(1, 300), (33, 520)])
def test_stacked_mbgmv_split_widths(tokens: int, in_dim: int, dtype: torch.dtype) -> None:
    """Decode at input widths the shrink splits over several programs (a ragged last split, in the
    smallest and the over-32-token tier of the launch tables), slice widths that leave ragged and
    empty column tiles in the narrower slices (GQA: 200 / 72 / 72)."""
    dims, seed = (200, 72, 72), tokens
    meta = LoraMeta.mbgmv(request_adapters("uniform", tokens, seed), DEVICE)
    dense = stacked_dense(in_dim, dims, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, in_dim, dims, dtype, seed), in_dim, dims, (0, 200, 272))
    x = randn(tokens, in_dim, dtype=dtype, seed=seed + 1)
    check_stacked(x, randn(tokens, 344, dtype=dtype, seed=seed + 2), stack, meta)


@pytest.mark.parametrize(
    "shrink,expand",
    [((2, 16, 64, 4), (4, 32, 32, 2)), ((4, 8, 32, 4), (8, 16, 64, 4)), ((8, 16, 128, 4), (2, 16, 128, 4))],
)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_mbgmv_row_blocks(popularity: str, shrink: tuple, expand: tuple, monkeypatch) -> None:
    """Decode rows in blocks of several rows per program (the launch tables' BLOCK_T), whatever
    the tuned tables say: rows of different adapters, ranks (4..64) and base rows in one block, a
    partial last block, rank tiles narrower and wider than a rank; one slice and a GQA stack."""
    monkeypatch.setattr(mbgmv_kernels, "MB_SHRINK_LAUNCH", ((1 << 30, shrink),))
    monkeypatch.setattr(mbgmv_kernels, "MB_EXPAND_LAUNCH", ((1 << 30, expand),))
    seed, tokens, in_dim, dtype = zlib.crc32(f"blocks/{popularity}/{shrink}".encode()) % 1000, 11, 96, torch.float16
    meta = LoraMeta.mbgmv(request_adapters(popularity, tokens, seed, base_every=3), DEVICE)
    w = pooled(dense_adapters(in_dim, 72, dtype, seed), seed)
    x = randn(tokens, in_dim, dtype=dtype, seed=seed + 1)
    base = randn(tokens, 72, dtype=dtype, seed=seed + 2)
    close(lora_shrink_triton(x, w, meta), lora_shrink_ref(x, w, meta))
    want = lora_expand_ref(lora_shrink_ref(x, w, meta), w, meta, base.clone())
    close(lora_delta(x, base.clone(), [LoraSlice(0, 72, w)], meta, use_triton=True), want)
    dense = stacked_dense(in_dim, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, in_dim, GQA, dtype, seed), in_dim, GQA, (0, 64, 96))
    check_stacked(x, randn(tokens, 128, dtype=dtype, seed=seed + 3), stack, meta)


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv"])
def test_stacked_tables_refilled_in_place(mode: str) -> None:
    """One LoraStack(check=False) over static tables and a static pool, built once (the worker's
    per-module object): refilled in place between calls, with adapters moving between slots and
    slices switching between adapted and not; every call follows the new contents."""
    in_dim, dims, offsets, dtype, elems = 64, GQA, (0, 64, 96), torch.float16, 80000
    n, slots = len(dims), NUM_SLOTS
    pool = torch.zeros(elems, dtype=dtype, device=DEVICE)
    tabs = [torch.zeros(n, slots, R_MAX, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    rank = torch.zeros(n, slots, dtype=torch.int32, device=DEVICE)
    scale = torch.zeros(n, slots, dtype=torch.float32, device=DEVICE)
    stack = embedded_stack(pool, *tabs, rank, scale, in_dim, dims, offsets, check=False)
    ids = [0, 1, -1, 3, 1, 2, 0, 7]
    meta = make_meta(mode, ids, 3)
    x = randn(meta.num_tokens, in_dim, dtype=dtype, seed=1)
    base = randn(meta.num_tokens, 128, dtype=dtype, seed=2)
    results = []
    for step in range(3):
        dense = stacked_dense(in_dim, dims, dtype, 100 + step % 2 * 7)
        if step == 1:  # slot 0 stops adapting k; slot 1 adapts nothing; slot 3 adapts everything
            dense[1][0], dense[0][1], dense[1][1], dense[2][1] = None, None, None, None
        buf, a_off, b_off, r, sc = stacked_tables(dense, in_dim, dims, dtype, 100 + step, pool_elems=elems)
        pool.copy_(buf)
        for table, new in zip((stack.a_offsets, stack.b_offsets, stack.rank, stack.scale), (a_off, b_off, r, sc)):
            table.copy_(new)
        got = check_stacked(x, base, stack, meta)
        for i, (d, o) in enumerate(zip(dims, offsets)):
            want = dense_delta(x, base[:, o : o + d], dense[i], token_adapters(meta))
            torch.testing.assert_close(got[:, o : o + d].float(), want.float(), rtol=2e-2, atol=2e-2)
        results.append(got)
    assert not torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])
    assert torch.equal(results[0], results[2]), "same adapters at new offsets: the same result"


def test_stack_from_slices_is_a_view() -> None:
    """``LoraStack.from_slices`` over per-slice weights that are views of one set of tables (the
    adapter pool's per-projection weights) stacks them without a copy; other weights are refused."""
    in_dim, dims, dtype = 64, GQA, torch.float32
    dense = stacked_dense(in_dim, dims, dtype, 4)
    ref = embedded_stack(*stacked_tables(dense, in_dim, dims, dtype, 4), in_dim, dims, (0, 64, 96))
    slices = [LoraSlice(o, d, w) for o, d, w in zip((0, 64, 96), dims, ref.slice_weights)]
    stack = LoraStack.from_slices(slices)
    for name in ("a_offsets", "b_offsets", "rank", "scale"):
        a, b = getattr(stack, name), getattr(ref, name)
        assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride()), name
    assert (stack.out_dims, stack.out_offsets) == (dims, (0, 64, 96))
    # A slice without LoRA is left out of the stack (its columns stay untouched).
    two = LoraStack.from_slices([slices[0], LoraSlice(64, 32, None), slices[2]])
    assert (two.out_dims, two.out_offsets, two.num_slices) == ((64, 32), (0, 96), 2)
    assert two.rank.stride(0) == 2 * ref.rank.stride(0)
    # Independently built weights do not share pools / tables.
    other = pooled(dense_adapters(in_dim, 32, dtype, 1), 1)
    with pytest.raises(ValueError, match="slice 1 does not share the first slice's a_pool"):
        LoraStack.from_slices([slices[0], LoraSlice(64, 32, other)])
    lone = dataclasses.replace(ref.slice_weights[1], rank=ref.slice_weights[1].rank.clone())
    with pytest.raises(ValueError, match="slice 1's rank is not a view"):
        LoraStack.from_slices([slices[0], LoraSlice(64, 32, lone)])
    with pytest.raises(ValueError, match="increasing addresses"):
        LoraStack.from_slices([slices[1], slices[0]])


def test_stack_bad_input() -> None:
    in_dim, dims, dtype = 64, GQA, torch.float32
    buf, a_off, b_off, rank, scale = stacked_tables(stacked_dense(in_dim, dims, dtype, 2), in_dim, dims, dtype, 2)
    good = LoraStack(buf, buf, a_off, b_off, rank, scale, in_dim, dims, (0, 64, 96))
    with pytest.raises(ValueError, match="slice 1 starts at column 60, inside slice 0"):
        dataclasses.replace(good, out_offsets=(0, 60, 96))
    with pytest.raises(ValueError, match="3 stacked slices but 2 out_dims"):
        dataclasses.replace(good, out_dims=(64, 32))
    with pytest.raises(ValueError, match=r"stacked rank \[12\]: want \[n_slices = 3"):
        dataclasses.replace(good, rank=rank[0])
    bad = rank.clone()
    bad[2, 4] = R_MAX + 1
    with pytest.raises(ValueError, match=rf"stacked slice 2: lora: adapter 4 has rank {R_MAX + 1}"):
        dataclasses.replace(good, rank=bad)
    dataclasses.replace(good, rank=bad, check=False)  # unchecked: contents are the caller's promise
    meta = LoraMeta.mbgmv([0, 1, NUM_SLOTS], DEVICE)
    x = randn(3, in_dim, dtype=dtype, seed=1)
    for use_triton in (True, False):
        with pytest.raises(ValueError, match=f"adapter id {NUM_SLOTS} out of range"):
            lora_delta_stacked(x, torch.zeros(3, 128), good, meta, use_triton=use_triton)
    meta = LoraMeta.mbgmv([0, 1, 2], DEVICE)
    with pytest.raises(ValueError, match=r"out \[3, 120\] must be \[T = 3, >= 128\]"):
        lora_delta_stacked(x, torch.zeros(3, 120), good, meta)
    with pytest.raises(ValueError, match="dtype mismatch: out torch.float16"):
        lora_delta_stacked(x, torch.zeros(3, 128, dtype=torch.float16), good, meta)
    with pytest.raises(ValueError, match=r"input has 32 columns"):
        lora_delta_stacked(x[:, :32], torch.zeros(3, 128), good, meta)


@pytest.mark.parametrize(
    "dims,want_fp16,want_fp32",
    [((64, 32, 32), 8, 4), ((4096, 1024, 1024), 8, 4), ((12, 20), 4, 4), ((10, 6), 2, 2), ((7, 8), 1, 1)],
)
def test_stacked_column_alignment_promise(dims: tuple[int, ...], want_fp16: int, want_fp32: int) -> None:
    """The stacked expands promise (``tl.multiple_of``) that every slice's width and first column are
    multiples of ``col_align``: the gcd of the widths and first columns, capped at one 16-byte vector.
    A false promise would be a misaligned vector access on the GPU (the interpreter ignores it), so
    the promise is checked against the slices' own columns."""
    dtype = torch.float16
    dense = stacked_dense(32, dims, dtype, 7)
    stack = embedded_stack(
        *stacked_tables(dense, 32, dims, dtype, 7), 32, dims, tuple(itertools.accumulate((0,) + dims[:-1]))
    )
    tab = tables.LaunchTables.of(stack)
    for out_dtype, want in ((torch.float16, want_fp16), (torch.float32, want_fp32)):
        got = tables.col_align(tab, torch.empty(1, sum(dims), dtype=out_dtype))
        assert got == want
        assert all(d % got == 0 for d in stack.out_dims) and all(c % got == 0 for c in stack.out_offsets)
    single = tables.LaunchTables.of(stack.slice_weights[0])
    assert not single.stacked and tables.col_align(single, torch.empty(1, 8, dtype=dtype)) == 1


@pytest.mark.parametrize("mode", ["sgmv", "mbgmv", "mixed"])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_linear_stacked_overlap_equals_plain(popularity: str, mode: str) -> None:
    """``lora_linear_stacked`` overlapped (on a GPU: the shrinks on a side stream beside the base
    matmul, the expands after the join) gives exactly the plain base-then-delta result, for decode,
    prefill and mixed steps: only the device's order of work changes, not a bit of out. A missing
    join would let an expand read unfinished partials. On the CPU both are the plain path."""
    seed = zlib.crc32(f"overlap/{popularity}/{mode}".encode()) % 1000
    in_dim, dtype = 64, torch.float16
    adapters = request_adapters(popularity, 6 if mode != "mbgmv" else 12, seed)
    if mode == "mixed":  # decode rows, a 16-token chunk of adapter 2, a 3-token chunk of the base
        meta = LoraMeta.mixed_step([1, 1, 16, 1, 1, 1, 3], adapters[:2] + [2] + adapters[2:5] + [-1], DEVICE)
    else:
        meta = make_meta(mode, adapters, seed)
    dense = stacked_dense(in_dim, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, in_dim, GQA, dtype, seed), in_dim, GQA, (0, 64, 96))
    x = randn(meta.num_tokens, in_dim, dtype=dtype, seed=seed + 1)
    weight = randn(128, in_dim, dtype=dtype, seed=seed + 2) / 8
    bias = randn(128, dtype=dtype, seed=seed + 3)
    want = lora_delta_stacked(x, torch.nn.functional.linear(x, weight, bias), stack, meta, use_triton=True)
    assert not torch.equal(want, torch.nn.functional.linear(x, weight, bias)), "some rows have an adapter"
    for _ in range(3):  # back to back: each call's buffers are freed while the next is in flight
        got = lora_kernels.lora_linear_stacked(x, weight, bias, stack, meta, use_triton=True, overlap=True)
        assert torch.equal(got, want)
    assert torch.equal(lora_kernels.lora_linear_stacked(x, weight, bias, stack, meta, use_triton=True), want)


def test_overlap_setting() -> None:
    previous = lora_kernels.set_overlap(False)
    try:
        assert lora_kernels.get_overlap() is False
        assert lora_kernels.set_overlap(True) is False and lora_kernels.get_overlap() is True
    finally:
        lora_kernels.set_overlap(previous)


@pytest.mark.parametrize("value,ok", [("1", True), ("0", True), ("yes", False), ("", False)])
def test_overlap_env_is_checked_at_import(value: str, ok: bool) -> None:
    """``DELTASERVE_LORA_OVERLAP``: 1 (the default) or 0 is taken; anything else stops the import
    with the variable's name."""
    code = "from deltaserve.kernels import lora; print(lora.get_overlap())"
    env = {**os.environ, "DELTASERVE_LORA_OVERLAP": value}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if ok:
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [str(value == "1")]
    else:
        assert run.returncode != 0 and f"DELTASERVE_LORA_OVERLAP={value!r}" in run.stderr
