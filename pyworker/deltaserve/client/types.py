"""What the client returns and raises: results as frozen dataclasses, every failure as ``APIError``.

```text
 Completion       one whole answer (completions or chat): text, token ids (streams over the
                  WebSocket only), per-token logprobs, finish_reason, usage
 TokenEvent       one streamed event: a token (WebSocket) or a chunk of text (SSE)
 Model, Variant   GET /v1/models entries, GET/POST /v1/adapters cards
 APIError         status + OpenAI error type + message; APIConnectionError / APITimeoutError
                  when no answer came at all
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

# HTTP status of each error `type` the server sends (api/error.rs), for errors that arrive inside
# a stream (SSE `data: {"error": ...}` or a WebSocket `error` message), where no status line is.
STATUS_OF_ERROR_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "method_not_allowed_error": 405,
    "conflict_error": 409,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "server_error": 500,
    "service_unavailable_error": 503,
}


class APIError(Exception):
    """The server refused or failed a request, or could not be reached.

    ``status`` is the HTTP status (for an error inside a stream, the status its ``type`` has on
    plain requests; ``None`` when no server answered), ``type`` the OpenAI-style error type
    (``invalid_request_error``, ``not_found_error``, ...), ``message`` the server's explanation,
    ``param`` the offending request field and ``code`` a machine-readable code, when given.
    """

    def __init__(
        self, status: int | None, type: str, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(f"{status if status is not None else 'no answer'} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.code = code


class APIConnectionError(APIError, ConnectionError):
    """No server answered at the URL (refused, reset, unreachable, or silent past the timeout)."""

    def __init__(self, url: str, reason: object) -> None:
        super().__init__(None, "connection_error", f"no deltaserve server answers at {url} ({reason})")
        self.url = url
        self.reason = reason


class APITimeoutError(APIError, TimeoutError):
    """``wait_ready`` gave up: the server did not become ready in time."""

    def __init__(self, message: str) -> None:
        super().__init__(None, "timeout", message)


@dataclass(frozen=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    """Tokens in the prompt (after the chat template)."""
    completion_tokens: int
    """Tokens generated."""
    total_tokens: int
    """Their sum."""


@dataclass(frozen=True)
class TopLogprob:
    """One likely alternative at a position."""

    token: str | None
    """Its text as the tokenizer spells it (SSE / plain JSON; WebSocket too)."""
    logprob: float
    """Its log-probability."""
    token_id: int | None = None
    """Its id (WebSocket only)."""


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token at one position, with its log-probability and alternatives."""

    token: str | None
    """Its text as the tokenizer spells it; ``None`` over the WebSocket, which sends ids."""
    logprob: float | None
    """Its log-probability (``None`` if the worker did not report one)."""
    top_logprobs: list[TopLogprob] = field(default_factory=list)
    """The most likely alternatives, most likely first, when asked for."""
    token_id: int | None = None
    """Its id (WebSocket only)."""


@dataclass(frozen=True)
class Completion:
    """One whole answer, from ``completions`` / ``chat`` or a finished stream."""

    text: str
    """The generated text (the assistant message's content for chat)."""
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    usage: Usage
    """Token counts."""
    id: str
    """The response id (``cmpl-…`` / ``chatcmpl-…``; the generation id on the WebSocket)."""
    model: str | None = None
    """The model that answered (``<base>`` or ``<base>:<variant>``); ``None`` when a WebSocket
    stream was sent without a ``model``."""
    token_ids: list[int] | None = None
    """Every generated token id: streams over the WebSocket only (the HTTP API sends none)."""
    logprobs: list[TokenLogprob] | None = None
    """One entry per generated token, when asked for (``logprobs=``)."""


@dataclass(frozen=True)
class TokenEvent:
    """One streamed event.

    Over the WebSocket, one per generated token: ``token_id`` set, and ``text`` the text this
    token released (empty while the detokenizer holds back part of a character or a possible stop
    string). Over SSE, one per chunk: ``token_id`` is ``None`` and ``text`` may span several tokens.
    Concatenating every event's ``text`` gives the answer's text.
    """

    text: str
    """Text released by this event."""
    token_id: int | None = None
    """The token (WebSocket only)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """Logprobs of the tokens this event carries, when asked for."""


@dataclass(frozen=True)
class StreamEnd:
    """How a stream ended (what transports hand ``StreamAccumulator.finish``)."""

    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    usage: Usage
    """Token counts."""
    id: str
    """Response or generation id."""
    model: str | None
    """The model that answered, when the transport says."""


@dataclass(frozen=True)
class Model:
    """One served model (``GET /v1/models``): the base, then each active variant."""

    id: str
    """What to put in a request's ``model``: ``<base>`` or ``<base>:<variant>``."""
    max_model_len: int
    """Longest prompt + output accepted."""
    created: int
    """Unix seconds the server started."""
    owned_by: str
    """Always ``deltaserve``."""
    parent: str | None = None
    """For a variant: its base model."""
    kind: str | None = None
    """For a variant: ``lora`` or ``delta``."""


@dataclass(frozen=True)
class Variant:
    """One registered variant (LoRA adapter or compressed delta), as ``/v1/adapters`` shows it."""

    name: str
    """Its name (the API's ``id``)."""
    model: str
    """What to put in a request's ``model``: ``<base>:<name>``."""
    parent: str
    """The base model it applies to."""
    kind: str | None
    """``lora`` or ``delta`` (``None`` while pending)."""
    path: str
    """The directory it was loaded from, on the server's filesystem."""
    status: str
    """``pending``, ``active`` or ``deleting``."""
    created: int
    """Unix seconds of registration."""
    summary: str | None = None
    """One line for people: ``rank 16``, ``4-bit 2:4, 2.6x smaller than fp16``, ..."""
    max_rank: int | None = None
    """Largest rank over its adapted projections (0 for a delta)."""
    target_modules: list[str] = field(default_factory=list)
    """Adapted projections."""
    num_blocks: int | None = None
    """GPU pool pages its weights take when resident (0 for a delta)."""
    host_bytes: int | None = None
    """Bytes of its host-memory copy."""
