"""The multi-LoRA kernels (``deltaserve.kernels.lora``): SGMV / MBGMV shrink + expand = reference = dense LoRA.

Two checks, as for the fused ops:

- each Triton kernel (SGMV for prefill segments, MBGMV for decode rows) equals its torch reference
  over the adapter-popularity shapes of Punica's tests (identical: one adapter; distinct: every
  request its own; uniform: ceil(sqrt(n)) adapters; skewed: Zipf-1.5 draws), with mixed ranks
  4 / 8 / 16 / 64 in one batch, requests without an adapter (-1) mixed in, hidden sizes 64, 96
  (not a power of two) and 128, float32 / float16 / bfloat16, rank rows scattered over the pool
  (a shuffled ``row_index``), and multi-slice expand (qkv-like slices of different sizes, one
  without LoRA);
- the reference equals a dense per-token LoRA computed from the original ``A``, ``B`` matrices (not
  from the pool), so the pool layout and the semantics are checked, not only kernel = reference.

Bad metadata and weights get ``ValueError``s. On CPU the kernels run under the Triton interpreter;
with ``DELTASERVE_TEST_GPU=1`` on CUDA.
"""

from __future__ import annotations

import math
import os
import zlib

import numpy as np
import pytest
import torch

from deltaserve.kernels.lora import (
    LoraMeta,
    LoraSlice,
    LoraWeights,
    lora_delta,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink_ref,
    lora_shrink_triton,
    make_weights,
)

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
    """The adapters in a pool with spare rows and their rank rows scattered (shuffled row_index)."""
    total = sum(a.shape[0] for a, _, _ in adapters) + 24
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    w = make_weights(adapters, R_MAX, total, perm=perm)
    assert not all(torch.equal(w.row_index[s, : a.shape[0]].cpu(), torch.arange(a.shape[0], dtype=torch.int32))
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
        alone = lora_delta(x, base[:, s.offset : s.offset + s.size].clone(), [LoraSlice(0, s.size, s.weights)],
                           meta, use_triton=False)
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
    close(lora_delta(x, base.clone(), [LoraSlice(0, 96, w)], meta, use_triton=True),
          lora_delta(x, base.clone(), [LoraSlice(0, 96, w)], meta, use_triton=False))


def test_only_base_requests_is_a_no_op() -> None:
    meta = LoraMeta.sgmv([3, 4], [-1, -1], DEVICE)
    w = pooled(dense_adapters(64, 64, torch.float32, 0), 0)
    x, base = randn(7, 64, dtype=torch.float32, seed=1), randn(7, 64, dtype=torch.float32, seed=2)
    for use_triton in (True, False):
        assert torch.equal(lora_delta(x, base.clone(), [LoraSlice(0, 64, w)], meta, use_triton=use_triton), base)


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
        LoraWeights(w.a_pool, w.b_pool, w.row_index, torch.full_like(w.rank, 65), w.scale)
    a, b = torch.zeros(65, 64), torch.zeros(64, 65)
    with pytest.raises(ValueError, match="rank 65 > r_max = 64"):
        make_weights([(a, b, 1.0)], 64)


def test_row_index_outside_pool(small) -> None:
    w, _ = small
    ri = w.row_index.clone()
    ri[2, 0] = w.a_pool.shape[0]
    with pytest.raises(ValueError, match="row_index points outside the pool"):
        LoraWeights(w.a_pool, w.b_pool, ri, w.rank, w.scale)


@pytest.mark.parametrize("use_triton", [True, False])
def test_dtype_mismatch(small, use_triton: bool) -> None:
    w, x = small
    meta = LoraMeta.mbgmv([0, 1, 2, 3], DEVICE)
    with pytest.raises(ValueError, match="dtype mismatch: input torch.float16"):
        lora_delta(x.half(), torch.zeros(4, 64), [LoraSlice(0, 64, w)], meta, use_triton=use_triton)
    with pytest.raises(ValueError, match="dtype mismatch: out torch.float16"):
        lora_delta(x, torch.zeros(4, 64, dtype=torch.float16), [LoraSlice(0, 64, w)], meta, use_triton=use_triton)
    with pytest.raises(ValueError, match="pool dtypes"):
        LoraWeights(w.a_pool, w.b_pool.half(), w.row_index, w.rank, w.scale)


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
