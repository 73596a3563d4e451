"""The logits a request samples from, before temperature: ``logit_bias``, ``min_tokens`` bans and
the presence / frequency / repetition penalties, applied to the rows that ask for them.

Order (vLLM's): bias, then the ``min_tokens`` ban, then penalties (repetition, frequency,
presence)::

    logits [S, V] ─ clone ─ += logit_bias ─ banned ids -> -inf (output index < min_tokens)
        └─ penalized rows: repetition over prompt + outputs (divide if > 0, else multiply),
                           - frequency * count(outputs), - presence * [count(outputs) > 0]

Counting the tokens so far: the host knows every token of a request but, with overlapped steps,
the one a still-running step is sampling (``RequestState.pending``): that token exists only in
the in-flight step's sampled tensor. The counts are therefore built on the device each step from
the host-known tokens (one scatter) plus one more scatter of ``in_flight`` (a LongTensor with each
row's in-flight token, -1 where none), so nothing waits for the device. The cost, paid only by
penalized rows, is copying their output tokens to the device each step; a ``repetition_penalty``
row's prompt is copied once and kept on its history (``prompt_on_device``). Every operation is
row-local and the counts are exact integers, so a row's result does not depend on the rest of its
batch (``bench/sampler_options.py`` measures the cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Protocol

import torch

from deltaserve.model.batch import to_device

if TYPE_CHECKING:
    from deltaserve import wire


class TokenHistory(Protocol):
    """A request's tokens as the host knows them (``RequestState`` is one)."""

    #: Prompt, then the output tokens the host has (an in-flight one is not among them).
    token_ids: list[int]
    #: Prompt tokens at the front of ``token_ids``.
    num_prompt_tokens: int
    #: The prompt as a LongTensor on the sampler's device, set by the first step that needs it.
    prompt_on_device: torch.Tensor | None


def is_penalized(p: wire.SamplingParams) -> bool:
    """Whether ``p`` has a penalty that is not at its neutral value (it then needs the history)."""
    pen = p.penalties
    return pen is not None and (pen.presence != 0.0 or pen.frequency != 0.0 or uses_repetition(pen.repetition))


def uses_repetition(value: float) -> bool:
    """A repetition penalty that changes something (1 and the wire default 0 are off)."""
    return value > 0.0 and value != 1.0


def is_banning(p: wire.SamplingParams, output_index: int) -> bool:
    """Whether ``min_tokens`` bans some tokens for output token ``output_index``."""
    return bool(p.min_tokens_banned) and output_index < p.min_tokens


def adjusted_logits(
    logits: torch.Tensor,
    params: Sequence[wire.SamplingParams],
    output_index: Sequence[int],
    history: Sequence[TokenHistory] | None,
    in_flight: torch.Tensor | None,
) -> torch.Tensor:
    """``logits`` [S, V] float32 with every row's bias, ban and penalties applied (a new tensor), or
    ``logits`` itself when no row has any (no work at all).

    ``history[r]`` is row r's known tokens (needed when some row is penalized); ``in_flight`` [S]
    (on the logits' device) is row r's output token still being sampled by the previous step, or
    -1; ``None`` when no row has one.
    """
    bias_rows = [r for r, p in enumerate(params) if p.logit_bias]
    ban_rows = [r for r, p in enumerate(params) if is_banning(p, output_index[r])]
    penalized = [r for r, p in enumerate(params) if is_penalized(p)]
    if not (bias_rows or ban_rows or penalized):
        return logits
    device = logits.device
    out = logits.clone()
    if bias_rows:
        rows = [r for r in bias_rows for _ in params[r].logit_bias]
        ids = [b.token_id for r in bias_rows for b in params[r].logit_bias]
        values = [b.bias for r in bias_rows for b in params[r].logit_bias]
        where = (to_device(rows, torch.long, device), to_device(ids, torch.long, device))
        out.index_put_(where, to_device(values, torch.float32, device), accumulate=True)
    if ban_rows:
        rows = [r for r in ban_rows for _ in params[r].min_tokens_banned]
        ids = [t for r in ban_rows for t in params[r].min_tokens_banned]
        out[to_device(rows, torch.long, device), to_device(ids, torch.long, device)] = float("-inf")
    if penalized:
        if history is None or len(history) != len(params):
            raise ValueError("penalized rows need every row's token history")
        index = to_device(penalized, torch.long, device)
        pending = in_flight.index_select(0, index) if in_flight is not None else None
        out[index] = apply_penalties(
            out.index_select(0, index),
            [params[r].penalties for r in penalized],  # type: ignore[misc]  # is_penalized: not None
            [history[r] for r in penalized],
            pending,
        )
    return out


def apply_penalties(
    logits: torch.Tensor,
    penalties: Sequence[wire.Penalties],
    history: Sequence[TokenHistory],
    pending: torch.Tensor | None,
) -> torch.Tensor:
    """Penalties of R rows: logits [R, V] (modified in place and returned), one ``Penalties`` and
    history per row, ``pending`` [R] the in-flight output token per row or -1 (None: none)."""
    vocab = logits.shape[1]
    device = logits.device
    outputs = [h.token_ids[h.num_prompt_tokens :] for h in history]
    flat = to_device(list(chain.from_iterable(outputs)), torch.long, device)  # one copy for every row
    counts = token_counts(flat, [len(o) for o in outputs], vocab)
    if pending is not None:
        present = (pending >= 0).to(counts.dtype).unsqueeze(1)
        counts.scatter_add_(1, pending.clamp_min(0).unsqueeze(1), present)
    repetition = [p.repetition if uses_repetition(p.repetition) else 1.0 for p in penalties]
    if any(v != 1.0 for v in repetition):
        prompts = [prompt_tokens(h, device) for h, p in zip(history, penalties) if uses_repetition(p.repetition)]
        lengths = [h.num_prompt_tokens if uses_repetition(p.repetition) else 0 for h, p in zip(history, penalties)]
        seen = (token_counts(torch.cat(prompts), lengths, vocab) + counts) > 0
        factor = to_device(repetition, torch.float32, device).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / factor, logits * factor)
        logits = torch.where(seen, penalized, logits)
    frequency = [p.frequency for p in penalties]
    if any(frequency):
        logits -= to_device(frequency, torch.float32, device).unsqueeze(1) * counts
    presence = [p.presence for p in penalties]
    if any(presence):
        logits -= to_device(presence, torch.float32, device).unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def prompt_tokens(history: TokenHistory, device: torch.device) -> torch.Tensor:
    """``history``'s prompt on ``device``, copied there once (kept on the history)."""
    if history.prompt_on_device is None or history.prompt_on_device.device != device:
        history.prompt_on_device = to_device(history.token_ids[: history.num_prompt_tokens], torch.long, device)
    return history.prompt_on_device


def token_counts(ids: torch.Tensor, lengths: list[int], vocab: int) -> torch.Tensor:
    """[len(lengths), vocab] float32: how many times each token id occurs in each row, where ``ids``
    (a LongTensor on the device) holds row 0's ``lengths[0]`` tokens, then row 1's, and so on."""
    num_rows = len(lengths)
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=ids.device)
    if len(ids):
        # output_size: the device need not be asked how long the result is (no sync).
        repeats = to_device(lengths, torch.long, ids.device)
        rows = torch.repeat_interleave(torch.arange(num_rows, device=ids.device), repeats, output_size=len(ids))
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    return counts
