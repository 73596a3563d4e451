"""bench/decode_step's KV page plan: when the pool cannot hold every request's context, requests far
apart in the batch read one set of context pages and write their decode tokens to pages of their
own (so batch 256 at KV 512 fits an 80 GB card); on the tiny model the planned steps run."""

from __future__ import annotations

import pytest

from bench.decode_step import bench_batch, kv_page_sets


def test_every_request_has_its_own_context_when_the_pool_holds_it():
    assert kv_page_sets(batch=8, ctx=64, blocks_per_req=5, block_size=16, pages=40) == 8


def test_a_small_pool_shares_context_pages_and_keeps_tails_private():
    # 8 requests, 4 context pages + 1 tail page each: 40 pages distinct; 20 pages hold 8 tails and
    # 3 context sets.
    assert kv_page_sets(batch=8, ctx=64, blocks_per_req=5, block_size=16, pages=20) == 3
    # Llama-2-7B at KV 512 (batch 256, 33 pages of 16 tokens each) in ~60 GB of 8 MiB pages.
    sets = kv_page_sets(batch=256, ctx=512, blocks_per_req=34, block_size=16, pages=7500)
    assert 1 <= sets < 256 and sets * 32 + 256 * 2 <= 7500
    with pytest.raises(ValueError, match="too small"):
        kv_page_sets(batch=8, ctx=64, blocks_per_req=5, block_size=16, pages=11)


def test_shared_context_pages_run_on_the_tiny_model(executor_factory):
    ex = executor_factory()
    ctx, steps, warmup = 16, 2, 1
    per_req = (ctx + steps + warmup + 1 + ex.block_size - 1) // ex.block_size
    first = ex.num_blocks - (per_req + 3 * (per_req - ctx // ex.block_size))  # room for 1 set
    stats: dict = {}
    times = bench_batch(ex, 4, ctx, steps, warmup, first_id=1, first_block=first, stats=stats)
    assert stats["kv_sets"] == 1 and len(times) == steps
