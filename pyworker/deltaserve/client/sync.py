"""``Client``: the blocking client of a running deltaserve server (daemon or ``deltaserve.Server``).

```text
 Client(url, api_key, timeout, transport)
   completions / chat            POST /v1/completions | /v1/chat/completions → Completion
   stream_completions / stream_chat → TokenStream: TokenEvent… then .result() → Completion
                                 over GET /v1/ws (token ids, one socket per stream) or SSE
   register / unregister / variants   POST, DELETE, GET /v1/adapters
   models / metrics / health / ready / wait_ready
```

HTTP uses only the standard library; WebSocket streams need ``websockets``
(``pip install 'deltaserve[client]'``). ``transport="auto"`` streams over the WebSocket when that
package is installed and over SSE otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote

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
from .transport import HttpTransport, websocket_events
from .types import APIConnectionError, APITimeoutError, Completion, Model, StreamEnd, TokenEvent, Variant

Transport = Literal["auto", "ws", "sse"]

PROBE_TIMEOUT_S = 5.0
"""Longest wait for one ``/health`` or ``/ready`` answer."""


def pick_transport(transport: str) -> Literal["ws", "sse"]:
    """``auto`` → ``ws`` when ``websockets`` is installed, else ``sse``; checks the name."""
    if transport == "auto":
        return "ws" if importlib.util.find_spec("websockets") is not None else "sse"
    if transport not in ("ws", "sse"):
        raise ValueError(f"transport must be 'auto', 'ws' or 'sse', got {transport!r}")
    return transport  # type: ignore[return-value]


class TokenStream:
    """A streamed answer: iterate for ``TokenEvent``s, then ``result()`` for the ``Completion``.

    Nothing is sent until the first ``next()``; request errors raise ``APIError`` from it.
    ``close()`` (or leaving a ``with`` block, or dropping the stream) before the end cancels the
    generation on the server.
    """

    def __init__(self, events: Iterator[TokenEvent | StreamEnd], with_token_ids: bool) -> None:
        self.events = events
        self.accumulator = StreamAccumulator(with_token_ids)

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> TokenEvent:
        for event in self.events:
            if isinstance(event, StreamEnd):
                self.accumulator.finish(event)
            else:
                self.accumulator.add(event)
                return event
        raise StopIteration

    def result(self) -> Completion:
        """Reads the rest of the stream; the whole answer (token ids over the WebSocket)."""
        for _ in self:
            pass
        return self.accumulator.completion()

    def close(self) -> None:
        """Stops reading; an unfinished generation is cancelled."""
        close = getattr(self.events, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """A blocking client of a deltaserve server's HTTP and WebSocket APIs.

    ``url`` defaults to ``$DELTASERVE_URL``, else ``http://127.0.0.1:8000``; ``api_key``
    (default ``$DELTASERVE_API_KEY``) is sent as ``Authorization: Bearer``; ``timeout`` bounds
    each connect and each wait for data, in seconds. ``transport`` picks how streams travel:
    ``ws`` (token ids; needs ``websockets``), ``sse`` (standard library only) or ``auto``.
    Thread-safe; close it (or use ``with``) to drop its kept-alive connections.

    Sampling arguments are the API's (``None``: the server's default, which for ``temperature``
    is 1.0; pass 0 for greedy). ``model`` is ``<base>`` or ``<base>:<variant>`` (default: the
    base); ``variant`` alone names a variant of the served base. ``extra`` fields go into the
    request body as they are. Every failure raises ``APIError`` (``APIConnectionError`` when no
    server answers).
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
        self.http = HttpTransport(self.url, self.headers, timeout)
        # Health probes give up sooner than requests, so wait_ready keeps its deadline.
        self.probe = HttpTransport(self.url, self.headers, min(timeout, PROBE_TIMEOUT_S))

    # -- generation ----------------------------------------------------------------------------

    def completions(
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
        """Completes ``prompt`` (text or token ids). ``logprobs=k`` returns each token's logprob
        and its ``k`` likeliest alternatives (0..5)."""
        body = completion_body(
            prompt, model=model_field(model, variant), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, logprobs=logprobs, ignore_eos=ignore_eos, **extra,
        )  # fmt: skip
        return parse_completion(self.http.json("POST", "/v1/completions", body))

    def chat(
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
        """Answers a conversation (OpenAI message dicts, or one string as the user's turn),
        rendered with the model's chat template. ``logprobs=True`` returns each token's logprob,
        ``top_logprobs=k`` its ``k`` likeliest alternatives."""
        body = chat_body(
            messages, model=model_field(model, variant), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, logprobs=logprobs, top_logprobs=top_logprobs, ignore_eos=ignore_eos,
            **extra,
        )  # fmt: skip
        return parse_completion(self.http.json("POST", "/v1/chat/completions", body))

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
    ) -> TokenStream:
        """``completions``, streamed: a ``TokenStream`` of ``TokenEvent``s."""
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
    ) -> TokenStream:
        """``chat``, streamed: a ``TokenStream`` of ``TokenEvent``s."""
        body = chat_body(
            messages, model=model_field(model, variant), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, logprobs=logprobs, top_logprobs=top_logprobs, ignore_eos=ignore_eos,
            **extra,
        )  # fmt: skip
        return self.stream("/v1/chat/completions", body)

    def stream(self, path: str, body: dict[str, Any]) -> TokenStream:
        """Streams a request body over this client's transport (``path`` is its HTTP endpoint)."""
        if self.transport == "ws":
            events = websocket_events(self.url, self.headers, self.timeout, body, body.get("model"))
            return TokenStream(events, with_token_ids=True)
        return TokenStream(self.sse_events(path, body), with_token_ids=False)

    def sse_events(self, path: str, body: dict[str, Any]) -> Iterator[TokenEvent | StreamEnd]:
        sse_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with closing(self.http.stream_lines("POST", path, sse_body)) as lines:
            for line in lines:
                data = sse_data(line)
                if data is SSE_DONE:
                    return
                if isinstance(data, dict):
                    yield from sse_events(data)

    # -- variants, models, metrics, health -------------------------------------------------------

    def register(
        self, name: str, path: str | os.PathLike[str], kind: Literal["lora", "delta"] | None = None
    ) -> Variant:
        """Registers the variant directory ``path`` (on the server's filesystem: a PEFT LoRA
        adapter or a ``deltaserve compress`` delta) as ``name``, validated by a worker first.
        With ``kind``, the directory must hold that kind."""
        body = {"name": name, "path": os.fspath(path), **({"kind": kind} if kind else {})}
        return parse_variant(self.http.json("POST", "/v1/adapters", body))

    def unregister(self, name: str) -> None:
        """Removes variant ``name`` once its in-flight requests are done (returns then)."""
        self.http.json("DELETE", f"/v1/adapters/{quote(name, safe='')}")

    def variants(self) -> list[Variant]:
        """Every registered variant, in registration order."""
        return [parse_variant(v) for v in self.http.json("GET", "/v1/adapters")["data"]]

    def models(self) -> list[Model]:
        """The served models: the base, then each active variant as ``<base>:<variant>``."""
        return [parse_model(m) for m in self.http.json("GET", "/v1/models")["data"]]

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` as ``{"name{labels}": value}`` (see ``deltaserve.client.metrics``)."""
        status, data = self.http.request("GET", "/metrics")
        if status >= 400:
            raise error_from_body(status, data)
        return parse_metrics(data.decode())

    def health(self) -> bool:
        """Whether the server answers at all (``GET /health``)."""
        try:
            return self.probe.request("GET", "/health")[0] == 200
        except APIConnectionError:
            return False

    def ready(self) -> bool:
        """Whether the server takes requests now (``GET /ready``: every worker up)."""
        try:
            return self.probe.request("GET", "/ready")[0] == 200
        except APIConnectionError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Polls ``ready()`` until it holds; raises ``APITimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                status, _ = self.probe.request("GET", "/ready")
                if status == 200:
                    return
                last = f"HTTP {status}"
            except APIConnectionError as e:
                last = str(e.reason)
            if time.monotonic() >= deadline:
                raise APITimeoutError(f"{self.url} was not ready within {timeout:g} s ({last})")
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes kept-alive connections (the client stays usable)."""
        self.http.close()
        self.probe.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r}, transport={self.transport!r})"
