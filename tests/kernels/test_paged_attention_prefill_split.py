"""Prefill attention with each query tile's keys split over programs (``paged_prefill``'s
``num_splits``, merged by ``paged_prefill_merge_kernel``) equals ``paged_attention_ref``: few query
tokens after long cached contexts (a prefix-cache hit), fresh prompts, one-token rows, windows,
soft-caps and head groups; a tile too short for several splits keeps one and writes out itself.
The tiled launch (a CUDA graph's grid) gives the untiled one's bits at every split count, and the
split count follows the step's token bucket, so a step and its bucket's graph agree; the tiled grid's
programs loop over the real tiles when there are more than programs.

Every unowned KV slot holds NaN (``build``), and the partial buffers start as NaN too: a split that
reads outside its context, or a merge that reads a split nobody wrote, fails loudly.
Under the Triton interpreter on CPU; with ``DELTASERVE_TEST_GPU=1`` on CUDA (``make test-gpu-kernels``)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import paged_attention as pa
from deltaserve.kernels.paged_attention import (
    PREFILL_SPLIT_TOKENS,
    paged_attention,
    paged_prefill,
    prefill_block_q,
    prefill_num_splits,
    prefill_tiles,
)
from deltaserve.model import paged_attention_ref
from deltaserve.worker.mixed_graphs import TOKEN_BUCKETS
from kernels.test_paged_attention import DEVICE, build, check

pytestmark = pytest.mark.gpu_kernels

# (cached, scheduled): hits of a few tokens behind 60-90 cached ones (several splits of 2 key tiles
# of 16 under the interpreter), a fresh 7-token prompt (one split), one-token rows, a 20-token chunk.
HITS = [(60, 5), (0, 7), (33, 1), (90, 20), (3, 2), (47, 1)]


@pytest.fixture
def nan_partials(monkeypatch: pytest.MonkeyPatch):
    """``torch.empty`` in the launcher gives NaN-filled float tensors (the split partials)."""
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(pa.torch, "empty", poisoned)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (23, None), (None, 3.0)])
@pytest.mark.parametrize("gqa", [1, 4])
def test_split_prefill_matches_ref(num_splits: int, window: int | None, softcap: float | None, gqa: int,
                                   nan_partials) -> None:  # fmt: skip
    dtype = torch.float16 if DEVICE.type == "cuda" else torch.float32
    q, kv, clean, batch = build(HITS, 4, gqa, dtype=dtype, seed=num_splits + gqa)
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_ref(q, clean[0, 0], clean[0, 1], batch, scale, sliding_window=window, softcap=softcap)
    args = (q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.max_query_len)
    got = paged_prefill(*args, scale, window, softcap=softcap, num_splits=num_splits)
    check(got, ref)
    whole = paged_prefill(*args, scale, window, softcap=softcap, num_splits=1)
    if DEVICE.type == "cpu" and window is None:
        # the merge ran: a sum in another order leaves other bits somewhere (deterministic seeds)
        assert not torch.equal(got, whole)
    fresh = slice(int(batch.query_start_loc[1]), int(batch.query_start_loc[2]))  # 7 tokens, no cached keys
    assert torch.equal(got[fresh], whole[fresh]), "a tile whose keys fill one split computes as before"


@pytest.mark.parametrize("num_splits", [1, 4])
def test_tiled_split_equals_untiled_with_padding(num_splits: int, nan_partials) -> None:
    """As ``test_paged_attention_tiles`` lays out a graph bucket, at a split count: same bits."""
    q, kv, _clean, batch = build(HITS, 4, 2, dtype=torch.float16 if DEVICE.type == "cuda" else torch.float32)
    scale, window = 64**-0.5, 40
    args = (q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, batch.query_start_loc)
    pad, t = 5, batch.num_tokens
    # the decode kernel computes the one-token rows in both launches; prefill rows come from the splits
    want = paged_attention(*args, batch.max_query_len, scale, window) if num_splits == 1 else None
    if want is None:
        want = paged_prefill(*args, batch.max_query_len, scale, window, skip_single=True, num_splits=num_splits)
        want = pa.paged_decode(*args[:5], scale, window, out=want, query_start_loc=batch.query_start_loc)
    qp = torch.cat([q, torch.full((pad, *q.shape[1:]), 7.0, dtype=q.dtype, device=q.device)])
    qsl = torch.cat([batch.query_start_loc, torch.tensor([t + pad, t + pad], dtype=torch.int32, device=q.device)])
    lens = torch.cat([batch.seq_lens, torch.zeros(2, dtype=torch.int32, device=q.device)])
    tables = torch.cat([batch.block_tables, batch.block_tables[:2]])
    block_q = prefill_block_q(q.shape[1], kv.shape[4], DEVICE.type != "cuda")
    real = prefill_tiles((qsl[1:] - qsl[:-1]).tolist(), block_q, skip_single=True)
    tiles_t = torch.tensor(real + [-1, 0] * 3, dtype=torch.int32, device=q.device).view(-1, 2)
    count = torch.tensor([len(real) // 2], dtype=torch.int32, device=q.device)
    got = paged_prefill(qp, kv[0, 0], kv[0, 1], tables, lens, qsl, t + pad, scale, window, tiles=tiles_t,
                        skip_single=True, num_splits=num_splits, tile_count=count)  # fmt: skip
    got = pa.paged_decode(qp, kv[0, 0], kv[0, 1], tables, lens, scale, window, out=got, query_start_loc=qsl)
    assert torch.equal(got[:t], want), "tiled split programs compute exactly the untiled ones"
    assert torch.equal(got[t:], torch.zeros_like(got[t:])), "the padding sequence (context 0) gets zeros"


@pytest.mark.parametrize("num_splits", [1, 4])
def test_tiled_programs_loop_when_tiles_outnumber_the_grid(num_splits: int, nan_partials) -> None:
    """Twelve 2-token hits fill 24 query rows: the tiled grid has cdiv(24, block_q) + 2 programs per
    head for 12 tiles, so programs take several tiles (and their splits) in turn."""
    lens = [(30 + 3 * i, 2) for i in range(12)]
    q, kv, clean, batch = build(lens, 4, 2, dtype=torch.float16 if DEVICE.type == "cuda" else torch.float32, seed=9)
    scale = 64**-0.5
    args = (q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.max_query_len)
    want = paged_prefill(*args, scale, num_splits=num_splits)
    check(want, paged_attention_ref(q, clean[0, 0], clean[0, 1], batch, scale))
    block_q = prefill_block_q(q.shape[1], kv.shape[4], DEVICE.type != "cuda")
    real = prefill_tiles([n for _, n in lens], block_q)
    assert len(real) // 2 > -(-q.shape[0] // block_q) + 2, "more tiles than programs per head"
    tiles_t = torch.tensor(real + [-1, 0] * 4, dtype=torch.int32, device=q.device).view(-1, 2)
    count = torch.tensor([len(real) // 2], dtype=torch.int32, device=q.device)
    got = paged_prefill(*args, scale, tiles=tiles_t, tile_count=count, num_splits=num_splits)
    assert torch.equal(got, want)


def test_split_count_follows_the_token_bucket() -> None:
    """A step and the graph bucket it replays in get the same split count (replay == eager)."""
    assert set(PREFILL_SPLIT_TOKENS) <= set(TOKEN_BUCKETS)
    for sms, kv_heads, block_q in ((132, 32, 64), (132, 8, 16), (78, 40, 64), (8, 2, 16)):
        counts = {t: prefill_num_splits(t, kv_heads, block_q, sms) for t in range(1, 2 * TOKEN_BUCKETS[-1])}
        for t, n in counts.items():
            bucket = next((b for b in TOKEN_BUCKETS if b >= t), t)
            assert n == counts.get(bucket, prefill_num_splits(bucket, kv_heads, block_q, sms))
            assert n & (n - 1) == 0 and 1 <= n <= 16
        assert counts[PREFILL_SPLIT_TOKENS[-1] + 1] == 1
    # Llama-2-7B on a 132-SM card: a 32-token hit runs 8 splits x 32 kv heads = 256 programs
    assert [prefill_num_splits(t, 32, 64, 132) for t in (32, 64, 128, 192, 256, 384)] == [8, 8, 4, 2, 2, 1]


def test_bad_split_count_or_tile_count_is_refused() -> None:
    q, kv, _clean, batch = build(HITS[:2], 4, 1)
    args = (q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.max_query_len, 0.1)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        paged_prefill(*args, num_splits=0)
    tiles = torch.tensor([[0, 0], [1, 0]], dtype=torch.int32, device=q.device)
    for bad in (torch.tensor([2], device=q.device), torch.tensor([2, 0], dtype=torch.int32, device=q.device)):
        with pytest.raises(ValueError, match=r"tile_count must be \[1\] int32"):
            paged_prefill(*args, tiles=tiles, tile_count=bad)
