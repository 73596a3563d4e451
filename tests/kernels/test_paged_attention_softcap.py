"""Attention soft-capping (Gemma 2: ``cap * tanh(scale * q.k / cap)`` before the mask) in the Triton
paged-attention kernels equals the torch reference, which equals HF's eager formula written out.

Small shapes: decode (one split and split-K) and a ragged prefill / decode mix, with and without a
sliding window, GQA 2, over shuffled pages. A cap far above every score changes nothing.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from deltaserve.kernels.paged_attention import paged_attention, paged_decode
from deltaserve.model import ForwardBatch, PagedKVCache, paged_attention_ref

pytestmark = pytest.mark.gpu_kernels

DEVICE = torch.device("cuda" if os.environ.get("DELTASERVE_TEST_GPU") == "1" else "cpu")
HEAD_DIM, KV_HEADS, GQA, BS = 16, 2, 2, 4
SCALE = 0.5  # with unit-normal q, k: scores of a few units, so a cap of 2 bites hard


def build(lens: list[tuple[int, int]], seed: int = 0):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // BS) for c, n in lens) + 2
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    cache = PagedKVCache(1, num_blocks, BS, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    cache.kv.normal_(generator=gen)
    seqs = []
    for computed, new in lens:
        n = -(-(computed + new) // BS)
        table, free = free[:n], free[n:]
        seqs.append(([0] * new, computed, table, True))
    batch = ForwardBatch.build(seqs, BS, device=DEVICE)
    q = torch.randn(batch.num_tokens, KV_HEADS * GQA, HEAD_DIM, generator=gen).to(DEVICE)
    return q, cache.kv.to(DEVICE), batch


def eager(q, kv, batch, window, cap):
    """HF's eager attention with a soft-cap, one token at a time over its gathered context."""
    out = torch.empty_like(q)
    qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for b in range(batch.num_seqs):
        ctx = lens[b]
        table = batch.block_tables[b].tolist()
        k = torch.stack([kv[0, 0, table[j // BS], j % BS] for j in range(ctx)])  # [ctx, H_kv, D]
        v = torch.stack([kv[0, 1, table[j // BS], j % BS] for j in range(ctx)])
        for t in range(qsl[b], qsl[b + 1]):
            p = ctx - (qsl[b + 1] - qsl[b]) + (t - qsl[b])
            keys = [j for j in range(ctx) if j <= p and (window is None or j > p - window)]
            for h in range(q.shape[1]):
                s = (k[keys, h // GQA] @ q[t, h]) * SCALE
                s = torch.tanh(s / cap) * cap
                out[t, h] = torch.softmax(s, 0) @ v[keys, h // GQA]
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("lens", [[(0, 1), (6, 1), (13, 1)], [(0, 7), (9, 1), (3, 6)]], ids=["decode", "mixed"])
def test_softcap_kernels_equal_reference_and_eager(lens, window) -> None:
    q, kv, batch = build(lens)
    cap = 2.0
    ref = paged_attention_ref(q, kv[0, 0], kv[0, 1], batch, SCALE, sliding_window=window, softcap=cap)
    torch.testing.assert_close(ref.cpu(), eager(q.cpu(), kv.cpu(), batch, window, cap), atol=2e-5, rtol=0)
    got = paged_attention(
        q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, batch.query_start_loc,
        batch.max_query_len, SCALE, window, softcap=cap,
    )  # fmt: skip
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
    plain = paged_attention_ref(q, kv[0, 0], kv[0, 1], batch, SCALE, sliding_window=window)
    assert (plain - ref).abs().max() > 1e-2  # the cap changed the result
    loose = paged_attention_ref(q, kv[0, 0], kv[0, 1], batch, SCALE, sliding_window=window, softcap=1e6)
    torch.testing.assert_close(loose, plain, atol=2e-5, rtol=0)


def test_softcap_split_k_decode() -> None:
    q, kv, batch = build([(0, 1), (22, 1), (15, 1)], seed=3)
    ref = paged_attention_ref(q, kv[0, 0], kv[0, 1], batch, SCALE, softcap=3.0)
    for splits in (1, 4):
        got = paged_decode(
            q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, SCALE, num_splits=splits, softcap=3.0
        )
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def test_bad_softcap_is_refused() -> None:
    q, kv, batch = build([(0, 1)])
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="softcap must be positive"):
            paged_decode(q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, SCALE, softcap=bad)
    with pytest.raises(ValueError, match="softcap must be positive"):
        paged_attention_ref(q, kv[0, 0], kv[0, 1], batch, SCALE, softcap=0.0)
