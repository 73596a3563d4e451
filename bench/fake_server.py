"""A tiny OpenAI-compatible fake of the daemon's streaming API with KNOWN latencies, for testing the
replay client's measurements (tests/bench/test_replay.py) and its own throughput (zero delays).

Speaks exactly the parts of the daemon's wire format the replay client reads::

    HTTP (stdlib asyncio, HTTP/1.1 keep-alive, chunked responses)
      GET  /ready, /health              200
      POST /v1/completions  stream=true SSE: one `data: {"choices":[{"text":..}]}` per token,
                                        a finish chunk, a usage chunk (include_usage), [DONE];
                                        mid-stream failure: `data: {"error":{..}}` and the end
                            stream=false one JSON `text_completion` with usage
      errors                            status + {"error":{"message","type"}}
    WebSocket /v1/ws (second port, the `websockets` server)
      {"type":"generate","id","request"} → {"type":"token",..} per token, {"type":"done",..}
                                           or {"type":"error","id",..}

Timing: the server takes ``t0`` when it has read a request's body and writes token k (0-based)
at ``t0 + ttft + k * tpot``, sleeping until those absolute times so that delays do not add up.
``ttft`` / ``tpot`` may differ per model (``per_model``). Every served request's server-side
times (``time.monotonic()``, one clock for the whole host) are appended to ``log``.

Failures are scripted per model: ``errors[model] = (status, message)`` refuses the request with
that status; ``fail_after[model] = k`` sends k tokens and then a mid-stream error.

    python -m bench.fake_server --port 8001 --ttft 0.05 --tpot 0.01     # standalone
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench import http_sse

FAKE_TEXT = "tok "
"""The text of every fake token (non-empty, so every token is its own SSE chunk, as in the daemon)."""


@dataclass
class Served:
    """Server-side record of one request (``time.monotonic()`` seconds)."""

    model: str
    """The request's ``model`` field."""
    received: float
    """When its body had been read (the origin of its token schedule)."""
    token_times: list[float] = field(default_factory=list)
    """When each token's bytes were handed to the socket."""


