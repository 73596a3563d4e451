"""``AsyncClient``: ``Client``'s surface as coroutines and async iterators, and ``run``, which runs
a coroutine on uvloop's event loop when uvloop is installed.

```text
 AsyncClient(url, api_key, timeout, transport)
   await completions / chat                       → Completion
   stream_completions / stream_chat → AsyncTokenStream: async for TokenEvent…, await .result()
       every WebSocket stream of one client shares one socket (GET /v1/ws), ids tell them apart
   await register / unregister / variants / models / metrics / health / ready / wait_ready
 run(main())   asyncio.run, on uvloop when it is installed
```

HTTP is written directly on asyncio streams (no dependency); WebSocket streams need
``websockets`` (``pip install 'deltaserve[client]'``).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import aclosing
from typing import Any, Literal, TypeVar
from urllib.parse import quote

from .aio_transport import AsyncHttpTransport, WebSocketMux
from .metrics import parse_metrics
from .protocol import (
    SSE_DONE,
    Messages,
    StreamAccumulator,
    auth_headers,
    base_url,
    chat_body,
    completion_body,
    error_from_body,
    model_field,
    parse_completion,
    parse_model,
    parse_variant,
    sse_data,
    sse_events,
)
from .sync import PROBE_TIMEOUT_S, Transport, pick_transport
from .types import APIConnectionError, APITimeoutError, Completion, Model, StreamEnd, TokenEvent, Variant

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop's event loop when uvloop is installed."""
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


