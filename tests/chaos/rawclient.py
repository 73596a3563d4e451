"""A raw HTTP/1.1 client over asyncio sockets for the chaos suite: it writes exactly the bytes
it is given (no client library would send a truncated body or bad framing) and reads one
response, within a deadline, by its framing (Content-Length, chunked, or until the server closes).

``send(port, data, half_close, timeout_s)`` returns an :class:`Answer`: the status (``None`` when
the server closed without answering), seconds taken, and whether the deadline passed (a hang).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class Answer:
    status: int | None
    seconds: float
    hung: bool = False
    head: bytes = b""
    body: bytes = b""


async def _read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await reader.read(65536)
        if not chunk:
            return head, b""
        head += chunk
    head, _, rest = head.partition(b"\r\n\r\n")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        need = int(headers[b"content-length"])
        while len(rest) < need:
            chunk = await reader.read(65536)
            if not chunk:
                break
            rest += chunk
        return head, rest
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = await reader.read(65536)
            if not chunk:
                break
            rest += chunk
        return head, rest
    return head, rest + await reader.read()


async def send(port: int, data: bytes, half_close: bool = False, timeout_s: float = 10.0) -> Answer:
    started = time.monotonic()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(data)
                await writer.drain()
                if half_close:
                    writer.write_eof()
            except OSError:
                pass  # the server answered (413, 400) and closed before reading everything
            try:
                head, body = await _read_response(reader)
            except OSError:
                head, body = b"", b""
    except TimeoutError:
        return Answer(None, time.monotonic() - started, hung=True)
    finally:
        if writer is not None:
            writer.close()
    status = None
    parts = head.split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        status = int(parts[1])
    return Answer(status, time.monotonic() - started, head=head, body=body)
