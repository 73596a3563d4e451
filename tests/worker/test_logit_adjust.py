"""logit_bias, min_tokens and the presence / frequency / repetition penalties in the sampler, against
a per-row torch reference (transformers' RepetitionPenaltyLogitsProcessor, OpenAI's penalty
formula), in mixed batches; the in-flight token of an overlapped step is counted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from deltaserve import wire
from deltaserve.worker.logit_adjust import adjusted_logits
from deltaserve.worker.sampler import Sampler
from helpers.sched_driver import SchedDriver

VOCAB = 64


@dataclass
class Hist:
    token_ids: list[int]
    num_prompt_tokens: int
    prompt_on_device: torch.Tensor | None = None


def sp(
    temperature: float = 0.0,
    seed: int | None = None,
    bias: dict[int, float] | None = None,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    min_tokens: int = 0,
    banned: list[int] | None = None,
    logprobs: int | None = None,
) -> wire.SamplingParams:
    penalties = None
    if presence or frequency or repetition != 1.0:
        penalties = wire.Penalties(presence=presence, frequency=frequency, repetition=repetition)
    return wire.SamplingParams(
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        seed=seed,
        logprobs=logprobs,
        logit_bias=[wire.LogitBias(token_id=t, bias=b) for t, b in (bias or {}).items()],
        penalties=penalties,
        min_tokens=min_tokens,
        min_tokens_banned=banned or [],
    )


def reference(logits: torch.Tensor, p: wire.SamplingParams, index: int, tokens: list[int], prompt: int) -> torch.Tensor:
    """One row [V], the obvious way (vLLM's order: bias, ban, repetition, frequency, presence)."""
    row = logits.clone()
    for b in p.logit_bias:
        row[b.token_id] += b.bias
    if index < p.min_tokens:
        row[p.min_tokens_banned] = float("-inf")
    if p.penalties is not None:
        pen = p.penalties
        if pen.repetition != 1.0:
            processor = RepetitionPenaltyLogitsProcessor(penalty=pen.repetition)
            row = processor(torch.tensor([tokens]), row.unsqueeze(0)).squeeze(0)
        counts = torch.bincount(torch.tensor(tokens[prompt:], dtype=torch.long), minlength=VOCAB).float()
        # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence.
        row = row - counts * pen.frequency - (counts > 0).float() * pen.presence
    return row


def mixed_batch() -> tuple[list[wire.SamplingParams], list[int], list[Hist], list[int]]:
    """Rows that differ in every option, each with a history and (some) an in-flight token (-1: none)."""
    g = torch.Generator().manual_seed(3)
    params = [
        sp(),
        sp(bias={3: 5.0, 9: -100.0, 60: 100.0}),
        sp(min_tokens=4, banned=[1, 2]),  # active: output index 2
        sp(min_tokens=2, banned=[1, 2]),  # inactive: output index 2
        sp(repetition=1.3),
        sp(repetition=0.7, temperature=0.8, seed=5),
        sp(presence=0.5, frequency=1.5),
        sp(presence=-1.0, frequency=-0.5, temperature=1.0),
        sp(bias={7: 2.0}, repetition=1.2, presence=2.0, frequency=2.0, min_tokens=3, banned=[0]),
    ]
    index = [2] * len(params)
    hist = [
        Hist(torch.randint(0, VOCAB, (12,), generator=g).tolist() + [4, 4, 5][: i % 4], 12) for i in range(len(params))
    ]
    in_flight = [-1, 4, -1, 6, 11, -1, 4, 5, 7]
    return params, index, hist, in_flight


def test_adjustments_match_the_per_row_reference_in_a_mixed_batch() -> None:
    params, index, hist, pending = mixed_batch()
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    got = adjusted_logits(logits, params, index, hist, torch.tensor(pending))
    for r, p in enumerate(params):
        tokens = hist[r].token_ids + ([pending[r]] if pending[r] >= 0 else [])
        want = reference(logits[r], p, index[r], tokens, hist[r].num_prompt_tokens)
        assert torch.equal(torch.isinf(got[r]), torch.isinf(want)), r
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[r][finite], want[finite], rtol=1e-6, atol=1e-5, msg=f"row {r}")
    # The input is never written (the logprobs read it); rows without options are unchanged.
    assert torch.equal(got[0], logits[0])
    plain = [sp(), sp(temperature=1.0, seed=3), sp(min_tokens=2, banned=[1])]
    same = logits[:3]
    assert adjusted_logits(same, plain, [5, 5, 5], None, None) is same  # no row adjusts: no copy


