"""Prompt logprobs (``SamplingParams.prompt_logprobs``, the API's ``echo`` with ``logprobs``): the
log-probability of each prompt token given the tokens before it, with its top alternatives.

Only a request that asks costs anything: its prefill chunk's rows get logits too (the forward
returns logits for ``ForwardBatch.logits_indices``; these rows are appended after the sampling
rows), and the token at position ``p`` (``1 <= p < num_prompt_tokens``) is scored by the row at
``p - 1``. The prompt's last row predicts the first output token: the sampler's row, not this.
A chunk sends the positions it computed, in its ``RequestOutput``; a request recomputed after a
preemption sends them again, and the router keeps the first. Logprobs are those of the model's
unmodified distribution (as the sampler's), so they equal ``log_softmax(logits)`` of a reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve import wire
from deltaserve.model.batch import to_device

from .requests import RequestState


@dataclass
class PromptSpan:
    """The prompt positions one request scores this step."""

    state: RequestState
    #: The first prompt position scored (its logits row is the one before it).
    first: int
    #: Positions scored: ``first .. first + count``.
    count: int
    #: Top alternatives asked for.
    top_n: int


@dataclass
class PromptRows:
    """The step's extra logits rows, in batch row order, and whose they are."""

    spans: list[PromptSpan]
    #: Forward-batch row of each scored position's predecessor, in span order.
    rows: list[int]

    @property
    def variant_ids(self) -> list[int]:
        """The variant of each extra logits row (``StepRows.logit_ids`` continues with these)."""
        return [s.state.variant_id for s in self.spans for _ in range(s.count)]


def select(scheduled: list[tuple[RequestState, int]]) -> PromptRows | None:
    """The rows of ``scheduled`` (before their ``num_computed`` advances) whose logits score prompt
    tokens; None when no request asks."""
    spans: list[PromptSpan] = []
    rows: list[int] = []
    row = 0
    for state, n in scheduled:
        top_n = state.sampling.prompt_logprobs
        if top_n is not None:
            stop = min(state.num_computed + n, state.num_prompt_tokens - 1)
            count = stop - state.num_computed
            if count > 0:
                spans.append(PromptSpan(state, state.num_computed + 1, count, int(top_n)))
                rows.extend(range(row, row + count))
        row += n
    return PromptRows(spans, rows) if spans else None


@dataclass
class LaunchedPromptLogprobs:
    """Prompt logprobs queued on the device."""

    spans: list[PromptSpan]
    #: [rows]: each scored token's logprob.
    picked: torch.Tensor
    #: [rows, max top_n]: the best logprobs and their ids (None when no span asked for any).
    top_vals: torch.Tensor | None
    top_ids: torch.Tensor | None

    def result(self) -> dict[int, list[wire.PromptLogprob]]:
        """req_id -> its positions' entries (waits for the device)."""
        picked = self.picked.tolist()
        top_vals = self.top_vals.tolist() if self.top_vals is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        out: dict[int, list[wire.PromptLogprob]] = {}
        j = 0
        for span in self.spans:
            entries = out.setdefault(span.state.req_id, [])
            for k in range(span.count):
                top = []
                if top_vals is not None and top_ids is not None and span.top_n:
                    top = [
                        wire.TokenLogprob(token_id=t, logprob=v)
                        for t, v in zip(top_ids[j][: span.top_n], top_vals[j][: span.top_n])
                    ]
                entries.append(wire.PromptLogprob(position=span.first + k, logprob=picked[j], top_logprobs=top))
                j += 1
        return out


def launch(selected: PromptRows, logits: torch.Tensor) -> LaunchedPromptLogprobs:
    """Scores the selected positions from their rows' float32 ``logits`` [rows, vocab] (the forward
    already holds those: a chunk of ``c`` prompt tokens costs ``c x vocab x 4`` bytes of logits)."""
    # logit - logsumexp: no second [rows, vocab] tensor beside the logits (a long prompt's chunk
    # may have thousands of rows).
    targets = [s.state.token_ids[p] for s in selected.spans for p in range(s.first, s.first + s.count)]
    norm = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, to_device(targets, torch.long, logits.device).unsqueeze(1)).squeeze(1) - norm
    top_n = min(max(s.top_n for s in selected.spans), logits.shape[-1])
    top_vals = top_ids = None
    if top_n > 0:
        top_vals, top_ids = logits.topk(top_n, dim=-1, sorted=True)
        top_vals = top_vals - norm.unsqueeze(1)
    return LaunchedPromptLogprobs(selected.spans, picked, top_vals, top_ids)
