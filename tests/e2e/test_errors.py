"""Bad input gets an OpenAI-style 4xx JSON error, changes nothing, and the daemon keeps serving."""

from __future__ import annotations

import httpx
import pytest

LONG = "word " * 400  # far beyond the tiny daemon's 256-token context

BAD_COMPLETIONS = [
    # (description, body or raw bytes, expected status, expected param or None)
    ("malformed json", b'{"prompt": "hi", ', 400, None),
    ("not an object", b"[1, 2, 3]", 400, None),
    ("missing prompt", {"max_tokens": 4}, 400, "prompt"),
    ("prompt wrong type", {"prompt": 42}, 400, "prompt"),
    ("empty prompt", {"prompt": ""}, 400, "prompt"),
    ("max_tokens wrong type", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens beyond context", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("prompt beyond context", {"prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    ("token id beyond vocab", {"prompt": [1, 2, 10**6], "max_tokens": 2}, 400, "prompt"),
    ("temperature negative", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("temperature too high", {"prompt": "hi", "temperature": 7}, 400, "temperature"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above one", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k invalid", {"prompt": "hi", "top_k": -7}, 400, "top_k"),
    ("logprobs too many", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("seed negative", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("stop wrong type", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("n above the bound", {"prompt": "hi", "n": 17}, 400, "n"),
    ("best_of below n", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("unknown model", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
]

BAD_CHAT = [
    ("missing messages", {"max_tokens": 4}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("message without role", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat max_tokens zero", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ("chat beyond context", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("chat unknown model", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
]


def _post(url: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def _assert_openai_error(r: httpx.Response, status: int, param: str | None, what: str) -> None:
    assert r.status_code == status, f"{what}: {r.status_code} {r.text}"
    body = r.json()
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], what
    assert isinstance(err["type"], str) and err["type"], what
    assert "param" in err, what
    if param is not None:
        # The param names the field, or a path inside it (e.g. `messages[0]`).
        ok = err["param"] == param or str(err["param"]).startswith((param + "[", param + "."))
        assert ok, f"{what}: param {err['param']!r}, message {err['message']!r}"


def _assert_idle(daemon) -> None:
    m = daemon.metrics()
    assert m["deltaserve_requests_running"] == 0
    assert m["deltaserve_requests_waiting"] == 0
    assert m["deltaserve_kv_blocks_free"] == m["deltaserve_kv_blocks_total"]


@pytest.mark.parametrize("what,body,status,param", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completions_request(tiny_daemon, what, body, status, param):
    before = tiny_daemon.metrics()
    _assert_openai_error(_post(tiny_daemon.url, "/v1/completions", body), status, param, what)
    after = tiny_daemon.metrics()
    assert after["deltaserve_tokens_generated_total"] == before["deltaserve_tokens_generated_total"]
    _assert_idle(tiny_daemon)


@pytest.mark.parametrize("what,body,status,param", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_request(tiny_daemon, what, body, status, param):
    _assert_openai_error(_post(tiny_daemon.url, "/v1/chat/completions", body), status, param, what)
    _assert_idle(tiny_daemon)


def test_unknown_model_message_names_the_list_endpoint(tiny_daemon):
    r = _post(tiny_daemon.url, "/v1/completions", {"prompt": "hi", "model": "no-such-model"})
    assert "/v1/models" in r.json()["error"]["message"]


def test_still_serving_after_bad_input(tiny_daemon):
    for _, body, _, _ in BAD_COMPLETIONS:
        _post(tiny_daemon.url, "/v1/completions", body)
    r = _post(tiny_daemon.url, "/v1/completions", {"prompt": "still alive", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    _assert_idle(tiny_daemon)
