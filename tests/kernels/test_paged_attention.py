"""Triton paged attention (``deltaserve.kernels.paged_attention``) equals ``paged_attention_ref``.

Decode and ragged prefill / mixed batches over page sizes 4 and 16, GQA ratios 1/2/4, head_dim
64 (128 once), pages in shuffled order, sliding window on and off, float32 / float16 / bfloat16,
split-K decode, tiles smaller and larger than a page. Every slot no sequence owns (free pages,
padding page 0, the tail of each last page) holds NaN for the kernels: a kernel that reads outside
a context fails loudly. Plus the model-level dispatcher and a whole decoder run on both backends.

On CPU the kernels run under the Triton interpreter; with ``DELTASERVE_TEST_GPU=1`` on CUDA.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from deltaserve.kernels import common as kernel_common
from deltaserve.kernels.paged_attention import decode_num_splits, paged_attention, paged_decode, paged_prefill
from deltaserve.model import ForwardBatch, PagedKVCache, load_model, paged_attention_ref
from deltaserve.model import attention as attn_mod

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU

DEVICE = torch.device("cuda" if os.environ.get("DELTASERVE_TEST_GPU") == "1" else "cpu")
KV_HEADS = 2
# Per dtype: how far the kernel may sit from the reference (both round the output to the dtype;
# the kernel accumulates in float32, the reference's SDPA in its own order).
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (tokens already in the cache, tokens scheduled this step) per sequence.
DECODE = [(0, 1), (4, 1), (12, 1), (37, 1), (15, 1)]
MIXED = [(0, 7), (12, 1), (5, 6), (30, 1), (0, 1), (3, 17), (16, 16)]


def build(lens, block_size, gqa, head_dim=64, dtype=torch.float32, seed=0, kv_heads=KV_HEADS):
    """A batch over shuffled pages. Returns (q, cache for the kernels with NaN in every slot no
    sequence owns, the same cache with those slots zeroed for the reference, batch)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in lens) + 4
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, "cpu")
    cache.kv.fill_(float("nan"))
    seqs = []
    for computed, new in lens:
        ctx = computed + new
        table, free = free[: -(-ctx // block_size)], free[-(-ctx // block_size) :]
        for j in range(ctx):
            kv = torch.randn(2, kv_heads, head_dim, generator=gen).to(dtype)
            cache.kv[0, :, table[j // block_size], j % block_size] = kv
        seqs.append(([0] * new, computed, table, True))
    batch = ForwardBatch.build(seqs, block_size, device=DEVICE)
    q = torch.randn(batch.num_tokens, kv_heads * gqa, head_dim, generator=gen).to(dtype).to(DEVICE)
    clean = cache.kv.nan_to_num(0.0).to(DEVICE)
    return q, cache.kv.to(DEVICE), clean, batch


def reference(q, clean, batch, window):
    return paged_attention_ref(q, clean[0, 0], clean[0, 1], batch, q.shape[-1] ** -0.5, sliding_window=window)


def check(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "kernel read a slot outside some context (NaN)"
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def args(q, kv, batch):
    return q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_ref(block_size: int, gqa: int, window: int | None, dtype: torch.dtype) -> None:
    q, kv, clean, batch = build(DECODE, block_size, gqa, dtype=dtype, seed=block_size + gqa)
    out = paged_decode(*args(q, kv, batch), q.shape[-1] ** -0.5, window, num_splits=1)
    check(out, reference(q, clean, batch, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_mixed_matches_ref(block_size: int, gqa: int, window: int | None, dtype: torch.dtype) -> None:
    """Prefill from scratch, chunks after a cached prefix and decode rows in one batch."""
    q, kv, clean, batch = build(MIXED, block_size, gqa, dtype=dtype, seed=10 + block_size + gqa)
    out = paged_prefill(*args(q, kv, batch), batch.query_start_loc, batch.max_query_len, q.shape[-1] ** -0.5, window)
    check(out, reference(q, clean, batch, window))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("window", [None, 9])
def test_decode_split_k_matches_ref(num_splits: int, window: int | None) -> None:
    """Flash-decoding: the context split over programs, merged by the reduce kernel (some splits
    get no keys: the length-1 sequence, and the window's start)."""
    lens = [(60, 1), (0, 1), (21, 1)]
    q, kv, clean, batch = build(lens, 4, 2, seed=num_splits)
    out = paged_decode(*args(q, kv, batch), q.shape[-1] ** -0.5, window, num_splits=num_splits)
    check(out, reference(q, clean, batch, window))


@pytest.mark.parametrize("decode", [True, False])
def test_head_dim_128_and_bf16(decode: bool) -> None:
    lens = DECODE if decode else MIXED[:4]
    q, kv, clean, batch = build(lens, 16, 2, head_dim=128, dtype=torch.bfloat16, seed=3)
    out = paged_attention(*args(q, kv, batch), batch.query_start_loc, batch.max_query_len, 128**-0.5)
    check(out, reference(q, clean, batch, None))


@pytest.mark.parametrize(("block_q", "block_n", "block_size"), [(1, 4, 16), (4, 32, 4), (2, 16, 16)])
def test_prefill_tile_shapes(block_q: int, block_n: int, block_size: int) -> None:
    """Key tiles smaller than a page, spanning several pages, and query tiles of 1..4 tokens."""
    q, kv, clean, batch = build(MIXED, block_size, 2, seed=block_q * block_n)
    out = paged_prefill(
        *args(q, kv, batch), batch.query_start_loc, batch.max_query_len, 0.125, 7, block_q=block_q, block_n=block_n
    )
    check(out, paged_attention_ref(q, clean[0, 0], clean[0, 1], batch, 0.125, sliding_window=7))


def test_entry_point_picks_decode_and_prefill() -> None:
    for lens in (DECODE, MIXED):
        q, kv, clean, batch = build(lens, 4, 4, seed=len(lens))
        out = paged_attention(*args(q, kv, batch), batch.query_start_loc, batch.max_query_len, 0.1, None)
        check(out, paged_attention_ref(q, clean[0, 0], clean[0, 1], batch, 0.1))


def test_decode_zero_length_rows_give_zeros() -> None:
    """A CUDA-graph padding row (seq_len 0) must not produce NaN or touch other rows."""
    q, kv, clean, batch = build(DECODE, 4, 2, seed=5)
    ref = reference(q, clean, batch, None)
    seq_lens = batch.seq_lens.clone()
    seq_lens[1] = 0
    for splits in (1, 4):
        out = paged_decode(q, kv[0, 0], kv[0, 1], batch.block_tables, seq_lens, 0.125, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        keep = [0, 2, 3, 4]
        check(out[keep], ref[keep])


def test_bad_inputs_are_refused() -> None:
    q, kv, _, batch = build(DECODE, 4, 2, seed=6)
    with pytest.raises(ValueError, match="int32"):
        paged_decode(q, kv[0, 0], kv[0, 1], batch.block_tables.long(), batch.seq_lens, 0.1)
    with pytest.raises(ValueError, match="share one of"):
        paged_decode(q.half(), kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, 0.1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode(q[:, :3], kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, 0.1)
    with pytest.raises(ValueError, match="one each"):
        paged_decode(q[:2], kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, 0.1)


def test_decode_num_splits() -> None:
    assert decode_num_splits(1, 32, 512, 132) == 4  # 512 keys: at least 128 per split
    assert decode_num_splits(1, 8, 4096, 132) == 16  # capped
    assert decode_num_splits(256, 32, 2048, 132) == 1  # the grid already fills the device
    assert decode_num_splits(1, 32, 1, 132) == 1


def test_dispatcher_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.attention.paged_attention``: the reference by default on CPU, the kernels when forced."""
    q, kv, clean, batch = build(MIXED, 4, 2, seed=8)
    ref = reference(q, clean, batch, 6)
    meta = attn_mod.attention_metadata(batch, 4, 6, backend="triton")
    check(attn_mod.paged_attention(q, kv[0, 0], kv[0, 1], batch, 64**-0.5, meta=meta), ref)
    assert meta._reference is None, "the Triton path must not build the reference's dense mask"
    expected = "triton" if DEVICE.type == "cuda" else "torch"
    assert attn_mod.attention_metadata(batch, 4, 6).backend == expected
    monkeypatch.setattr(kernel_common, "_backend", "triton")
    assert attn_mod.attention_metadata(batch, 4, 6).backend == "triton"
    monkeypatch.setattr(kernel_common, "_backend", "torch")
    assert attn_mod.attention_metadata(batch, 4, 6).backend == "torch"
    with pytest.raises(ValueError, match="kernel backend 'cuda'"):
        kernel_common.set_backend("cuda")


def test_decoder_same_on_both_backends(tiny_mistral, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model (sliding window 16, GQA 2) over shuffled pages: prefill of two prompts longer
    than the window, then greedy decode steps; the Triton backend's logits equal the reference's."""
    model = load_model(tiny_mistral).to(DEVICE)
    cfg = model.config
    bs = 4

    def run(backend: str) -> list[torch.Tensor]:
        monkeypatch.setattr(kernel_common, "_backend", backend)
        kv = PagedKVCache(cfg.num_layers, 32, bs, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEVICE)
        pages = list(range(1, 32))
        random.Random(0).shuffle(pages)
        tables = [pages[:12], pages[12:24]]
        prompts = [list(range(5, 24)), list(range(30, 52))]
        logits_seen = []
        with torch.no_grad():
            logits = model(ForwardBatch.build([(p, 0, t, True) for p, t in zip(prompts, tables)], bs, DEVICE), kv)
            logits_seen.append(logits)
            done = [len(p) for p in prompts]
            for _ in range(4):
                nxt = logits.argmax(-1).tolist()
                seqs = [([tok], n, t, True) for tok, n, t in zip(nxt, done, tables)]
                logits = model(ForwardBatch.build(seqs, bs, DEVICE), kv)
                logits_seen.append(logits)
                done = [n + 1 for n in done]
        return logits_seen

    ref, tri = run("torch"), run("triton")
    for a, b in zip(ref, tri):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