def test_sampler_uses_adjusted_logits_reports_raw_logprobs_and_is_batch_invariant() -> None:
    params, index, hist, pending = mixed_batch()
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    params = [dataclasses.replace(p, logprobs=2) if r % 2 else p for r, p in enumerate(params)]
    sampler = Sampler()
    out = sampler.sample(logits, params, index, hist, torch.tensor(pending))
    assert out.token_ids[1] == 60, "a +100 bias forces its token, greedy included"
    assert out.token_ids[2] not in (1, 2), "banned below min_tokens"
    for r, p in enumerate(params):
        tokens = hist[r].token_ids + ([pending[r]] if pending[r] >= 0 else [])
        if p.temperature == 0.0:
            assert out.token_ids[r] == reference(logits[r], p, index[r], tokens, 12).argmax().item(), r
        if p.logprobs is not None:
            raw = torch.log_softmax(logits[r], -1)
            assert out.logprobs[r] == pytest.approx(raw[out.token_ids[r]].item(), abs=1e-5)
    # Each row alone (no in-flight tensor where it has none) samples what it did in the batch.
    for r in range(len(params)):
        alone = sampler.sample(
            logits[r : r + 1],
            [params[r]],
            [index[r]],
            [hist[r]],
            torch.tensor([pending[r]]) if pending[r] >= 0 else None,
        )
        if params[r].temperature == 0.0 or params[r].seed is not None:
            assert alone.token_ids[0] == out.token_ids[r], r


def test_min_tokens_bans_until_the_index_and_penalties_need_a_history() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 1] = 10.0  # the "EOS" the model wants
    p = sp(min_tokens=3, banned=[1])
    assert Sampler().sample(logits, [p, p], [2, 3], None).token_ids == [0, 1]
    with pytest.raises(ValueError, match="history"):
        Sampler().sample(logits, [sp(presence=1.0), sp()], [0, 0])


def test_penalties_count_the_token_an_overlapped_step_is_still_sampling(executor_factory, monkeypatch) -> None:
    """Overlapped steps (step N+1 launched before step N's token reaches the host) give the tokens
    of steps run one at a time, with penalties that depend on the previous token."""
    ex = executor_factory()
    prompts_ = [
        torch.randint(1, ex.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (3, 5, 8, 4)
    ]
    strong = sp(presence=2.0, frequency=2.0, repetition=3.0)
    sampling = {0: strong, 1: sp(temperature=0.9, seed=11, frequency=1.0, repetition=1.5), 2: strong}
    reqs = {i: (p, 10) for i, p in enumerate(prompts_)}
    arrivals = {i: 0 for i in reqs}
    in_order = SchedDriver(ex, max_num_batched_tokens=16).run(reqs, arrivals, sampling)
    plain = SchedDriver(executor_factory(), max_num_batched_tokens=16).run(reqs, arrivals, None)
    assert in_order[0] != plain[0] and in_order[3] == plain[3], "the penalties change the penalized requests only"
    overlapped_ex = executor_factory()
    seen: list[bool] = []
    launch = overlapped_ex.sampler.launch

    def spy(logits, params, output_index, history=None, in_flight=None, allowed=None):
        seen.append(in_flight is not None)
        return launch(logits, params, output_index, history, in_flight, allowed)

    monkeypatch.setattr(overlapped_ex.sampler, "launch", spy)
    overlapped = SchedDriver(overlapped_ex, max_num_batched_tokens=16).run_pipelined(reqs, arrivals, sampling)
    assert any(seen), "some step sampled while its requests' previous tokens were in flight"
    assert overlapped == in_order
