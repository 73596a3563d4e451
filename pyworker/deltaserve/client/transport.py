"""Blocking I/O for ``Client``: HTTP/1.1 on the standard library's ``http.client`` (kept-alive
connections, one pool per client, thread-safe), and WebSocket generations on ``websockets.sync``
(an optional dependency, imported on first use).

```text
 HttpTransport.request(method, path, body) → (status, bytes)     pooled connection, reused
 HttpTransport.stream_lines(method, path, body) → lines…        own connection, closed after
 websocket_events(url, headers, timeout, body) → TokenEvent…, StreamEnd   one socket per stream
```

A request on a kept-alive connection the server has meanwhile closed is sent again once on a
fresh connection (nothing of it was answered, so nothing ran). A stream's connection is never
reused: closing it is how an unfinished stream cancels its request on the server.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
from collections.abc import Generator, Iterator
from typing import Any
from urllib.parse import urlsplit

from .protocol import INSTALL_WEBSOCKETS, error_from_body, ws_event, ws_generate, ws_url
from .types import APIConnectionError, APIError, StreamEnd, TokenEvent

# Errors that mean a kept-alive connection was closed by the server while idle.
STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class HttpTransport:
    """HTTP to one server, over a pool of kept-alive ``http.client`` connections."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        self.url = url
        self.headers = headers
        self.timeout = timeout
        self.prefix = parts.path.rstrip("/")
        self.connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.host = parts.hostname or ""
        self.port = parts.port
        self.idle: list[http.client.HTTPConnection] = []
        self.lock = threading.Lock()

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """Sends one request and reads the whole answer; raises ``APIConnectionError`` when no
        server answers."""
        conn, resp = self.send(method, path, body)
        try:
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise APIConnectionError(self.url, e) from None
        if resp.will_close:
            conn.close()
        else:
            with self.lock:
                self.idle.append(conn)
        return resp.status, data

    def json(self, method: str, path: str, body: Any = None) -> Any:
        """``request``, its JSON answer; raises ``APIError`` for an error status."""
        status, data = self.request(method, path, body)
        if status >= 400:
            raise error_from_body(status, data)
        return json.loads(data) if data else None

    def stream_lines(self, method: str, path: str, body: Any) -> Generator[bytes, None, None]:
        """The answer's lines as they arrive (server-sent events); raises ``APIError`` for an error
        status. Closing the iterator early closes the connection, which cancels the request."""
        conn, resp = self.send(method, path, body)
        try:
            if resp.status >= 400:
                raise error_from_body(resp.status, resp.read())
            while True:
                try:
                    line = resp.readline()
                except (OSError, http.client.HTTPException) as e:
                    raise APIConnectionError(self.url, e) from None
                if not line:
                    return
                yield line
        finally:
            conn.close()

    def send(self, method: str, path: str, body: Any) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Sends the request on an idle connection (once more on a fresh one if that one turns
        out closed) and reads the status line and headers."""
        data = None if body is None else json.dumps(body).encode()
        headers = {**self.headers, "Accept": "application/json, text/event-stream"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in itertools.count():
            conn, reused = self.connection()
            try:
                conn.request(method, self.prefix + path, body=data, headers=headers)
                return conn, conn.getresponse()
            except STALE_CONNECTION as e:
                conn.close()
                if not (reused and attempt == 0):
                    raise APIConnectionError(self.url, e) from None
            except (OSError, http.client.HTTPException) as e:  # refused, unreachable, timed out, garbled
                conn.close()
                raise APIConnectionError(self.url, e) from None
        raise AssertionError("unreachable")

    def connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection (``True``: reused) or a new one."""
        with self.lock:
            if self.idle:
                return self.idle.pop(), True
        return self.connection_class(self.host, self.port, timeout=self.timeout), False

    def close(self) -> None:
        """Closes the idle connections (streams close their own)."""
        with self.lock:
            idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()


_generation_ids = itertools.count()


def websocket_events(
    url: str, headers: dict[str, str], timeout: float, body: dict[str, Any], model: str | None
) -> Iterator[TokenEvent | StreamEnd]:
    """One generation on its own ``/v1/ws`` socket: every token, then the end. Closing the
    iterator early closes the socket, which cancels the generation on the server."""
    try:
        from websockets.exceptions import ConnectionClosed, InvalidStatus
        from websockets.sync.client import connect
    except ImportError:
        raise ImportError(INSTALL_WEBSOCKETS) from None
    gid = f"g{next(_generation_ids)}"
    try:
        ws = connect(ws_url(url), additional_headers=headers, max_size=None, open_timeout=timeout)
    except InvalidStatus as e:
        raise error_from_body(e.response.status_code, e.response.body or b"") from None
    except OSError as e:  # refused, unreachable, timed out
        raise APIConnectionError(url, e) from None
    with ws:
        ws.send(ws_generate(gid, body))
        while True:
            try:
                msg = json.loads(ws.recv(timeout=timeout))
            except TimeoutError:
                raise APIConnectionError(url, f"no WebSocket message in {timeout:g} s") from None
            except ConnectionClosed as e:
                raise APIConnectionError(url, f"the WebSocket closed: {e}") from None
            if msg.get("id") != gid:
                if msg.get("type") == "error":  # about no generation: the protocol was broken
                    raise APIError(None, "protocol_error", f"the server refused a message: {msg['error']}")
                continue
            event = ws_event(msg, model)
            yield event
            if isinstance(event, StreamEnd):
                return
