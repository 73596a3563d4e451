"""Structured output on the worker (``guidance.py``): grammar masks on a tiny random Llama, with
plans from the router's own scheduler (``SchedDriver``).

The model is random, so whatever it emits under a JSON-schema grammar parses and validates
because of the masks alone; unconstrained rows of the same (overlapped) batches are unchanged;
steps launched before the previous one finished give the same tokens as steps run one at a time
(the mask follows the token sampled one step earlier); a preempted request's matcher is rebuilt
from its outputs; a grammar that does not compile refuses its request and nothing else.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deltaserve import wire
from deltaserve.worker.guidance import apply_bitmask
from helpers.executors import prompts
from helpers.json_schemas import PERSON
from helpers.sched_driver import GREEDY, SchedDriver

SCHEMA = PERSON
# As the router writes it (validate/response_format.rs): json.dumps' separators, no other whitespace.
OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR = json.dumps({"grammars": [{"json_schema": {**SCHEMA, "x-guidance": OPTIONS}}]})
MAX_NEW = 40


def constrained(**fields) -> wire.SamplingParams:
    return dataclasses.replace(GREEDY, grammar=GRAMMAR, **fields)


def json_of(tokens: list[int], eos: list[int], tokenizer) -> dict:
    """The text before the first EOS (any of the model's ids), parsed and checked against ``SCHEMA``."""
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    assert end is not None, f"the grammar ends with EOS: {tokens}"
    value = json.loads(tokenizer.decode(tokens[:end]))
    assert set(value) == {"name", "age", "pet"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 2
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99
    assert value["pet"] in ("cat", "dog")
    assert set(tokens[end:]) <= set(eos), "after a complete grammar only EOS is allowed"
    return value


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))


def test_masks_make_a_random_model_emit_schema_valid_json_in_mixed_overlapped_batches(
    executor_factory, tokenizer
) -> None:
    ex = executor_factory()
    eos = ex.config.eos_token_ids
    ps = prompts(4, ex.config.vocab_size, seed=11, lo=3, hi=12)
    reqs = {i: (p, MAX_NEW) for i, p in enumerate(ps)}
    arrivals = {i: i // 2 for i in reqs}
    sampling = {0: constrained(), 2: constrained(temperature=0.9, seed=5)}
    plain = SchedDriver(executor_factory(), max_num_batched_tokens=8).run(reqs, arrivals)
    in_order = SchedDriver(ex, max_num_batched_tokens=8).run(reqs, arrivals, sampling)
    overlapped = SchedDriver(executor_factory(), max_num_batched_tokens=8).run_pipelined(reqs, arrivals, sampling)
    assert overlapped == in_order, "masks follow the token sampled one step earlier"
    for i in (1, 3):
        assert in_order[i] == plain[i], "unconstrained rows of the batch are unchanged"
    for i in (0, 2):
        json_of(in_order[i], eos, tokenizer)
        assert in_order[i] != plain[i]
    alone = SchedDriver(executor_factory()).run({2: reqs[2]}, {}, {2: sampling[2]})[2]
    assert alone == in_order[2], "a seeded constrained row samples the same tokens whatever its batch"


def test_preempted_request_rebuilds_its_matcher_from_its_outputs(executor_factory, tokenizer) -> None:
    ex = executor_factory()
    prompt = prompts(1, ex.config.vocab_size, seed=12, lo=6, hi=6)[0]
    expected = SchedDriver(executor_factory()).run({1: (prompt, MAX_NEW)}, {}, {1: constrained()})[1]
    router = SchedDriver(ex)
    router.add(1, prompt, MAX_NEW, constrained())
    while len(router.outputs[1]) < 5:
        router.step()
    assert router.preempt(1)
    while router.unfinished:
        router.step()
    assert router.outputs[1] == expected
    json_of(expected, ex.config.eos_token_ids, tokenizer)


def test_a_grammar_that_does_not_compile_refuses_only_its_request(executor_factory) -> None:
    ex = executor_factory()
    bad = json.dumps({"grammars": [{"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}]})
    router = SchedDriver(ex)
    router.add(1, [5, 6, 7], 4, dataclasses.replace(GREEDY, grammar=bad))
    router.add(2, [5, 6, 7], 4)
    plan = router.plan()
    out = ex.step(plan)
    assert [r.req_id for r in out.refused_requests] == [1]
    assert "/nope" in out.refused_requests[0].message
    assert [o.req_id for o in out.outputs] == [2] and 1 not in ex.requests
    # A plan formed before the router heard of it still runs it: skipped, not a plan error.
    again = wire.StepPlan(
        step_id=plan.step_id + 1,
        running=[
            wire.RunningRequest(req_id=1, num_scheduled_tokens=1, new_block_ids=[]),
            wire.RunningRequest(req_id=2, num_scheduled_tokens=1, new_block_ids=[]),
        ],
    )
    out2 = ex.step(again)
    assert [o.req_id for o in out2.outputs] == [2] and out2.refused_requests == []


def test_apply_bitmask_touches_only_the_masked_rows() -> None:
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 2] = 1 << 1  # token 65
    bitmask[0, 1] = -(1 << 31)  # bit 31 of word 1: token 63
    out = apply_bitmask(logits.clone(), [1], bitmask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5, 63, 65]
