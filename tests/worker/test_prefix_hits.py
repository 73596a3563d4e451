"""The executor on plans from the router's scheduler with prefix caching on (the router's default):
a new request may start on pages other requests computed (``num_computed_tokens`` > 0, its first
pages shared), and its tokens are the ones it gets computing its whole prompt, in one step at a
time and overlapped, sampled and seeded included; a preempted request resumes on its own cached
pages; a prompt-logprobs request computes its whole prompt. Tiny Llama on CPU."""

from __future__ import annotations

import pytest

from deltaserve import wire
from helpers.executors import hf_greedy, prompts
from helpers.sched_driver import GREEDY, SchedDriver

SEEDED = wire.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, logprobs=None)


def shared_prefix_requests(vocab: int) -> dict[int, tuple[list[int], int]]:
    """Three identical prompts (`n` = 3) and two that share their first 40 tokens."""
    system = prompts(1, vocab, seed=7, lo=40, hi=40)[0]
    tails = prompts(3, vocab, seed=8, lo=3, hi=9)
    return {
        1: (system + tails[0], 6),
        2: (system + tails[0], 6),
        3: (system + tails[0], 6),
        4: (system + tails[1], 5),
        5: (system + tails[2], 7),
    }


ARRIVALS = {1: 0, 2: 0, 3: 0, 4: 2, 5: 9}
SAMPLING = {5: SEEDED}


@pytest.fixture(scope="module")
def whole_prefills(executor_factory, hf_model):
    """The requests, and their tokens with prefix caching off (each prompt computed whole)."""
    reqs = shared_prefix_requests(executor_factory().config.vocab_size)
    plain = SchedDriver(executor_factory()).run(reqs, arrivals=ARRIVALS, sampling=SAMPLING)
    assert plain[1] == plain[2] == plain[3] == hf_greedy(hf_model, reqs[1][0], 6)
    return reqs, plain


@pytest.mark.parametrize("pipelined", [False, True])
def test_hits_give_the_tokens_of_whole_prefills(executor_factory, whole_prefills, pipelined) -> None:
    reqs, plain = whole_prefills
    ex = executor_factory()
    cached_driver = SchedDriver(ex, enable_prefix_caching=True)
    run = cached_driver.run_pipelined if pipelined else cached_driver.run
    assert run(reqs, arrivals=ARRIVALS, sampling=SAMPLING) == plain
    stats = cached_driver.sched.stats()
    block = ex.hello(wire.SCHEMA_HASH).kv.block_size
    whole_pages = (len(reqs[1][0]) - 1) // block * block
    assert stats["prefix_hit_tokens"] >= 2 * whole_pages, stats  # choices 2 and 3 at least


def test_a_preempted_request_resumes_on_its_cached_pages(executor_factory) -> None:
    ex = executor_factory()
    prompt = prompts(1, ex.config.vocab_size, seed=4, lo=37, hi=37)[0]
    expected = SchedDriver(executor_factory()).run({1: (prompt, 12)}, sampling={1: GREEDY})[1]
    router = SchedDriver(ex, enable_prefix_caching=True)
    router.add(1, prompt, 12)
    while len(router.outputs[1]) < 5:
        router.step()
    assert router.preempt(1)
    plan = router.plan()
    assert plan.new_requests[0].token_ids == prompt + router.outputs[1]
    assert plan.new_requests[0].num_computed_tokens > 0, "its published pages were still cached"
    router.apply(router.ex.step(plan))
    while router.unfinished:
        router.step()
    assert router.outputs[1] == expected


def test_a_prompt_logprobs_request_computes_its_whole_prompt(executor_factory) -> None:
    ex = executor_factory()
    prompt = prompts(1, ex.config.vocab_size, seed=5, lo=40, hi=40)[0]
    echo = wire.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=None, prompt_logprobs=0)
    router = SchedDriver(ex, enable_prefix_caching=True)
    router.run({1: (prompt, 2)})
    router.add(2, prompt, 2, echo)
    plan = router.plan()
    assert plan.new_requests[0].num_computed_tokens == 0
    out = router.ex.step(plan)
    router.apply(out)
    (o,) = out.outputs
    assert len(o.prompt_logprobs) == len(prompt) - 1
