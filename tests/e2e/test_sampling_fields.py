"""logit_bias, min_tokens, stop_token_ids and the penalties through the daemon (tiny Llama, CPU):
a +100 bias forces its token, a stop token id ends the request without its text, min_tokens holds
back an EOS the bias forces, and bad values are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from .wsclient import ws_generate

pytestmark = pytest.mark.gpu_e2e  # `make test-gpu-e2e` also runs it on a GPU (the CUDA sampler)

PROMPT = "once upon a time there was a small model that"


@pytest.fixture(scope="module")
def eos_id(tiny_llama) -> int:
    eos = json.loads((tiny_llama / "config.json").read_text())["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


def greedy(**fields) -> dict:
    return {"prompt": PROMPT, "temperature": 0, "max_tokens": 8, **fields}


def test_bias_stop_token_ids_and_min_tokens(tiny_daemon, tiny_llama, eos_id):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    plain = ws_generate(tiny_daemon.url, {"plain": greedy(ignore_eos=True)})["plain"]["token_ids"]
    # The first output token (after the second) not seen before: stopping on it stops there.
    k = next(i for i in range(2, len(plain)) if plain[i] not in plain[:i])
    forced = 1 if plain[0] != 1 else 2
    got = ws_generate(
        tiny_daemon.url,
        {
            "bias": greedy(ignore_eos=True, logit_bias={str(forced): 100}),
            "stop_id": greedy(ignore_eos=True, stop_token_ids=[plain[k]]),
            "eos_now": greedy(logit_bias={str(eos_id): 100}),
            "eos_later": greedy(logit_bias={str(eos_id): 100}, min_tokens=5),
            "penalized": greedy(ignore_eos=True, frequency_penalty=2, presence_penalty=2, repetition_penalty=2),
            "plain": greedy(ignore_eos=True),
        },
    )
    assert all(r["error"] is None for r in got.values()), got
    assert got["plain"]["token_ids"] == plain, "the other requests of the batch change nothing"
    assert got["bias"]["token_ids"] == [forced] * 8
    assert got["stop_id"]["token_ids"] == plain[: k + 1]
    assert got["stop_id"]["done"]["finish_reason"] == "stop"
    assert got["eos_now"]["token_ids"] == [eos_id] and got["eos_now"]["done"]["finish_reason"] == "stop"
    # EOS is banned for output tokens 0..4, then the bias makes it the 6th token.
    later = got["eos_later"]["token_ids"]
    assert len(later) == 6 and eos_id not in later[:5] and later[5] == eos_id, later
    assert got["eos_later"]["done"]["finish_reason"] == "stop"
    assert len(set(got["penalized"]["token_ids"])) == 8, "penalties forbid every repeat here"

    # Over HTTP: the stop token's text is not in the answer; chat takes the same fields.
    r = httpx.post(
        f"{tiny_daemon.url}/v1/completions", json=greedy(ignore_eos=True, stop_token_ids=[plain[k]]), timeout=60
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == tokenizer.decode(plain[:k], skip_special_tokens=True)
    assert r.json()["usage"]["completion_tokens"] == k + 1
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 3}
    r = httpx.post(
        f"{tiny_daemon.url}/v1/chat/completions", json={**chat, "logit_bias": {str(forced): 100}}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode([forced] * 3)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"1000000": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_tokens": "two"}, "min_tokens"),
    ],
)
def test_bad_values_are_400s_naming_the_field(tiny_daemon, fields, param):
    r = httpx.post(f"{tiny_daemon.url}/v1/completions", json={"prompt": "hi", **fields}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
