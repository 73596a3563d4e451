"""Sampler: greedy, top-k/top-p truncation, seeded batch-invariant draws, distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve import wire
from deltaserve.worker.sampler import Sampler, seed_for


def sp(
    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None, logprobs: int | None = None
):
    return wire.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, logprobs=logprobs)


def rand_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3.0


def test_greedy_is_argmax() -> None:
    logits = rand_logits(8, 100)
    out = Sampler().sample(logits, [sp(temperature=0.0)] * 8, [0] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8 and out.top_logprobs == [[]] * 8


@pytest.mark.parametrize("seed", [None, 7])
def test_top_k_one_and_tiny_top_p_are_greedy(seed: int | None) -> None:
    logits = rand_logits(16, 300, seed=1)
    sampler = Sampler(seed=3)
    argmax = logits.argmax(-1).tolist()
    for _ in range(5):
        assert (
            sampler.sample(logits, [sp(temperature=1.5, top_k=1, seed=seed)] * 16, list(range(16))).token_ids == argmax
        )
        assert (
            sampler.sample(logits, [sp(temperature=1.5, top_p=1e-6, seed=seed)] * 16, list(range(16))).token_ids
            == argmax
        )


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = rand_logits(6, 50, seed=2)
    params = [sp(0.0), sp(1.0), sp(0.0, seed=1), sp(2.0, seed=5), sp(1.0, top_k=3), sp(0.0)]
    out = Sampler().sample(logits, params, [0] * 6)
    argmax = logits.argmax(-1).tolist()
    for r in (0, 2, 5):
        assert out.token_ids[r] == argmax[r]
    assert out.token_ids[4] in logits[4].topk(3).indices.tolist()


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    vocab = 64
    row = torch.zeros(vocab)  # flat distribution: every draw is pure generator output
    mine = sp(temperature=1.0, seed=1234)
    alone = [Sampler(seed=0).sample(row[None], [mine], [i]).token_ids[0] for i in range(40)]
    others = rand_logits(5, vocab, seed=9)
    batched = []
    sampler = Sampler(seed=99)  # a different global stream, other rows unseeded / seeded / truncated
    for i in range(40):
        logits = torch.cat([others[:2], row[None], others[2:]])
        params = [sp(1.0), sp(0.7, seed=5), mine, sp(1.0, top_k=4), sp(0.0), sp(1.3, top_p=0.5)]
        batched.append(sampler.sample(logits, params, [3, i + 7, i, 0, 1, 2]).token_ids[2])
    assert batched == alone
    assert len(set(alone)) > 10, "draws for different output indices must differ"
    other_seed = [Sampler().sample(row[None], [sp(1.0, seed=1235)], [i]).token_ids[0] for i in range(40)]
    assert other_seed != alone


def test_seed_for_is_stable_and_spread() -> None:
    assert seed_for(1, 0) == seed_for(1, 0)
    assert len({seed_for(s, i) for s in range(10) for i in range(10)}) == 100
    assert all(0 <= seed_for(s, 3) < 2**63 for s in (0, 2**64 - 1))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    keep = probs > 0
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum())


# 99.9% quantiles of chi-square with df degrees of freedom (df = support size - 1).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize(
    "params, support",
    [
        (dict(temperature=0.7), 8),
        (dict(temperature=1.3, top_k=3), 3),
        (dict(temperature=1.0, top_p=0.8), None),
    ],
)
def test_sampling_frequencies_match_the_distribution(params: dict, support: int | None) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    n = 20000
    out = Sampler(seed=11).sample(logits.expand(n, -1).contiguous(), [sp(**params)] * n, [0] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).float()

    probs = torch.softmax(logits / params["temperature"], -1)
    if "top_k" in params:
        probs[params["top_k"] :] = 0
    if "top_p" in params:
        before = probs.cumsum(0) - probs
        probs[before >= params["top_p"]] = 0
        support = int((probs > 0).sum())
    probs = probs / probs.sum()
    assert int((counts > 0).sum()) == support, f"tokens outside the truncated support were drawn: {counts}"
    assert chi_square(counts, probs) < CHI2_999[support - 1], (counts / n, probs)


def test_logprobs_are_the_unmodified_log_softmax_and_sorted() -> None:
    logits = rand_logits(4, 200, seed=4)
    params = [sp(2.0, top_k=5, logprobs=5), sp(0.0, logprobs=0), sp(1.0), sp(0.0, logprobs=500)]
    out = Sampler().sample(logits, params, [0] * 4)
    reference = torch.log_softmax(logits, -1)
    for r in (0, 1, 3):
        assert out.logprobs[r] == pytest.approx(reference[r, out.token_ids[r]].item(), abs=1e-5)
    assert out.logprobs[2] is None and out.top_logprobs[2] == []
    assert out.top_logprobs[1] == []
    assert len(out.top_logprobs[0]) == 5 and len(out.top_logprobs[3]) == 200  # clamped to the vocab
    for r in (0, 3):
        values = [lp for _, lp in out.top_logprobs[r]]
        assert values == sorted(values, reverse=True)
        ids = [t for t, _ in out.top_logprobs[r]]
        top = reference[r].topk(len(ids))
        assert ids == top.indices.tolist()
        assert values == pytest.approx(top.values.tolist(), abs=1e-5)
    # The greedy row with logprobs: sampled token is the best alternative.
    assert out.top_logprobs[3][0][0] == out.token_ids[3]
    assert math.isclose(out.top_logprobs[3][0][1], out.logprobs[3], abs_tol=1e-6)


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 logit rows"):
        Sampler().sample(rand_logits(2, 10), [sp()], [0])
