"""``deltaserve.LLM`` on the tiny Llama (CPU): greedy tokens of the base, a PEFT adapter and a
compressed delta, asked for in one batched call, equal transformers (on the PEFT model and on the
delta's dense reference); chat renders the model's template; logprobs, stop strings, per-prompt
sampling; bad requests raise ``ValueError`` and change nothing; calls work inside a running asyncio
loop; a variant registered at run time is served."""

from __future__ import annotations

import asyncio

import pytest
import torch

import deltaserve
from deltaserve import SamplingParams
from helpers.executors import hf_greedy
from helpers.peft_adapters import hf_model

from .conftest import SMALL

N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama, variant_dirs):
    with deltaserve.LLM(
        tiny_llama, loras={"sql": variant_dirs["sql"][0]}, deltas={"ft": variant_dirs["ft"][0]}, **SMALL
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))


def test_greedy_base_lora_and_delta_in_one_call_equal_transformers(llm, tiny_llama, variant_dirs, tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in ("the quick brown fox", "hello world")]
    variants = [None, "sql", "ft"]
    batch = [(p, v) for v in variants for p in prompts]
    outs = llm.generate([p for p, _ in batch], GREEDY, variant=[v for _, v in batch])
    base = hf_model(tiny_llama)
    refs = {
        None: base,
        "sql": PeftModel.from_pretrained(hf_model(tiny_llama), variant_dirs["sql"][0]).eval(),
        "ft": AutoModelForCausalLM.from_pretrained(variant_dirs["ft"][1], dtype=torch.float32).eval(),
    }
    for (prompt, variant), out in zip(batch, outs):
        assert out.variant == variant and out.prompt_token_ids == prompt
        got = out.outputs[0]
        assert got.token_ids == hf_greedy(refs[variant], prompt, N), variant
        assert got.finish_reason == "length" and got.logprobs is None
        assert got.text == tokenizer.decode(got.token_ids, skip_special_tokens=False)
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids != outs[4].outputs[0].token_ids


def test_text_prompts_chat_logprobs_and_stop_strings(llm, tokenizer):
    [plain] = llm.generate("the quick brown fox", SamplingParams(temperature=0, max_tokens=6, logprobs=2))
    got = plain.outputs[0]
    assert plain.prompt == "the quick brown fox"
    assert len(got.token_ids) == len(got.logprobs) == len(got.top_logprobs) == 6
    assert all(lp <= 0 for lp in got.logprobs) and all(len(alts) == 2 for alts in got.top_logprobs)
    assert got.cumulative_logprob == pytest.approx(sum(got.logprobs))
    # The greedy token is the top alternative.
    assert [max(alts, key=alts.__getitem__) for alts in got.top_logprobs] == got.token_ids

    stop = got.text[len(got.text) // 2 :].strip() or got.text
    [cut] = llm.generate("the quick brown fox", SamplingParams(temperature=0, max_tokens=6, stop=stop))
    assert stop not in cut.outputs[0].text and cut.outputs[0].finish_reason == "stop"

    messages = [{"role": "user", "content": "hello world"}]
    [chat] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), variant="sql")
    rendered = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False).ids
    [same] = llm.generate(
        chat.prompt_token_ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), variant="sql"
    )
    assert chat.outputs[0].token_ids == same.outputs[0].token_ids
    two = llm.chat([messages, messages], [GREEDY, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in two] == [N, 2]

    # The logit-shaping fields pass through: a +100 bias forces its token, a stop id ends there.
    forced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={5: 100.0}, stop_token_ids=[6])
    [biased] = llm.generate("the quick brown fox", forced)
    assert biased.outputs[0].token_ids == [5, 5, 5]


def test_bad_requests_raise_value_error_and_nothing_runs(llm):
    before = llm_finished(llm)
    with pytest.raises(ValueError, match="request 1: .*temperature"):
        llm.generate(["a", "b"], [GREEDY, SamplingParams(temperature=5)])
    with pytest.raises(ValueError, match="request 0: .*presence_penalty"):
        llm.generate("a", SamplingParams(presence_penalty=3))
    with pytest.raises(ValueError, match="request 0: The model `nope` does not exist"):
        llm.generate("a", GREEDY, variant="nope")
    with pytest.raises(ValueError, match="variant: 1 given for 2 requests"):
        llm.generate(["a", "b"], GREEDY, variant=["sql"])
    with pytest.raises(ValueError, match="kind"):
        llm.register("x", "/nonexistent", kind="full")
    assert llm_finished(llm) == before
    assert llm.generate([], GREEDY) == []


def test_works_inside_a_running_event_loop_and_registers_at_run_time(llm, variant_dirs):
    async def in_loop():
        return llm.generate("hello", GREEDY, variant="sql")[0].outputs[0].token_ids

    expected = llm.generate("hello", GREEDY, variant="sql")[0].outputs[0].token_ids
    assert asyncio.run(in_loop()) == expected
    entry = llm.register("sql2", variant_dirs["sql"][0])
    assert entry["name"] == "sql2" and entry["footprint"]["kind"] == "lora"
    assert llm.generate("hello", GREEDY, variant="sql2")[0].outputs[0].token_ids == expected
    llm.unregister("sql2")
    with pytest.raises(ValueError, match="sql2"):
        llm.generate("hello", GREEDY, variant="sql2")


def llm_finished(llm) -> float:
    """Requests the engine finished so far."""
    return llm.metrics()["deltaserve_requests_finished_total"]
