"""The daemon's HTTP and WebSocket API as data, shared by ``Client`` and ``AsyncClient``: request
bodies, response JSON → result types, SSE lines and WebSocket messages → stream events, error
bodies → ``APIError``. No I/O here; each client owns its transport.

```text
 completion_body / chat_body ──▶ POST /v1/completions | /v1/chat/completions   (JSON or SSE)
                             └─▶ {"type":"generate","id":..,"request":body}    (GET /v1/ws)
 parse_completion(json)            ──▶ Completion
 sse_data(line) → sse_events(chunk) ──▶ TokenEvent..., StreamEnd      ┐ StreamAccumulator
 ws_event(message)                  ──▶ TokenEvent | StreamEnd        ┘   ──▶ Completion
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from .types import (
    STATUS_OF_ERROR_TYPE,
    APIError,
    Completion,
    Model,
    StreamEnd,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
    Variant,
)

DEFAULT_URL = "http://127.0.0.1:8000"
"""Where a client connects when given no URL and ``$DELTASERVE_URL`` is unset."""

INSTALL_WEBSOCKETS = (
    "streaming over the WebSocket needs the `websockets` package: pip install 'deltaserve[client]' "
    "(or pass transport='sse', which needs nothing)"
)

Messages = str | Sequence[dict[str, Any]]
"""A chat conversation: OpenAI message dicts, or one string (a single user message)."""


def base_url(url: str | None) -> str:
    """``url``, else ``$DELTASERVE_URL``, else ``DEFAULT_URL``; checked, without a trailing ``/``."""
    url = (url or os.environ.get("DELTASERVE_URL") or DEFAULT_URL).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the server URL must look like http://HOST:PORT, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"the server URL takes no query or fragment, got {url!r}")
    return url


def ws_url(url: str) -> str:
    """The WebSocket endpoint of the server at ``url``."""
    return "ws" + url[len("http") :] + "/v1/ws"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers every request carries."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def model_field(model: str | None, variant: str | None) -> str | None:
    """The request's ``model``: ``model``, ``variant`` alone, or ``<model>:<variant>``."""
    if variant is None:
        return model
    return variant if model is None else f"{model}:{variant}"


def completion_body(prompt: str | Sequence[int], *, model: str | None, **fields: Any) -> dict[str, Any]:
    """A ``/v1/completions`` body (also a WebSocket ``request``); ``None`` fields are left out."""
    if not isinstance(prompt, str):
        prompt = [int(t) for t in prompt]
    return _body({"model": model, "prompt": prompt, **fields})


