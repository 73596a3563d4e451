"""Requests for the benchmarks that drive ``Executor.step`` themselves (no router): the one place they
build a ``wire.NewRequest``, and the greedy sampling they share.

    new_request(req_id, token_ids, block_ids, computed=0, scheduled=None, adapter_id=0, sampling=GREEDY)

Import after ``bench.script_env.prepare()`` (it imports ``deltaserve``).
"""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve import wire

GREEDY = wire.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=None)
"""Temperature 0: every benchmark's tokens are deterministic."""


def new_request(
    req_id: int,
    token_ids: Sequence[int],
    block_ids: Sequence[int],
    computed: int = 0,
    scheduled: int | None = None,
    adapter_id: int = 0,
    sampling: wire.SamplingParams = GREEDY,
) -> wire.NewRequest:
    """A new request whose prompt is ``token_ids`` (all of them), with its first ``computed`` tokens
    already in the KV pages ``block_ids`` (a cached prefix, or a decode's context) and ``scheduled``
    tokens this step (default: the rest of the prompt)."""
    return wire.NewRequest(
        req_id=req_id,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        num_computed_tokens=computed,
        num_scheduled_tokens=len(token_ids) - computed if scheduled is None else scheduled,
        block_ids=list(block_ids),
        sampling=sampling,
        adapter_id=adapter_id,
    )
