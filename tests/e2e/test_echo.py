"""`echo` in /v1/completions through the daemon (tiny Llama, CPU, float32): the prompt's text before
each choice's, and with `logprobs` the prompt tokens' logprobs first (the first token's null), equal
to transformers' log-softmax within 1e-4."""

from __future__ import annotations

import json

import httpx
import pytest

from .daemon import Daemon

PROMPT = "once upon a time there was a small model that"


@pytest.fixture(scope="module")
def chunking_daemon(tiny_llama):
    """Steps of 6 tokens: the prompt is prefilled in chunks, each sending its positions' logprobs."""
    with Daemon(tiny_llama, "--max-num-batched-tokens", "6", "--max-model-len", "256") as d:
        yield d


@pytest.mark.parametrize("which", ["one step", "chunked"])
def test_echoed_prompt_logprobs_equal_transformers(which, tiny_daemon, hf_model, request):
    torch = pytest.importorskip("torch")
    url = (tiny_daemon if which == "one step" else request.getfixturevalue("chunking_daemon")).url
    ids = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    got = lp["token_logprobs"][1 : len(ids)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
    # Top alternatives at each prompt position: the reference's two best (one entry when both
    # tokens spell the same text, as the completions format keys them by text).
    for p in range(1, len(ids)):
        best = ref[p - 1].topk(2).values.tolist()
        got_top = sorted(lp["top_logprobs"][p].values(), reverse=True)
        assert got_top[0] == pytest.approx(best[0], abs=1e-4)
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in got_top)
    plain = httpx.post(f"{url}/v1/completions", json={**body, "echo": False}, timeout=60).json()["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    # Scoring alone (`max_tokens: 0`, vLLM's form): the prompt and its logprobs, nothing generated.
    scored = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 0}, timeout=60).json()
    assert scored["choices"][0]["text"] == PROMPT and scored["usage"]["completion_tokens"] == 0
    assert scored["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]
    # The same tokens; their logprobs up to the lm_head's rounding over more rows.
    assert lp["tokens"][len(ids) :] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids) :] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)


def test_echo_streams_the_prompt_first_for_every_choice(tiny_daemon):
    body = {"prompt": PROMPT, "echo": True, "n": 2, "max_tokens": 2, "stream": True, "seed": 1}
    with httpx.stream("POST", f"{tiny_daemon.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    first: dict[int, str] = {}
    for chunk in map(json.loads, data[:-1]):
        (choice,) = chunk["choices"]
        first.setdefault(choice["index"], choice["text"])
    assert first == {0: PROMPT, 1: PROMPT}
