"""Non-blocking I/O for ``AsyncClient``: HTTP/1.1 written directly on asyncio streams (kept-alive
connections, ``Content-Length`` and chunked bodies), and one shared WebSocket per client that
carries every concurrent generation, told apart by id (``websockets``, imported on first use).

```text
 AsyncHttpTransport.request(method, path, body) → (status, bytes)     pooled connection
 AsyncHttpTransport.stream_lines(method, path, body) → lines…        own connection, closed after
 WebSocketMux.events(body) → TokenEvent…, StreamEnd
     one socket ─ reader task ─▶ queue per generation id ─▶ events()
     closing events() early sends {"type":"cancel"}; the socket closing fails every open queue
```
"""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from .protocol import INSTALL_WEBSOCKETS, error_from_body, ws_cancel, ws_event, ws_generate, ws_url
from .types import APIConnectionError, APIError, StreamEnd, TokenEvent

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]

# Errors that mean a kept-alive connection was closed by the server while idle.
STALE_CONNECTION = (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError)

MAX_HEADER_LINES = 100


class AsyncHttpTransport:
    """HTTP/1.1 to one server over asyncio streams, with a pool of kept-alive connections."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        self.url = url
        self.headers = headers
        self.timeout = timeout
        self.prefix = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.ssl else 80)
        self.host_header = parts.netloc.rpartition("@")[2]
        self.idle: list[Connection] = []

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """Sends one request and reads the whole answer; raises ``APIConnectionError`` when no
        server answers."""
        conn, status, headers = await self.send(method, path, body)
        keep = False
        try:
            async with asyncio.timeout(self.timeout):
                chunks = [c async for c in body_chunks(conn[0], headers)]
            keep = reusable(headers)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
            raise APIConnectionError(self.url, e) from None
        finally:  # also when the caller's task is cancelled mid-answer
            if keep:
                self.idle.append(conn)
            else:
                conn[1].close()
        return status, b"".join(chunks)

    async def json(self, method: str, path: str, body: Any = None) -> Any:
        """``request``, its JSON answer; raises ``APIError`` for an error status."""
        status, data = await self.request(method, path, body)
        if status >= 400:
            raise error_from_body(status, data)
        return json.loads(data) if data else None

    async def stream_lines(self, method: str, path: str, body: Any) -> AsyncGenerator[bytes, None]:
        """The answer's lines as they arrive (server-sent events); raises ``APIError`` for an error
        status. Closing the iterator early closes the connection, which cancels the request."""
        conn, status, headers = await self.send(method, path, body)
        try:
            chunks = body_chunks(conn[0], headers)
            if status >= 400:
                async with asyncio.timeout(self.timeout):
                    raise error_from_body(status, b"".join([c async for c in chunks]))
            pending = b""
            while True:
                try:
                    async with asyncio.timeout(self.timeout):
                        chunk = await anext(chunks, b"")
                except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
                    raise APIConnectionError(self.url, e) from None
                if not chunk:
                    if pending:
                        yield pending
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    yield line + b"\n"
        finally:
            conn[1].close()

    async def send(self, method: str, path: str, body: Any) -> tuple[Connection, int, dict[str, str]]:
        """Sends the request on an idle connection (once more on a fresh one if that one turns
        out closed); returns it with the status and the headers (lower-cased names)."""
        data = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {self.prefix + path} HTTP/1.1", f"Host: {self.host_header}"]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        head += ["Accept: application/json, text/event-stream", f"Content-Length: {len(data)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + data
        for attempt in itertools.count():
            conn = self.take_idle()
            reused = conn is not None
            sent = False
            try:
                async with asyncio.timeout(self.timeout):
                    if conn is None:
                        conn = await self.open()
                    conn[1].write(request)
                    await conn[1].drain()
                    status, headers = await read_head(conn[0])
                sent = True
                return conn, status, headers
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
                stale = isinstance(e, STALE_CONNECTION)
                if not (stale and reused and attempt == 0):  # else: refused, unreachable, timed out, garbled
                    raise APIConnectionError(self.url, e) from None
            finally:  # also when the caller's task is cancelled
                if not sent and conn is not None:
                    conn[1].close()
        raise AssertionError("unreachable")

    def take_idle(self) -> Connection | None:
        """A kept-alive connection the server has not visibly closed, if there is one."""
        while self.idle:
            conn = self.idle.pop()
            if not conn[0].at_eof():
                return conn
            conn[1].close()
        return None

    async def open(self) -> Connection:
        return await asyncio.open_connection(self.host, self.port, ssl=self.ssl)

    def close(self) -> None:
        """Closes the idle connections (streams close their own)."""
        idle, self.idle = self.idle, []
        for _, writer in idle:
            writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and headers of a response; ``IncompleteReadError`` if the connection closed."""
    line = await reader.readline()
    if not line:
        raise asyncio.IncompleteReadError(b"", None)
    version, status, *_ = line.decode("latin-1").split(" ", 2)
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {line!r}")
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return int(status), headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    raise ValueError(f"more than {MAX_HEADER_LINES} header lines")


