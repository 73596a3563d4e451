"""The minimal HTTP/1.1 + SSE layer shared by the bench servers (bench/fake_server.py and the
baselines in bench/baselines.py): stdlib asyncio streams, no framework, so a server costs the
replay client (bench/replay.py) nothing it would not pay against the daemon.

What it speaks (the subset of the daemon's wire format the replay client reads)::

    request     METHOD PATH HTTP/1.1, headers, Content-Length body; keep-alive until
                `Connection: close` or EOF                                   serve_connection()
    response    status + Content-Length body                                 respond()
    error       status + {"error": {"message", "type", "param", "code"}}     error_body()
    SSE stream  SSE_HEAD, then chunked `data: {json}\\n\\n` events            write_event()
                  per piece   {"object": "text_completion", "choices": [{"index": 0, "text",
                               "finish_reason": null}]}                      chunk()
                  finish      the same with text "" and finish_reason
                  usage       choices [] + "usage" (stream_options.include_usage)   usage()
                  end         `data: [DONE]`, then the last chunk            end_stream()
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
"""Status line and headers of a streamed (chunked) SSE response."""

Handler = Callable[[str, str, dict[str, str], bytes, asyncio.StreamWriter], Awaitable[None]]
"""``(method, path, headers, body, writer)``: answers one request on ``writer``."""


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handler) -> None:
    """Reads requests off one connection and hands each to ``handle`` until the client closes
    or asks for ``Connection: close``; for ``asyncio.start_server``."""
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            await handle(method, path, headers, body, writer)
            if headers.get("connection", "").lower() == "close":
                return
    except (ConnectionError, asyncio.CancelledError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


async def respond(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "application/json") -> None:
    """A complete (non-streamed) response."""
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)  # fmt: skip
    await writer.drain()


def error_body(message: str, kind: str) -> bytes:
    """The daemon's error object."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def chunk(model: str, text: str, finish: str | None, cid: str = "cmpl-bench") -> dict:
    """One ``text_completion`` chunk with a single choice."""
    return {"id": cid, "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}  # fmt: skip


def write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One HTTP chunk of a chunked body."""
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def event_bytes(obj: dict) -> bytes:
    """``obj`` as one SSE ``data:`` event inside one HTTP chunk (encode once, write many times)."""
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def write_event(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(event_bytes(obj))


def end_stream(writer: asyncio.StreamWriter, done: bool = True) -> None:
    """``data: [DONE]`` (unless the stream ended with an error event) and the terminating empty chunk."""
    if done:
        write_chunk(writer, b"data: [DONE]\n\n")
    writer.write(b"0\r\n\r\n")
