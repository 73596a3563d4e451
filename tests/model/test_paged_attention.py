"""paged_attention_ref / write_kv / ForwardBatch / PagedKVCache against naive dense definitions.

Ragged sequences (prefill, chunk, decode in one batch), GQA ratios 1, 2, 4, block sizes 1, 4, 16,
pages in shuffled (non-contiguous) order, with and without a sliding window.
"""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve.model import ForwardBatch, ModelConfig, PagedKVCache, paged_attention_ref, write_kv

KV_HEADS = 2
HEAD_DIM = 16
# (tokens already in the cache, tokens scheduled this step) per sequence.
RAGGED = [(0, 7), (12, 1), (5, 6), (30, 1), (0, 1), (3, 17)]


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float, window: int | None
) -> torch.Tensor:
    """One sequence, float64: q [n, H, D] at positions first_pos.., k/v [ctx, H_kv, D] at 0..ctx-1."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    qpos = torch.arange(first_pos, first_pos + n)[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def fill_batch(block_size: int, seed: int, dtype: torch.dtype = torch.float32, num_blocks: int = 128):
    """Random K/V for every sequence's whole context, written into shuffled pages; returns all parts."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    cache = PagedKVCache(1, num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype, "cpu")
    seqs, ks, vs = [], [], []
    for computed, new in RAGGED:
        ctx = computed + new
        n_pages = -(-ctx // block_size)
        table, free = free[:n_pages], free[n_pages:]
        k = torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        v = torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        # The prefix as an earlier step would have left it.
        if computed:
            prior = ForwardBatch.build([([0] * computed, 0, table, False)], block_size)
            write_kv(k[:computed], v[:computed], cache.k[0], cache.v[0], prior.slot_mapping)
        seqs.append(([0] * new, computed, table, True))
        ks.append(k)
        vs.append(v)
    batch = ForwardBatch.build(seqs, block_size)
    # This step's K/V, written the way the decoder does it.
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, RAGGED)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, RAGGED)])
    write_kv(new_k, new_v, cache.k[0], cache.v[0], batch.slot_mapping)
    return cache, batch, ks, vs, g


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_paged_attention_matches_dense(gqa: int, block_size: int, window: int | None) -> None:
    cache, batch, ks, vs, g = fill_batch(block_size, seed=gqa * 100 + block_size)
    heads = KV_HEADS * gqa
    scale = HEAD_DIM**-0.5
    q = torch.randn(batch.num_tokens, heads, HEAD_DIM, generator=g)
    out = paged_attention_ref(q, cache.k[0], cache.v[0], batch, scale, sliding_window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    qsl = batch.query_start_loc.tolist()
    for i, (computed, _) in enumerate(RAGGED):
        rows = slice(qsl[i], qsl[i + 1])
        want = dense_reference(q[rows], ks[i], vs[i], computed, scale, window)
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seq {i}: {m}")


def test_paged_attention_ignores_padding_and_foreign_pages() -> None:
    """Masked keys contribute exactly nothing: junk in unused pages changes no output bit."""
    cache, batch, _, _, g = fill_batch(4, seed=1)
    q = torch.randn(batch.num_tokens, KV_HEADS * 2, HEAD_DIM, generator=g)
    before = paged_attention_ref(q, cache.k[0], cache.v[0], batch, 0.25)
    used = set(batch.block_tables.flatten().tolist()) - {0}
    for b in range(cache.num_blocks):
        if b not in used:
            cache.k[0][b] = 1e4
            cache.v[0][b] = -1e4
    after = paged_attention_ref(q, cache.k[0], cache.v[0], batch, 0.25)
    assert torch.equal(before, after)


def test_paged_attention_bf16_close_to_fp32() -> None:
    cache32, batch, _, _, g = fill_batch(4, seed=2)
    q = torch.randn(batch.num_tokens, KV_HEADS * 2, HEAD_DIM, generator=g)
    cache16 = PagedKVCache(1, cache32.num_blocks, 4, KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
    cache16.kv.copy_(cache32.kv)
    ref = paged_attention_ref(q, cache32.k[0], cache32.v[0], batch, 0.25)
    out = paged_attention_ref(q.bfloat16(), cache16.k[0], cache16.v[0], batch, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_write_kv_places_each_token_at_its_slot() -> None:
    cache = PagedKVCache(2, 6, 4, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    k = torch.randn(3, KV_HEADS, HEAD_DIM)
    v = torch.randn(3, KV_HEADS, HEAD_DIM)
    write_kv(k, v, cache.k[1], cache.v[1], torch.tensor([21, 5, 0]))
    torch.testing.assert_close(cache.k[1][5, 1], k[0])  # slot 21 = block 5, offset 1
    torch.testing.assert_close(cache.v[1][1, 1], v[1])  # slot 5 = block 1, offset 1
    torch.testing.assert_close(cache.k[1][0, 0], k[2])
    assert cache.kv[0].abs().sum() == 0, "layer 0 untouched"
    assert cache.kv[1].ne(0).any(dim=(-1, -2)).sum() == 6, "exactly 3 K and 3 V slots written"


def test_forward_batch_build_layout() -> None:
    b = ForwardBatch.build(
        [([11, 12, 13], 0, [7, 2], True), ([14], 5, [3, 9], True), ([15, 16], 2, [4], False)], block_size=4
    )
    assert b.input_ids.tolist() == [11, 12, 13, 14, 15, 16]
    assert b.positions.tolist() == [0, 1, 2, 5, 2, 3]
    assert b.query_start_loc.tolist() == [0, 3, 4, 6]
    assert b.seq_lens.tolist() == [3, 6, 4]
    assert b.block_tables.tolist() == [[7, 2], [3, 9], [4, 0]]
    assert b.slot_mapping.tolist() == [28, 29, 30, 37, 18, 19]
    assert b.logits_indices.tolist() == [2, 3]
    assert (b.max_seq_len, b.max_query_len, b.num_tokens, b.num_seqs) == (6, 3, 6, 3)
    assert b.query_start_loc.dtype == torch.int32 and b.slot_mapping.dtype == torch.long


def test_forward_batch_build_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="sequence 1 needs 2 pages for 5 tokens"):
        ForwardBatch.build([([1], 0, [1], True), ([1, 2], 3, [2], True)], block_size=4)
    with pytest.raises(ValueError, match="sequence 0 schedules no tokens"):
        ForwardBatch.build([([], 0, [1], True)], block_size=4)
    with pytest.raises(ValueError, match="empty batch"):
        ForwardBatch.build([], block_size=4)


def test_kv_cache_sizing() -> None:
    per = PagedKVCache.bytes_per_block(3, 16, 2, 64, torch.bfloat16)
    assert per == 3 * 2 * 16 * 2 * 64 * 2
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    cache = PagedKVCache.for_budget(cfg, 16, 10 * per + per - 1, torch.bfloat16, "cpu")
    assert cache.num_blocks == 10 and cache.kv.shape == (3, 2, 10, 16, 2, 64)
    assert cache.k[2].shape == (10, 16, 2, 64) and cache.k[2].data_ptr() == cache.kv[2, 0].data_ptr()
    with pytest.raises(ValueError, match="smaller than one page"):
        PagedKVCache.for_budget(cfg, 16, per - 1, torch.bfloat16, "cpu")