class AsyncTokenStream:
    """A streamed answer: ``async for`` its ``TokenEvent``s, then ``await result()``.

    Nothing is sent until the first event is awaited; request errors raise ``APIError`` there.
    ``await aclose()`` (or leaving an ``async with`` block) before the end cancels the generation
    on the server; so does dropping the stream (when the event loop finalizes it).
    """

    def __init__(self, events: AsyncIterator[TokenEvent | StreamEnd], with_token_ids: bool) -> None:
        self.events = events
        self.accumulator = StreamAccumulator(with_token_ids)

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        async for event in self.events:
            if isinstance(event, StreamEnd):
                self.accumulator.finish(event)
            else:
                self.accumulator.add(event)
                return event
        raise StopAsyncIteration

    async def result(self) -> Completion:
        """Reads the rest of the stream; the whole answer (token ids over the WebSocket)."""
        async for _ in self:
            pass
        return self.accumulator.completion()

    async def aclose(self) -> None:
        """Stops reading; an unfinished generation is cancelled."""
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            await aclose()

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient:
    """``Client`` for asyncio: the same arguments and methods, as coroutines; streams are
    ``AsyncTokenStream``s, and all WebSocket streams of one client share one socket.

    Use it inside a running event loop (``deltaserve.client.run(main())`` runs one on uvloop
    when it is installed), one loop per client: its connections belong to the loop that opened
    them. Close it with ``await aclose()`` or ``async with``.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: Transport = "auto",
    ) -> None:
        self.url = base_url(url)
        self.api_key = api_key if api_key is not None else os.environ.get("DELTASERVE_API_KEY")
        self.timeout = timeout
        self.transport = pick_transport(transport)
        self.headers = auth_headers(self.api_key)
        self.http = AsyncHttpTransport(self.url, self.headers, timeout)
        self.probe = AsyncHttpTransport(self.url, self.headers, min(timeout, PROBE_TIMEOUT_S))
        self.mux = WebSocketMux(self.url, self.headers, timeout)

    # -- generation ----------------------------------------------------------------------------

    async def completions(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        variant: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool | None = None,
        **extra: Any,
    ) -> Completion:
        """``Client.completions``."""
        body = completion_body(
            prompt, model=model_field(model, variant), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, logprobs=logprobs, ignore_eos=ignore_eos, **extra,
        )  # fmt: skip
        return parse_completion(await self.http.json("POST", "/v1/completions", body))

    async def chat(
        self,
        messages: Messages,
        *,
        model: str | None = None,
        variant: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        ignore_eos: bool | None = None,
        **extra: Any,
    ) -> Completion:
        """``Client.chat``."""
        body = chat_body(
            messages, model=model_field(model, variant), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, logprobs=logprobs, top_logprobs=top_logprobs, ignore_eos=ignore_eos,
            **extra,
        )  # fmt: skip
        return parse_completion(await self.http.json("POST", "/v1/chat/completions", body))

    def stream_completions(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        variant: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool | None = None,
        **extra: Any,
    ) -> AsyncTokenStream:
        """``Client.stream_completions``: ``async for`` the events."""
        body = completion_body(
            prompt, model=model_field(model, variant), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, logprobs=logprobs, ignore_eos=ignore_eos, **extra,
        )  # fmt: skip
        return self.stream("/v1/completions", body)

    def stream_chat(
        self,
        messages: Messages,
        *,
        model: str | None = None,
        variant: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        ignore_eos: bool | None = None,
        **extra: Any,
    ) -> AsyncTokenStream:
        """``Client.stream_chat``: ``async for`` the events."""
        body = chat_body(
            messages, model=model_field(model, variant), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, logprobs=logprobs, top_logprobs=top_logprobs, ignore_eos=ignore_eos,
            **extra,
        )  # fmt: skip
        return self.stream("/v1/chat/completions", body)

    def stream(self, path: str, body: dict[str, Any]) -> AsyncTokenStream:
        """Streams a request body over this client's transport (``path`` is its HTTP endpoint)."""
        if self.transport == "ws":
            return AsyncTokenStream(self.mux.events(body, body.get("model")), with_token_ids=True)
        return AsyncTokenStream(self.sse_events(path, body), with_token_ids=False)

    async def sse_events(self, path: str, body: dict[str, Any]) -> AsyncIterator[TokenEvent | StreamEnd]:
        sse_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with aclosing(self.http.stream_lines("POST", path, sse_body)) as lines:
            async for line in lines:
                data = sse_data(line)
                if data is SSE_DONE:
                    return
                if isinstance(data, dict):
                    for event in sse_events(data):
                        yield event

    # -- variants, models, metrics, health -------------------------------------------------------

    async def register(
        self, name: str, path: str | os.PathLike[str], kind: Literal["lora", "delta"] | None = None
    ) -> Variant:
        """``Client.register``."""
        body = {"name": name, "path": os.fspath(path), **({"kind": kind} if kind else {})}
        return parse_variant(await self.http.json("POST", "/v1/adapters", body))

    async def unregister(self, name: str) -> None:
        """``Client.unregister``."""
        await self.http.json("DELETE", f"/v1/adapters/{quote(name, safe='')}")

    async def variants(self) -> list[Variant]:
        """``Client.variants``."""
        return [parse_variant(v) for v in (await self.http.json("GET", "/v1/adapters"))["data"]]

    async def models(self) -> list[Model]:
        """``Client.models``."""
        return [parse_model(m) for m in (await self.http.json("GET", "/v1/models"))["data"]]

    async def metrics(self) -> dict[str, float]:
        """``Client.metrics``."""
        status, data = await self.http.request("GET", "/metrics")
        if status >= 400:
            raise error_from_body(status, data)
        return parse_metrics(data.decode())

    async def health(self) -> bool:
        """``Client.health``."""
        try:
            return (await self.probe.request("GET", "/health"))[0] == 200
        except APIConnectionError:
            return False

    async def ready(self) -> bool:
        """``Client.ready``."""
        try:
            return (await self.probe.request("GET", "/ready"))[0] == 200
        except APIConnectionError:
            return False

    async def wait_ready(self, timeout: float = 300.0) -> None:
        """``Client.wait_ready``."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                status, _ = await self.probe.request("GET", "/ready")
                if status == 200:
                    return
                last = f"HTTP {status}"
            except APIConnectionError as e:
                last = str(e.reason)
            if time.monotonic() >= deadline:
                raise APITimeoutError(f"{self.url} was not ready within {timeout:g} s ({last})")
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    # -- lifetime -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Closes the WebSocket and kept-alive connections (the client stays usable)."""
        self.http.close()
        self.probe.close()
        await self.mux.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({self.url!r}, transport={self.transport!r})"
