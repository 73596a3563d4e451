"""Prompt logprobs (``worker/prompt_logprobs.py``): which rows of a step score prompt tokens across
chunked prefills, and the scores they give (the e2e test compares them with transformers)."""

from __future__ import annotations

import torch

from deltaserve import wire
from deltaserve.worker import prompt_logprobs
from deltaserve.worker.requests import RequestState


def state(req_id: int, prompt: int, computed: int, top_n: int | None) -> RequestState:
    return RequestState(
        req_id=req_id,
        token_ids=list(range(10, 10 + prompt)),
        num_prompt_tokens=prompt,
        num_computed=computed,
        block_table=[],
        sampling=wire.SamplingParams(prompt_logprobs=top_n),
        variant_id=req_id,
    )


def test_rows_cover_each_chunk_within_the_prompt_only():
    plain = state(1, 4, 0, None)  # asks nothing: rows 0..3
    first_chunk = state(2, 6, 0, 1)  # rows 4..6: positions 1..3
    last_chunk = state(3, 6, 3, 0)  # rows 7..9 at positions 3..5: scores 4, 5 (row 9 predicts the output)
    decoding = state(4, 2, 2, 0)  # row 10: past the prompt
    selected = prompt_logprobs.select([(plain, 4), (first_chunk, 3), (last_chunk, 3), (decoding, 1)])
    assert selected is not None
    assert [(s.state.req_id, s.first, s.count) for s in selected.spans] == [(2, 1, 3), (3, 4, 2)]
    assert selected.rows == [4, 5, 6, 7, 8]
    assert selected.variant_ids == [2, 2, 2, 3, 3]
    assert prompt_logprobs.select([(plain, 4), (decoding, 1)]) is None


def test_scores_are_the_log_softmax_of_each_rows_next_token():
    a, b = state(1, 3, 0, 2), state(2, 2, 0, 0)
    selected = prompt_logprobs.select([(a, 3), (b, 2)])
    assert selected is not None
    logits = torch.randn(len(selected.rows), 40)
    out = prompt_logprobs.launch(selected, logits).result()
    ref = torch.log_softmax(logits, dim=-1)
    assert [p.position for p in out[1]] == [1, 2] and [p.position for p in out[2]] == [1]
    assert abs(out[1][1].logprob - ref[1, a.token_ids[2]].item()) < 1e-6
    assert abs(out[2][0].logprob - ref[2, b.token_ids[1]].item()) < 1e-6 and out[2][0].top_logprobs == []
    top = out[1][0].top_logprobs
    assert [t.token_id for t in top] == ref[0].topk(2).indices.tolist()
    assert abs(top[0].logprob - ref[0].max().item()) < 1e-6