async def body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: by ``Content-Length``, chunked, or up to the connection's end."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"x", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if length:
            yield await reader.readexactly(length)
    else:
        while chunk := await reader.read(65536):
            yield chunk


def reusable(headers: dict[str, str]) -> bool:
    """Whether the connection can carry another request after this answer."""
    framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
    return framed and headers.get("connection", "").lower() != "close"


class ClosedSocket(Exception):
    """Put in a generation's queue when its socket closed before the generation ended."""


class MuxSocket:
    """One open WebSocket and the generations waiting on it."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.closed = False
        self.reader = asyncio.get_running_loop().create_task(self.read())

    async def read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        reason: object = "the server closed the WebSocket"
        try:
            async for raw in self.ws:
                msg = json.loads(raw)
                gid = msg.get("id")
                if gid is None:  # about no generation: the protocol was broken; fail them all
                    reason = APIError(None, "protocol_error", f"the server refused a message: {msg.get('error')}")
                    break
                queue = self.queues.get(gid)
                if queue is None:  # cancelled: its `done` (abort) comes after
                    continue
                if msg.get("type") in ("done", "error"):
                    del self.queues[gid]
                queue.put_nowait(msg)
        except ConnectionClosed as e:
            reason = f"the WebSocket closed: {e}"
        finally:
            self.closed = True
            for queue in self.queues.values():
                queue.put_nowait(ClosedSocket(reason))
            self.queues.clear()


class WebSocketMux:
    """Every generation of one ``AsyncClient`` on one ``/v1/ws`` socket, opened on first use and
    again after it closes."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        self.url = url
        self.headers = headers
        self.timeout = timeout
        self.socket: MuxSocket | None = None
        self.lock: asyncio.Lock | None = None
        self.ids = itertools.count()

    async def connect(self) -> MuxSocket:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            if self.socket is not None and not self.socket.closed:
                return self.socket
            try:
                from websockets.asyncio.client import connect
                from websockets.exceptions import InvalidStatus
            except ImportError:
                raise ImportError(INSTALL_WEBSOCKETS) from None
            try:
                ws = await connect(ws_url(self.url), additional_headers=self.headers, max_size=None,
                                   open_timeout=self.timeout)  # fmt: skip
            except InvalidStatus as e:
                raise error_from_body(e.response.status_code, e.response.body or b"") from None
            except (OSError, TimeoutError) as e:
                raise APIConnectionError(self.url, e) from None
            self.socket = MuxSocket(ws)
            return self.socket

    async def events(self, body: dict[str, Any], model: str | None) -> AsyncIterator[TokenEvent | StreamEnd]:
        """One generation: every token, then the end. Closing the iterator early cancels it."""
        from websockets.exceptions import ConnectionClosed

        socket = await self.connect()
        gid = f"g{next(self.ids)}"
        queue: asyncio.Queue[Any] = asyncio.Queue()
        socket.queues[gid] = queue
        ended = False
        try:
            try:
                await socket.ws.send(ws_generate(gid, body))
            except ConnectionClosed as e:
                raise APIConnectionError(self.url, f"the WebSocket closed: {e}") from None
            while True:
                try:
                    async with asyncio.timeout(self.timeout):
                        msg = await queue.get()
                except TimeoutError:
                    raise APIConnectionError(self.url, f"no WebSocket message in {self.timeout:g} s") from None
                if isinstance(msg, ClosedSocket):
                    ended = True
                    reason = msg.args[0]
                    raise reason if isinstance(reason, APIError) else APIConnectionError(self.url, reason)
                ended = msg.get("type") in ("done", "error")
                event = ws_event(msg, model)
                yield event
                if isinstance(event, StreamEnd):
                    return
        finally:
            if not ended and socket.queues.pop(gid, None) is not None and not socket.closed:
                try:
                    await socket.ws.send(ws_cancel(gid))
                except ConnectionClosed:
                    pass

    async def close(self) -> None:
        """Closes the socket; generations still on it end with ``APIConnectionError``."""
        socket, self.socket = self.socket, None
        if socket is not None:
            await socket.ws.close()
            await socket.reader
