"""The tiled prefill attention (a CUDA graph's fixed grid, ``worker/mixed_graphs.py``) equals the untiled
launch bit for bit: real tiles compute what the untiled programs compute, idle tile rows (sequence -1)
write nothing, and a padding sequence (tokens, context 0) gets zeros; a mixed batch's one-token
sequences go to the decode kernel (``paged_decode`` over ``query_start_loc``) in both. Under the Triton interpreter
on CPU; with ``DELTASERVE_TEST_GPU=1`` on CUDA (``make test-gpu-kernels``)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.paged_attention import paged_attention, paged_prefill, prefill_block_q, prefill_tiles
from kernels.test_paged_attention import DEVICE, MIXED, build

pytestmark = pytest.mark.gpu_kernels


def test_tiled_prefill_equals_untiled_with_padding() -> None:
    gqa, window = 2, 5  # a head group and a window: the tile walk's two branches
    q, kv, _clean, batch = build(MIXED, 4, gqa, dtype=torch.float16 if DEVICE.type == "cuda" else torch.float32)
    scale = 64**-0.5
    args = (q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, batch.query_start_loc)
    want = paged_attention(*args, batch.max_query_len, scale, window)  # one-token sequences: the decode kernel
    # As a graph bucket lays the step out: 9 padding tokens in a sequence of context 0, one empty
    # sequence, a static max_query_len, and idle tile rows past the real ones.
    pad, t = 9, batch.num_tokens
    qp = torch.cat([q, torch.full((pad, *q.shape[1:]), 7.0, dtype=q.dtype, device=q.device)])
    qsl = torch.cat([batch.query_start_loc, torch.tensor([t + pad, t + pad], dtype=torch.int32, device=q.device)])
    lens = torch.cat([batch.seq_lens, torch.zeros(2, dtype=torch.int32, device=q.device)])
    tables = torch.cat([batch.block_tables, batch.block_tables[:2]])
    block_q = prefill_block_q(q.shape[1], kv.shape[4], DEVICE.type != "cuda")
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    tiles = prefill_tiles(q_lens, block_q) + [-1, 0] * 5
    tiles_t = torch.tensor(tiles, dtype=torch.int32, device=q.device).view(-1, 2)
    got = paged_attention(qp, kv[0, 0], kv[0, 1], tables, lens, qsl, t + pad, scale, window, tiles=tiles_t)
    assert torch.equal(got[:t], want), "tiled programs compute exactly the untiled ones"
    assert torch.equal(got[t:], torch.zeros_like(got[t:])), "the padding sequence (context 0) gets zeros"
    assert len(tiles) // 2 - 5 <= t // block_q + len(q_lens), "the tile bound mixed_graphs.py sizes its table by"


def test_tiles_are_checked() -> None:
    q, kv, _clean, batch = build(MIXED[:2], 4, 1)
    args = (q, kv[0, 0], kv[0, 1], batch.block_tables, batch.seq_lens, batch.query_start_loc, 7, 0.1)
    with pytest.raises(ValueError, match="tiles must be"):
        paged_prefill(*args, tiles=torch.zeros(3, dtype=torch.int32, device=q.device))
