"""Per-request state on the worker, and a plan's request diffs applied to it.

The router sends each request in full once (``NewRequest``: tokens, pages, sampling, variant) and
then only what changed (``RunningRequest``: tokens to compute, pages appended); ``released`` ends
it. State machine of one request on the worker::

    (absent) ──NewRequest──> held ──RunningRequest*──> held ──released──> (absent)
                               └── a failed step (PlanError) also drops the step's requests ──┘

Every function here runs after the plan check (``plan_check.py``) accepted the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltaserve import wire

if TYPE_CHECKING:
    from .guidance import Constrained


@dataclass
class RequestState:
    """What the worker keeps for one request between steps."""

    #: Router-assigned id.
    req_id: int
    #: Every known token: prompt, then outputs (the last one possibly not yet computed).
    token_ids: list[int]
    #: Prompt tokens at the front of ``token_ids``; output i is ``token_ids[num_prompt_tokens + i]``.
    num_prompt_tokens: int
    #: Leading tokens whose K/V is in the cache.
    num_computed: int
    #: KV pages in position order.
    block_table: list[int]
    #: How to sample this request's tokens.
    sampling: wire.SamplingParams
    #: The variant (LoRA adapter or delta; the wire's ``adapter_id``) this request's tokens run with
    #: (GPU-resident whenever the request is scheduled), 0 for the base alone.
    variant_id: int = 0
    #: Tokens sampled by a launched step that ``finish`` has not appended yet (0 or 1): they are
    #: known to exist, so the next step may compute them (from the device) before they reach us.
    pending: int = 0
    #: The prompt on the device, kept by the sampler for a ``repetition_penalty`` (``logit_adjust``).
    prompt_on_device: torch.Tensor | None = None
    #: Structured output: the request's grammar matcher (``guidance.py``); None when unconstrained.
    grammar: Constrained | None = None


def release(requests: dict[int, RequestState], plan: wire.StepPlan) -> None:
    """Forgets the requests ``plan`` releases (finished, aborted or preempted)."""
    for req_id in plan.released:
        requests.pop(req_id, None)


def admit(requests: dict[int, RequestState], plan: wire.StepPlan) -> list[tuple[RequestState, int]]:
    """Registers ``plan``'s new requests and appends its running requests' pages; returns every
    scheduled request with its token count, in batch order (new ones, then running ones)."""
    for new in plan.new_requests:
        requests[new.req_id] = RequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            num_computed=new.num_computed_tokens,
            block_table=list(new.block_ids),
            sampling=new.sampling,
            variant_id=new.adapter_id,
        )
    for run in plan.running:
        requests[run.req_id].block_table.extend(run.new_block_ids)
    return [(requests[n.req_id], n.num_scheduled_tokens) for n in plan.new_requests if n.num_scheduled_tokens > 0] + [
        (requests[r.req_id], r.num_scheduled_tokens) for r in plan.running
    ]


def drop_step_requests(requests: dict[int, RequestState], plan: wire.StepPlan) -> list[int]:
    """After a failed step: forgets every request the plan released or scheduled; returns the
    scheduled ones' ids (the router is told they failed and re-sends a retry in full)."""
    failed = [n.req_id for n in plan.new_requests] + [r.req_id for r in plan.running]
    for req_id in list(plan.released) + failed:
        requests.pop(req_id, None)
    return list(dict.fromkeys(failed))
