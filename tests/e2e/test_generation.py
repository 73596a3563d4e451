"""Generation through the running daemon: equal to HF transformers, and batch invariant."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from .wsclient import ws_generate

pytestmark = pytest.mark.gpu_e2e  # `make test-gpu-e2e` selects it on a GPU

PROMPTS = [
    "the quick brown fox",
    "once upon a time there was a small model that",
    "hello",
]


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the daemon is asked to ignore EOS too
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_equals_transformers(tiny_daemon, hf_model, tokenizer):
    n = 24
    reqs = {}
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        expected[str(i)] = hf_greedy(hf_model, ids, n)
        reqs[str(i)] = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    got = ws_generate(tiny_daemon.url, reqs)
    for rid, want in expected.items():
        assert got[rid]["error"] is None, got[rid]
        assert got[rid]["token_ids"] == want, f"prompt {PROMPTS[int(rid)]!r}"
        assert got[rid]["done"]["finish_reason"] == "length"
        assert got[rid]["done"]["usage"]["completion_tokens"] == n

    # The same through HTTP, with the prompt as text: the text is HF's tokens decoded.
    for i, prompt in enumerate(PROMPTS):
        r = httpx.post(
            f"{tiny_daemon.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == tokenizer.decode(expected[str(i)], skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == n
        assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False).ids)


def test_batch_invariance_greedy(tiny_daemon, tokenizer):
    target = {
        "prompt": "a request that must not care about its neighbours",
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
    }
    alone = ws_generate(tiny_daemon.url, {"target": target})["target"]["token_ids"]
    assert len(alone) == 32

    words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen".split()
    crowd = {
        f"other{i}": {
            "prompt": " ".join(words[: i + 1]) * (1 + i % 3),
            "max_tokens": 8 + 3 * i,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(15)
    }
    together = ws_generate(tiny_daemon.url, {"target": target, **crowd})
    assert together["target"]["token_ids"] == alone
    for rid, body in crowd.items():
        assert len(together[rid]["token_ids"]) == body["max_tokens"], rid


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_daemon):
    req = {
        "prompt": "sampling with a seed",
        "max_tokens": 20,
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 50,
        "seed": 1234,
        "ignore_eos": True,
    }
    a = ws_generate(tiny_daemon.url, {"a": req})["a"]["token_ids"]
    crowd = {f"c{i}": {**req, "seed": i} for i in range(6)}
    b = ws_generate(tiny_daemon.url, {"a": req, **crowd})["a"]["token_ids"]
    assert a == b
    others = {tuple(v["token_ids"]) for k, v in ws_generate(tiny_daemon.url, crowd).items()}
    assert len(others) > 1, "different seeds should give different samples"


def test_logprobs_are_consistent(tiny_daemon):
    r = httpx.post(
        f"{tiny_daemon.url}/v1/completions",
        json={"prompt": "the quick brown fox", "max_tokens": 5, "temperature": 0, "logprobs": 3, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen <= 0
        assert len(top) >= 1
        # Greedy: the chosen token is the most likely one.
        assert abs(max(top.values()) - chosen) < 1e-4


def test_models_health_ready(tiny_daemon):
    models = httpx.get(f"{tiny_daemon.url}/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) >= 1
    assert httpx.get(f"{tiny_daemon.url}/health").status_code == 200
    assert httpx.get(f"{tiny_daemon.url}/ready").status_code == 200
    json.dumps(tiny_daemon.metrics())


def test_overlapped_steps_go_ahead_and_change_no_token(tiny_llama, tiny_daemon):
    """The daemon sends step N+1 before step N's output is back (``--overlap-steps``, the default);
    one step at a time it sends none ahead, and every request gets the same tokens either way:
    greedy and seeded, run to max_tokens or ended by EOS or a stop string."""
    from .conftest import _kv_bytes
    from .daemon import Daemon

    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    reqs = {
        f"r{i}": {
            "prompt": " ".join(words[: 1 + i]),
            "max_tokens": 6 + 5 * i,
            "temperature": 0,
            "ignore_eos": i % 2 == 0,
        }
        for i in range(6)
    }
    reqs["seeded"] = {
        "prompt": "a seeded draw",
        "max_tokens": 20,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 7,
        "ignore_eos": True,
    }
    reqs["stop"] = {"prompt": "stop somewhere", "max_tokens": 30, "temperature": 0, "stop": ["e"]}
    ahead_before = tiny_daemon.metrics()["deltaserve_steps_ahead_total"]
    overlapped = ws_generate(tiny_daemon.url, reqs)
    assert tiny_daemon.metrics()["deltaserve_steps_ahead_total"] > ahead_before
    args = ("--kv-cache-bytes", str(_kv_bytes(tiny_llama, 1024)), "--max-model-len", "256", "--overlap-steps", "false")
    with Daemon(tiny_llama, *args) as one_at_a_time:
        in_order = ws_generate(one_at_a_time.url, reqs)
        assert one_at_a_time.metrics()["deltaserve_steps_ahead_total"] == 0
    for rid in reqs:
        assert overlapped[rid]["error"] is None and in_order[rid]["error"] is None, rid
        assert overlapped[rid]["token_ids"] == in_order[rid]["token_ids"], rid
        assert overlapped[rid]["done"] == in_order[rid]["done"], rid
    assert overlapped["r0"]["done"]["finish_reason"] == "length"