class FakeServer:
    """An HTTP (+ WebSocket) fake with scripted latencies and failures; see the module docstring."""

    def __init__(self, ttft: float = 0.0, tpot: float = 0.0, per_model: dict[str, tuple[float, float]] | None = None,
                 errors: dict[str, tuple[int, str]] | None = None, fail_after: dict[str, int] | None = None,
                 websocket: bool = True) -> None:  # fmt: skip
        self.ttft = ttft
        """Seconds from reading a request to writing its first token (default for every model)."""
        self.tpot = tpot
        """Seconds between consecutive tokens (default for every model)."""
        self.per_model = per_model or {}
        """model → (ttft, tpot), overriding the defaults."""
        self.errors = errors or {}
        """model → (HTTP status, message): such requests are refused."""
        self.fail_after = fail_after or {}
        """model → k: such requests fail mid-stream after k tokens."""
        self.websocket = websocket
        """Also serve /v1/ws (on a second port: the websockets server cannot take POST bodies)."""
        self.log: list[Served] = []
        """Every request served, in arrival order."""
        self.url = ""
        """``http://127.0.0.1:PORT`` once started."""
        self.ws_url = ""
        """``ws://127.0.0.1:PORT2/v1/ws`` once started (empty without ``websocket``)."""
        self._servers: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> FakeServer:
        http = await asyncio.start_server(self._serve_http, host, port, backlog=4096)
        self._servers.append(http)
        self.url = f"http://{host}:{http.sockets[0].getsockname()[1]}"
        if self.websocket:
            from websockets.asyncio.server import serve

            ws = await serve(self._serve_ws, host, 0, max_size=None, compression=None)
            self._servers.append(ws)
            self.ws_url = f"ws://{host}:{ws.sockets[0].getsockname()[1]}/v1/ws"
        return self

    async def stop(self) -> None:
        for s in self._servers:
            s.close()
        for s in self._servers:
            await s.wait_closed()
        self._servers.clear()

    def start_in_thread(self) -> FakeServer:
        """Runs the server on its own event loop in a daemon thread (so it does not share the
        client's loop); returns once it listens."""
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self.start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fake-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fake server did not start within 10 s")
        return self

    def stop_thread(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> FakeServer:
        return self.start_in_thread()

    def __exit__(self, *exc) -> None:
        self.stop_thread()

    # -- shared generation schedule -----------------------------------------------------------

    def _latency(self, model: str) -> tuple[float, float]:
        return self.per_model.get(model, (self.ttft, self.tpot))

    async def _tokens(self, model: str, n: int, rec: Served):
        """Yields token indices at their scheduled times, recording when each was released."""
        ttft, tpot = self._latency(model)
        for k in range(n):
            due = rec.received + ttft + k * tpot
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rec.token_times.append(time.monotonic())
            yield k

    # -- HTTP ---------------------------------------------------------------------------------

    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await http_sse.serve_connection(reader, writer, self._route)

    async def _route(self, method: str, path: str, headers: dict, body: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path in ("/ready", "/health"):
            await http_sse.respond(writer, 200, b"ok", "text/plain")
        elif method == "POST" and path == "/v1/completions":
            await self._completions(writer, json.loads(body))
        else:
            await http_sse.respond(writer, 404, http_sse.error_body(f"no route {method} {path}", "not_found"))

    async def _completions(self, writer: asyncio.StreamWriter, req: dict) -> None:
        model = req.get("model", "")
        if model in self.errors:
            status, message = self.errors[model]
            return await http_sse.respond(writer, status, http_sse.error_body(message, "invalid_request_error"))
        rec = Served(model=model, received=time.monotonic())
        self.log.append(rec)
        n = int(req.get("max_tokens") or 16)
        prompt_tokens = len(req["prompt"]) if isinstance(req.get("prompt"), list) else 1
        fail_at = self.fail_after.get(model)
        if not req.get("stream"):
            async for _ in self._tokens(model, n, rec):
                pass
            out = _chunk(model, FAKE_TEXT * n, "length")
            out["usage"] = http_sse.usage(prompt_tokens, n)
            return await http_sse.respond(writer, 200, json.dumps(out).encode())
        writer.write(http_sse.SSE_HEAD)
        token_event = http_sse.event_bytes(_chunk(model, FAKE_TEXT, None))  # encoded once: the server stays cheap
        async for _ in self._tokens(model, n if fail_at is None else fail_at, rec):
            writer.write(token_event)
            await writer.drain()
        if fail_at is not None:
            http_sse.write_event(writer, {"error": {"message": f"scripted failure after {fail_at} tokens",
                                            "type": "internal_error", "param": None, "code": None}})  # fmt: skip
        else:
            http_sse.write_event(writer, _chunk(model, "", "length"))
            if (req.get("stream_options") or {}).get("include_usage"):
                http_sse.write_event(writer, {**_chunk(model, "", None), "choices": [],
                                              "usage": http_sse.usage(prompt_tokens, n)})  # fmt: skip
        http_sse.end_stream(writer, done=fail_at is None)
        await writer.drain()

    # -- WebSocket ----------------------------------------------------------------------------

    async def _serve_ws(self, ws) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            async for text in ws:
                msg = json.loads(text)
                if msg.get("type") == "generate":
                    t = asyncio.create_task(self._ws_generate(ws, msg["id"], msg.get("request") or {}))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
        except Exception:  # noqa: BLE001 - a closed socket ends its generations
            pass
        finally:
            for t in tasks:
                t.cancel()

    async def _ws_generate(self, ws, rid: str, req: dict) -> None:
        model = req.get("model", "")
        if model in self.errors:
            _, message = self.errors[model]
            err = json.loads(http_sse.error_body(message, "invalid_request_error"))["error"]
            return await ws.send(json.dumps({"type": "error", "id": rid, "error": err}))
        rec = Served(model=model, received=time.monotonic())
        self.log.append(rec)
        n = int(req.get("max_tokens") or 16)
        fail_at = self.fail_after.get(model)
        token = json.dumps({"type": "token", "id": rid, "text": FAKE_TEXT, "token_id": 7})
        async for _ in self._tokens(model, n if fail_at is None else fail_at, rec):
            await ws.send(token)
        if fail_at is not None:
            err = {"message": f"scripted failure after {fail_at} tokens", "type": "internal_error"}
            return await ws.send(json.dumps({"type": "error", "id": rid, "error": err}))
        prompt_tokens = len(req["prompt"]) if isinstance(req.get("prompt"), list) else 1
        done = {"type": "done", "id": rid, "finish_reason": "length", "usage": http_sse.usage(prompt_tokens, n)}
        await ws.send(json.dumps(done))


def _chunk(model: str, text: str, finish: str | None) -> dict:
    return http_sse.chunk(model, text, finish, cid="cmpl-fake")


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Fake OpenAI-compatible server with known latencies.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    p.add_argument("--tpot", type=float, default=0.0, help="seconds between tokens")
    a = p.parse_args()

    async def run() -> None:
        s = await FakeServer(a.ttft, a.tpot).start(a.host, a.port)
        print(f"fake server at {s.url} (WebSocket {s.ws_url})", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
