"""Chaos: hostile and careless clients (issue 28). One daemon on the tiny model for the module.

- ``N_HTTP`` generated malformed HTTP requests (``fuzz.KINDS``: bad JSON, bad UTF-8, wrong types,
  huge bodies, absurd numbers, out-of-vocabulary token ids, hostile chat-template content,
  unknown routes and methods, wrong content types, truncated bodies, broken framing, hostile
  adapter registrations), sent raw, 16 at a time: none is answered with a 5xx, none takes over
  ``HANG_S``, and the daemon answers a greedy request exactly as before, with nothing left
  running and every KV page free.
- ``N_WS`` WebSocket messages over a few sockets (bad JSON, binary, wrong types, missing ids,
  large frames, valid generations mixed in): every message that carries an id gets an answer
  with that id (``error`` or ``done``); every other one an ``error`` without id. A frame over the
  message limit gets an ``error`` and then closes its socket with 1009 (message too big), and
  nothing else.

- A client stalled half-way through its request line is disconnected once
  ``--header-read-timeout-s`` passed, one stalled inside its body gets a 400, and a slow client
  that does send its headers in time is served.

The figures (requests tried, status mix, max latency) are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict

import httpx
import pytest
import websockets

from . import fuzz
from .daemons import Daemon, tiny_daemon_flags
from .rawclient import send

SEED = 28
N_HTTP = 2000
N_WS = 500
HANG_S = 10.0
HEADER_TIMEOUT_S = 1
MAX_BODY_BYTES = 8 << 20  # api/mod.rs
CONCURRENCY = 16
GREEDY = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tiny_llama):
    flags = tiny_daemon_flags(tiny_llama, 2048, "--header-read-timeout-s", str(HEADER_TIMEOUT_S))
    with Daemon(tiny_llama, *flags) as d:
        yield d


@pytest.fixture(scope="module")
def vocab_size(tiny_llama) -> int:
    return json.loads((tiny_llama / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def greedy_before(daemon) -> dict:
    r = httpx.post(f"{daemon.url}/v1/completions", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def assert_correct_and_idle(daemon, greedy_before: dict) -> None:
    r = httpx.post(f"{daemon.url}/v1/completions", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_before["text"]
    deadline = time.monotonic() + HANG_S
    while True:
        m = daemon.metrics()
        idle = m["deltaserve_requests_running"] == 0 and m["deltaserve_requests_waiting"] == 0
        if idle and m["deltaserve_kv_blocks_free"] == m["deltaserve_kv_blocks_total"]:
            break
        assert time.monotonic() < deadline, f"not idle after the chaos: {m}"
        time.sleep(0.05)
    assert m.get("deltaserve_worker_restarts_total", 0) == 0


async def _send_all(port: int, cases: list[fuzz.RawRequest]):
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(case):
        async with gate:
            return await send(port, case.data, case.half_close, HANG_S)

    return await asyncio.gather(*(one(c) for c in cases))


def test_malformed_http_requests_get_4xx_and_change_nothing(daemon, vocab_size, greedy_before):
    cases = fuzz.http_cases(random.Random(SEED), N_HTTP, vocab_size)
    started = time.monotonic()
    answers = asyncio.run(_send_all(daemon.port, cases))
    took = time.monotonic() - started
    mix: dict[str, Counter] = defaultdict(Counter)
    for case, a in zip(cases, answers, strict=True):
        mix[case.kind]["hang" if a.hung else a.status or "closed"] += 1
    statuses = Counter(a.status or ("hang" if a.hung else "closed") for a in answers)
    slowest = max(answers, key=lambda a: a.seconds)
    print(f"\nchaos http: {len(cases)} requests in {took:.1f} s, status mix {dict(statuses)}, "
          f"max latency {slowest.seconds:.2f} s")  # fmt: skip
    for kind, counts in sorted(mix.items()):
        print(f"  {kind}: {dict(counts)}")
    failures = [
        (i, c.kind, a.status, a.seconds, c.data[:300], a.body[:300])
        for i, (c, a) in enumerate(zip(cases, answers, strict=True))
        if a.hung or (a.status is not None and a.status >= 500)
    ]
    assert not failures, failures[:10]
    # Only requests whose framing is broken, or bodies over the limit (answered 413 while the
    # client was still writing: the close resets the connection before the client reads it),
    # may end without an answer.
    unanswered = [(c.kind, len(c.data), c.data[:200]) for c, a in zip(cases, answers, strict=True) if not a.status]
    allowed = [u for u in unanswered if u[0] in ("truncated", "framing") or u[1] > MAX_BODY_BYTES]
    assert unanswered == allowed, unanswered[:5]
    assert_correct_and_idle(daemon, greedy_before)


async def _ws_session(url: str, frames: list[fuzz.WsFrame]) -> tuple[dict[str, list[dict]], list[dict]]:
    """Sends `frames` on one socket; returns the answers by id, and those without one."""
    by_id: dict[str, list[dict]] = defaultdict(list)
    anonymous: list[dict] = []
    want = {f.id for f in frames if f.id is not None}
    want_anonymous = sum(f.id is None for f in frames)
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/ws", max_size=None) as ws:
        for f in frames:
            await ws.send(f.payload)
        async with asyncio.timeout(HANG_S):
            while want or len(anonymous) < want_anonymous:
                msg = json.loads(await ws.recv())
                if msg.get("id") is None:
                    anonymous.append(msg)
                    continue
                by_id[msg["id"]].append(msg)
                if msg["type"] in ("done", "error"):
                    want.discard(msg["id"])
    return by_id, anonymous


def test_malformed_websocket_frames_each_get_an_answer(daemon, vocab_size, greedy_before):
    frames = fuzz.ws_frames(random.Random(SEED), N_WS, vocab_size)
    sockets = 10
    started = time.monotonic()

    async def all_sockets():
        return await asyncio.gather(*(_ws_session(daemon.url, frames[i::sockets]) for i in range(sockets)))

    results = asyncio.run(all_sockets())
    took = time.monotonic() - started
    kinds = Counter(f.kind for f in frames)
    answers: dict[str, list[dict]] = {}
    anonymous: list[dict] = []
    for by_id, anon in results:
        answers.update(by_id)
        anonymous += anon
    for f in frames:
        if f.id is None:
            continue
        ends = [m for m in answers.get(f.id, []) if m["type"] in ("done", "error")]
        assert len(ends) == 1, (f.kind, f.payload[:200], answers.get(f.id))
        if f.kind == "valid":
            assert ends[0]["type"] == "done", ends
        else:
            assert ends[0]["type"] == "error" and ends[0]["error"]["message"], ends
    assert len(anonymous) == sum(f.id is None for f in frames)
    assert all(m["type"] == "error" and m["error"]["message"] for m in anonymous), anonymous[:5]
    print(f"\nchaos ws: {len(frames)} frames on {sockets} sockets in {took:.1f} s, kinds {dict(kinds)}")
    assert_correct_and_idle(daemon, greedy_before)


def test_a_websocket_frame_over_the_limit_gets_an_error_then_close_1009(daemon, greedy_before):
    async def go():
        async with websockets.connect(daemon.url.replace("http://", "ws://") + "/v1/ws", max_size=None) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "big", "request": {"prompt": "a" * (9 << 20)}}))
            async with asyncio.timeout(HANG_S):
                error = json.loads(await ws.recv())
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await ws.recv()
            return error, closed.value.rcvd

    error, close = asyncio.run(go())
    assert error["type"] == "error" and "at most 8 MiB" in error["error"]["message"], error
    assert close is not None and close.code == 1009, close
    assert_correct_and_idle(daemon, greedy_before)


def test_a_client_stalled_in_its_headers_or_body_is_cut_off_after_the_timeout(daemon):
    async def stalled() -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        writer.write(b"GET /hea")
        await writer.drain()
        started = time.monotonic()
        async with asyncio.timeout(HANG_S):
            got = await reader.read()  # until the server closes
        writer.close()
        return got, time.monotonic() - started

    async def slow_but_in_time() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        for part in (b"GET /health HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n", b"Connection: close\r\n\r\n"):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.1)
        async with asyncio.timeout(HANG_S):
            got = await reader.read()
        writer.close()
        return got

    async def stalled_body() -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        body = json.dumps(GREEDY).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body[:10])
        await writer.drain()
        started = time.monotonic()
        async with asyncio.timeout(HANG_S):
            got = await reader.read()
        writer.close()
        return got, time.monotonic() - started

    async def all_three():
        return await asyncio.gather(stalled(), slow_but_in_time(), stalled_body())

    (got, seconds), served, (refused, body_seconds) = asyncio.run(all_three())
    assert refused.startswith(b"HTTP/1.1 400") and b"stalled" in refused, refused
    assert HEADER_TIMEOUT_S * 0.8 <= body_seconds < HEADER_TIMEOUT_S + 4, body_seconds
    assert HEADER_TIMEOUT_S * 0.8 <= seconds < HEADER_TIMEOUT_S + 4, seconds
    assert b"200 OK" not in got, got
    assert served.startswith(b"HTTP/1.1 200"), served
    print(f"\nchaos headers: a stalled request line was disconnected after {seconds:.2f} s, "
          f"a stalled body refused after {body_seconds:.2f} s")  # fmt: skip
