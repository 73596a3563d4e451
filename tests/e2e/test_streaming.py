"""Streaming: SSE and WebSocket deltas concatenate to the non-streamed text; leaving frees pages."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets

from helpers.tiny_models import make_tiny_model

from .daemon import Daemon
from .wsclient import ws_generate

BODY = {"prompt": "the quick brown fox jumps over", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "tell me about foxes"}], "max_tokens": 30, "temperature": 0}


def _sse(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    events.append("[DONE]")
                    break
                events.append(json.loads(data))
    assert events and events[-1] == "[DONE]", "stream must end with [DONE]"
    return events[:-1]


def test_completion_sse_concatenates_to_non_streamed(tiny_daemon):
    full = httpx.post(f"{tiny_daemon.url}/v1/completions", json=BODY, timeout=120).json()
    events = _sse(tiny_daemon.url, "/v1/completions", BODY)
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == full["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "text_completion" for e in events)


def test_chat_sse_concatenates_to_non_streamed(tiny_daemon):
    full = httpx.post(f"{tiny_daemon.url}/v1/chat/completions", json=CHAT, timeout=120).json()
    body = {**CHAT, "stream_options": {"include_usage": True}}
    events = _sse(tiny_daemon.url, "/v1/chat/completions", body)
    deltas = [c["delta"] for e in events for c in e.get("choices", [])]
    assert deltas[0].get("role") == "assistant"
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == full["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finish == [full["choices"][0]["finish_reason"]]


def test_websocket_tokens_concatenate_to_non_streamed(tiny_daemon):
    full = httpx.post(f"{tiny_daemon.url}/v1/completions", json=BODY, timeout=120).json()
    got = ws_generate(tiny_daemon.url, {"x": BODY, "y": {**BODY, "max_tokens": 7}})
    assert got["x"]["text"] == full["choices"][0]["text"]
    assert got["x"]["done"]["usage"]["completion_tokens"] == 40
    assert len(got["y"]["token_ids"]) == 7


def _wait_idle(daemon, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = daemon.metrics()
        if m["deltaserve_requests_running"] == 0 and m["deltaserve_kv_blocks_free"] == m["deltaserve_kv_blocks_total"]:
            return m
        assert time.monotonic() < deadline, f"pages not freed: {m}"
        time.sleep(0.05)


# Cancellation needs requests that outlive the client's reaction: a wider, deeper tiny model and
# outputs of up to 1500 tokens, i.e. seconds of work that must stop early.
LONG_TOKENS = 1500
LONG = {"prompt": "a long story", "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow_daemon(tiny_models_dir):
    model = make_tiny_model(
        tiny_models_dir,
        "llama",
        seed=7,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        max_position_embeddings=2048,
    )
    with Daemon(model, "--max-model-len", "2048") as d:
        yield d


def _holds_pages(daemon) -> bool:
    m = daemon.metrics()
    return m["deltaserve_requests_running"] > 0 and m["deltaserve_kv_blocks_free"] < m["deltaserve_kv_blocks_total"]


def test_disconnected_sse_frees_pages(slow_daemon):
    before = _wait_idle(slow_daemon)
    with httpx.stream("POST", f"{slow_daemon.url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()  # keep the iterator: closing it closes the response
        while not next(lines).startswith("data:"):
            pass
        assert _holds_pages(slow_daemon), f"the running request should hold KV pages: {slow_daemon.metrics()}"
    after = _wait_idle(slow_daemon)
    generated = after["deltaserve_tokens_generated_total"] - before["deltaserve_tokens_generated_total"]
    assert generated < LONG_TOKENS, "the request should have been cancelled, not run to the end"
    assert after["deltaserve_requests_aborted_total"] > before["deltaserve_requests_aborted_total"]


async def _ws_two_then(url: str, daemon, cancel_instead: bool) -> dict | None:
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
        await ws.send(json.dumps({"type": "generate", "id": "a", "request": LONG}))
        await ws.send(json.dumps({"type": "generate", "id": "b", "request": LONG}))
        seen = set()
        while seen != {"a", "b"}:
            msg = json.loads(await ws.recv())
            if msg["type"] == "token":
                seen.add(msg["id"])
        assert _holds_pages(daemon)
        if not cancel_instead:
            return None  # leaving the block closes the socket
        await ws.send(json.dumps({"type": "cancel", "id": "a"}))
        async with asyncio.timeout(30):
            while True:
                msg = json.loads(await ws.recv())
                if msg["type"] == "done" and msg["id"] == "a":
                    await ws.send(json.dumps({"type": "cancel", "id": "b"}))
                    return msg


def test_closed_websocket_frees_pages(slow_daemon):
    before = _wait_idle(slow_daemon)
    asyncio.run(_ws_two_then(slow_daemon.url, slow_daemon, cancel_instead=False))
    after = _wait_idle(slow_daemon)
    assert after["deltaserve_tokens_generated_total"] - before["deltaserve_tokens_generated_total"] < LONG_TOKENS
    assert after["deltaserve_requests_aborted_total"] - before["deltaserve_requests_aborted_total"] == 2


def test_websocket_cancel_ends_with_abort(slow_daemon):
    before = _wait_idle(slow_daemon)
    done = asyncio.run(_ws_two_then(slow_daemon.url, slow_daemon, cancel_instead=True))
    assert done["finish_reason"] == "abort"
    assert done["usage"]["completion_tokens"] < LONG_TOKENS
    after = _wait_idle(slow_daemon)
    assert after["deltaserve_tokens_generated_total"] - before["deltaserve_tokens_generated_total"] < 2 * LONG_TOKENS


def test_websocket_bad_messages_keep_socket_open(tiny_daemon):
    async def go():
        async with websockets.connect(tiny_daemon.url.replace("http://", "ws://") + "/v1/ws") as ws:
            await ws.send("not json")
            assert json.loads(await ws.recv())["type"] == "error"
            await ws.send(json.dumps({"type": "generate", "id": "z", "request": {"prompt": "x", "max_tokens": 0}}))
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["id"] == "z" and err["error"]["param"] == "request.max_tokens"
            await ws.send(json.dumps({"type": "generate", "id": "ok", "request": {**BODY, "max_tokens": 2}}))
            while True:
                msg = json.loads(await ws.recv())
                if msg["type"] == "done":
                    assert msg["id"] == "ok" and msg["usage"]["completion_tokens"] == 2
                    return

    asyncio.run(go())