def chat_body(messages: Messages, *, model: str | None, **fields: Any) -> dict[str, Any]:
    """A ``/v1/chat/completions`` body (also a WebSocket ``request``); a string is one user turn."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return _body({"model": model, "messages": list(messages), **fields})


def _body(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def error_from_body(status: int | None, body: bytes | bytearray | str) -> APIError:
    """The ``APIError`` for an error response (OpenAI JSON, or anything else a proxy might send)."""
    text = body if isinstance(body, str) else bytes(body).decode(errors="replace")
    try:
        error = json.loads(text)["error"]
        return error_from_object(error, status)
    except (ValueError, KeyError, TypeError, AttributeError):
        return APIError(status, "http_error", text.strip() or f"HTTP {status} with an empty body")


def error_from_object(error: dict[str, Any], status: int | None = None) -> APIError:
    """The ``APIError`` for an OpenAI error object (``{"message", "type", "param", "code"}``)."""
    kind = str(error.get("type") or "server_error")
    if status is None:
        status = STATUS_OF_ERROR_TYPE.get(kind)
    return APIError(status, kind, str(error.get("message", error)), error.get("param"), error.get("code"))


def parse_completion(obj: dict[str, Any]) -> Completion:
    """A whole ``text_completion`` or ``chat.completion`` response."""
    choice = obj["choices"][0]
    if "message" in choice:
        text = choice["message"].get("content") or ""
        logprobs = chat_logprobs(choice.get("logprobs"))
    else:
        text = choice["text"]
        logprobs = completion_logprobs(choice.get("logprobs"))
    return Completion(
        text=text,
        finish_reason=choice["finish_reason"],
        usage=parse_usage(obj["usage"]),
        id=obj["id"],
        model=obj.get("model"),
        logprobs=logprobs,
    )


def parse_usage(obj: dict[str, Any]) -> Usage:
    return Usage(int(obj["prompt_tokens"]), int(obj["completion_tokens"]), int(obj["total_tokens"]))


def completion_logprobs(lp: dict[str, Any] | None) -> list[TokenLogprob] | None:
    """The legacy completions format (parallel lists) as one entry per token."""
    if lp is None:
        return None
    tops = lp.get("top_logprobs") or [{}] * len(lp["tokens"])
    return [
        TokenLogprob(token, logprob, [TopLogprob(t, float(v)) for t, v in (top or {}).items()])
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], tops)
    ]


def chat_logprobs(lp: dict[str, Any] | None) -> list[TokenLogprob] | None:
    """The chat format (``{"content": [{token, logprob, bytes, top_logprobs}]}``)."""
    if lp is None:
        return None
    return [
        TokenLogprob(e["token"], e["logprob"], [TopLogprob(a["token"], float(a["logprob"])) for a in e["top_logprobs"]])
        for e in lp.get("content") or []
    ]


def parse_model(obj: dict[str, Any]) -> Model:
    return Model(
        id=obj["id"],
        max_model_len=int(obj.get("max_model_len", 0)),
        created=int(obj.get("created", 0)),
        owned_by=obj.get("owned_by", ""),
        parent=obj.get("parent"),
        kind=obj.get("kind"),
    )


def parse_variant(obj: dict[str, Any]) -> Variant:
    return Variant(
        name=obj["id"],
        model=obj["model"],
        parent=obj["parent"],
        kind=obj.get("kind"),
        path=obj["path"],
        status=obj["status"],
        created=int(obj["created"]),
        summary=obj.get("summary"),
        max_rank=obj.get("max_rank"),
        target_modules=list(obj.get("target_modules") or []),
        num_blocks=obj.get("num_blocks"),
        host_bytes=obj.get("host_bytes"),
    )


SSE_DONE = object()
"""What ``sse_data`` returns for the ``data: [DONE]`` terminator."""


def sse_data(line: bytes | str) -> dict[str, Any] | object | None:
    """The JSON of one SSE ``data:`` line, ``SSE_DONE`` for the terminator, ``None`` for any other
    line (blank separators, comments, keep-alives)."""
    text = line.decode() if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("data:"):
        return None
    data = text[len("data:") :].strip()
    if data == "[DONE]":
        return SSE_DONE
    return json.loads(data)


def sse_events(chunk: dict[str, Any]) -> list[TokenEvent | StreamEnd]:
    """The events of one SSE chunk (completions or chat); raises ``APIError`` for an error chunk."""
    if "error" in chunk:
        raise error_from_object(chunk["error"])
    out: list[TokenEvent | StreamEnd] = []
    if chunk.get("usage") is not None and not chunk.get("choices"):
        return [_usage_chunk(chunk)]
    for choice in chunk.get("choices") or []:
        if "delta" in choice:
            text = choice["delta"].get("content") or ""
            logprobs = chat_logprobs(choice.get("logprobs")) or []
        else:
            text = choice.get("text") or ""
            logprobs = completion_logprobs(choice.get("logprobs")) or []
        if text or logprobs:
            out.append(TokenEvent(text, None, logprobs))
        if choice.get("finish_reason") is not None:
            # Usage follows in its own chunk (stream_options.include_usage); zeros until it comes.
            out.append(StreamEnd(choice["finish_reason"], Usage(0, 0, 0), chunk["id"], chunk.get("model")))
    return out


def _usage_chunk(chunk: dict[str, Any]) -> StreamEnd:
    return StreamEnd("", parse_usage(chunk["usage"]), chunk["id"], chunk.get("model"))


def ws_generate(gid: str, body: dict[str, Any]) -> str:
    """The WebSocket message starting generation ``gid``."""
    return json.dumps({"type": "generate", "id": gid, "request": body})


def ws_cancel(gid: str) -> str:
    """The WebSocket message cancelling generation ``gid``."""
    return json.dumps({"type": "cancel", "id": gid})


def ws_event(msg: dict[str, Any], model: str | None) -> TokenEvent | StreamEnd:
    """One server message of a generation as an event; raises ``APIError`` for an ``error``."""
    kind = msg.get("type")
    if kind == "token":
        logprobs = []
        if "logprob" in msg or msg.get("top_logprobs"):
            tops = [
                TopLogprob(a.get("token"), float(a["logprob"]), a.get("token_id"))
                for a in msg.get("top_logprobs") or []
            ]
            logprobs.append(TokenLogprob(None, msg.get("logprob"), tops, msg["token_id"]))
        return TokenEvent(msg["text"], msg["token_id"], logprobs)
    if kind == "done":
        return StreamEnd(msg["finish_reason"], parse_usage(msg["usage"]), msg["id"], model)
    if kind == "error":
        raise error_from_object(msg.get("error") or {})
    raise APIError(None, "protocol_error", f"unexpected WebSocket message: {msg}")


class StreamAccumulator:
    """Folds a stream's events into the ``Completion`` it amounts to (``with_token_ids``: the
    transport sends them, i.e. the WebSocket)."""

    def __init__(self, with_token_ids: bool) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] | None = [] if with_token_ids else None
        self.logprobs: list[TokenLogprob] = []
        self.saw_logprobs = False
        self.end: StreamEnd | None = None

    def add(self, event: TokenEvent) -> None:
        self.text.append(event.text)
        if self.token_ids is not None and event.token_id is not None:
            self.token_ids.append(event.token_id)
        if event.logprobs:
            self.saw_logprobs = True
            self.logprobs.extend(event.logprobs)

    def finish(self, end: StreamEnd) -> None:
        """Records the end; a usage-only end (SSE's last chunk) completes an earlier one."""
        if self.end is not None and not end.finish_reason:
            end = StreamEnd(self.end.finish_reason, end.usage, self.end.id, self.end.model)
        self.end = end

    def completion(self) -> Completion:
        if self.end is None or not self.end.finish_reason:
            raise APIError(None, "protocol_error", "the stream ended without a finish reason")
        return Completion(
            text="".join(self.text),
            finish_reason=self.end.finish_reason,
            usage=self.end.usage,
            id=self.end.id,
            model=self.end.model,
            token_ids=self.token_ids,
            logprobs=self.logprobs if self.saw_logprobs else None,
        )
