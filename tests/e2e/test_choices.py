"""`n` and `best_of` through the daemon (tiny Llama, CPU), with the official `openai` client where
natural: greedy choices are identical, seeded sampled choices are reproducible and differ, streamed
choices carry their index and each ends with a finish reason, and `best_of` returns the candidate
with the highest cumulative logprob."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "once upon a time there was a small model that"


def client(url: str):
    openai = pytest.importorskip("openai")  # a test extra; the GPU machine has none
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(tiny_daemon) -> str:
    return httpx.get(f"{tiny_daemon.url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_greedy_choices_are_identical_and_usage_sums_them(tiny_daemon, model):
    r = client(tiny_daemon.url).completions.create(
        model=model, prompt=PROMPT, n=3, temperature=0, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens < 18


def test_seeded_sampled_choices_are_reproducible_and_differ(tiny_daemon, model):
    ask = dict(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        temperature=1.0,
        seed=1234,
        max_tokens=8,
    )
    chat = client(tiny_daemon.url).chat.completions
    first = [c.message.content for c in chat.create(**ask).choices]
    second = [c.message.content for c in chat.create(**ask).choices]
    assert first == second
    assert len(set(first)) > 1, first


def test_streamed_choices_carry_their_index_and_finish_each(tiny_daemon):
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 5, "seed": 3, "stream": True, "ignore_eos": True}
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    with httpx.stream("POST", f"{tiny_daemon.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    for chunk in map(json.loads, data[:-1]):
        (choice,) = chunk["choices"]
        assert choice["index"] not in finishes, "nothing after a choice's finish chunk"
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    whole = httpx.post(f"{tiny_daemon.url}/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert [c["text"] for c in whole["choices"]] == [texts[0], texts[1]], "the same choices streamed or not"


def test_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(tiny_daemon):
    ask = {"prompt": PROMPT, "max_tokens": 6, "seed": 99, "temperature": 1.0, "ignore_eos": True}
    url = f"{tiny_daemon.url}/v1/completions"
    candidates = httpx.post(url, json={**ask, "n": 3, "logprobs": 0}, timeout=60).json()["choices"]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in candidates]
    assert len(set(scores)) == 3, scores
    best = httpx.post(url, json={**ask, "best_of": 3}, timeout=60).json()
    (choice,) = best["choices"]
    assert choice["text"] == candidates[scores.index(max(scores))]["text"]
    assert choice["logprobs"] is None, "not asked for: left out"
    assert best["usage"]["completion_tokens"] == 18, "every candidate was generated"
    # n=2 of best_of=3: the two best, best first, with logprobs when asked.
    two = httpx.post(url, json={**ask, "best_of": 3, "n": 2, "logprobs": 0}, timeout=60).json()["choices"]
    ranked = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [c["text"] for c in two] == [candidates[i]["text"] for i in ranked]
    assert [c["index"] for c in two] == [0, 1]
    r = httpx.post(url, json={**ask, "best_of": 3, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
