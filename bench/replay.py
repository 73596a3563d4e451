"""Open-loop replay of a workload trace against an OpenAI-compatible server, and its metrics.

Every request is sent at its trace time (``start + t``) whatever the server is doing: a slow
server makes requests overlap, never delays later sends. Transports::

    sse  POST /v1/completions, stream=true, include_usage (HTTP/1.1 on asyncio streams, one
         connection per request): a chunk's arrival time is recorded for every SSE event with text; the output
         token count is the final usage's completion_tokens (the daemon holds back tokens whose
         text is incomplete UTF-8 and sends them with the next piece, so chunks ≠ tokens).
    ws   /v1/ws, ``ws_connections`` sockets, requests spread round-robin, each generation by id;
         one `token` message per token, so per-token times are exact.

Per request (:class:`Record`, times in seconds, relative to when the request was sent)::

    ttft   first chunk with output text (sse) / first token (ws)
    e2e    the end of the response (the [DONE] event / the `done` message)
    tpot   (e2e - ttft) / (n_out - 1), for n_out >= 2
    lag    sent - scheduled: how late the client was (shows whether the client kept up)

Interruption: a replay that is cancelled (its task, or asyncio.run on Ctrl-C) or unwound by
KeyboardInterrupt / SystemExit stops where it is. A caller that passes ``records=[]`` keeps
what was measured: each request's record is appended to that list when the request is sent
(trace order), and on interruption every sent request still in flight gets
``error = "interrupted"`` (:data:`INTERRUPTED`: not completed, a failure in every figure below;
its ttft and chunk times so far are kept) and ``interrupted_at`` = the interruption time.
Requests not sent yet have no record. Completed and failed requests keep their records as
they were. The exception is then re-raised (the caller still sees the interruption).

Summary (:func:`summarize`): counts of requests (the records given: for an interrupted replay,
the requests sent), completed, failed (interrupted ones included) and interrupted; makespan =
from the first scheduled send to the end of the last completed response or, for a replay
interrupted with requests in flight, to the interruption (``interrupted_at``), whichever is
later: the server had those requests until then, so an interrupted point's throughput is what
it completed per second it ran (interrupted with none in flight, the point is the trace cut
where it stopped, and its last response ends it); throughput = completed requests / makespan
and output tokens of completed requests / makespan; mean and p50/p90/p99 (numpy's
linear-interpolation percentiles over completed requests) of ttft, tpot, e2e and inter-chunk
gaps; SLO attainment = share of *all* requests (failed and interrupted ones count as misses)
with ttft ≤ the TTFT SLO (S-LoRA: 6 s), with tpot ≤ the TPOT SLO (a request with one output
token meets any TPOT SLO), and with both.

    python -m bench.replay trace.jsonl --url http://127.0.0.1:8000 [--protocol ws] [--out r.json]
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from bench.workload import Request, Trace

SLO_TTFT_S = 6.0
"""S-LoRA's SLO: the first token within 6 seconds."""
PROTOCOLS = ("sse", "ws")
INTERRUPTED = "interrupted"
"""``Record.error`` of a request still in flight when its replay was interrupted."""


@dataclass
class Record:
    """What happened to one request."""

    i: int
    """The trace's request index."""
    variant: str
    """The trace's variant name."""
    prompt_len: int
    """Prompt tokens sent."""
    output_len: int
    """Output tokens asked for (max_tokens with ignore_eos)."""
    scheduled: float
    """Trace arrival time (seconds from the replay start)."""
    sent: float = math.nan
    """When the client started sending it (seconds from the replay start)."""
    ttft: float | None = None
    """Seconds from ``sent`` to the first output (None if none came)."""
    e2e: float | None = None
    """Seconds from ``sent`` to the end of the response (None if it failed)."""
    n_out: int = 0
    """Output tokens the server reported (usage), or counted (ws) when it did not."""
    chunk_times: list[float] = field(default_factory=list)
    """Seconds from ``sent`` at which each output chunk (sse) or token (ws) arrived."""
    status: int | None = None
    """HTTP status (sse); 200 for a ws generation that started."""
    error: str | None = None
    """Why it failed (HTTP error body, mid-stream error event, timeout, connection error), or
    :data:`INTERRUPTED`."""
    interrupted_at: float | None = None
    """When the replay was interrupted with this request in flight (seconds from the replay
    start; its error is then :data:`INTERRUPTED`); None otherwise."""

    @property
    def lag(self) -> float:
        return self.sent - self.scheduled

    @property
    def tpot(self) -> float | None:
        if self.error is not None or self.ttft is None or self.e2e is None or self.n_out < 2:
            return None
        return (self.e2e - self.ttft) / (self.n_out - 1)

    def row(self) -> dict[str, Any]:
        """The record without its chunk times (what result files keep per request)."""
        d = asdict(self)
        del d["chunk_times"]
        d["tpot"] = self.tpot
        return d


# ---------------------------------------------------------------------------------------------
# Metrics


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (numpy linear interpolation); None for no values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: list[Record], slo_ttft: float = SLO_TTFT_S, slo_tpot: float | None = None) -> dict[str, Any]:
    """The replay's figures (see the module docstring for every definition)."""
    done = [r for r in records if r.error is None and r.e2e is not None]
    n = len(records)
    interrupted = [r.interrupted_at for r in records if r.interrupted_at is not None]
    ends = [r.sent + r.e2e for r in done] + interrupted
    makespan = max(ends) - min(r.scheduled for r in records) if ends else 0.0
    out_tokens = sum(r.n_out for r in done)
    gaps = [b - a for r in done for a, b in itertools.pairwise(r.chunk_times)]
    ttft_ok = [r.error is None and r.ttft is not None and r.ttft <= slo_ttft for r in records]
    if slo_tpot is None:
        tpot_ok = [r.error is None and r.e2e is not None for r in records]
    else:
        tpot_ok = [r.error is None and r.e2e is not None and (r.tpot is None or r.tpot <= slo_tpot) for r in records]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            key = f"{r.status}: {r.error[:200]}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": n,
        "completed": len(done),
        "failed": n - len(done),
        "interrupted": len(interrupted),
        "output_len_mismatch": sum(r.n_out != r.output_len for r in done),
        "makespan_s": makespan,
        "throughput_req_s": len(done) / makespan if makespan > 0 else 0.0,
        "throughput_out_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_len for r in done),
        "ttft_s": percentiles([r.ttft for r in done]),
        "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
        "e2e_s": percentiles([r.e2e for r in done]),
        "inter_chunk_s": percentiles(gaps),
        "client_lag_s": {**percentiles([r.lag for r in records]), "max": max((r.lag for r in records), default=None)},
        "slo": {
            "ttft_s": slo_ttft,
            "tpot_s": slo_tpot,
            "ttft_attainment": sum(ttft_ok) / n if n else None,
            "tpot_attainment": sum(tpot_ok) / n if n else None,
            "attainment": sum(a and b for a, b in zip(ttft_ok, tpot_ok)) / n if n else None,
        },
        "errors": errors,
    }


# ---------------------------------------------------------------------------------------------
# Transports


class _SseTransport:
    """A streamed POST per request on its own connection, over plain asyncio streams.

    httpx was measured first: with 500 streams in flight (100 req/s, 20 ms per token) its
    per-line overhead made the client itself late by up to 0.7 s on one core; this reads the
    HTTP/1.1 response directly (chunked or close-delimited) and splits SSE events itself."""

    def __init__(self, url: str, timeout_s: float) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"url {url!r}: want http://HOST[:PORT]")
        self.host, self.port = u.hostname, u.port or 80
        self.path = (u.path.rstrip("/") or "") + "/v1/completions"

    async def run(self, req: Request, model: str, rec: Record, t0: float) -> None:
        body = json.dumps(req.body(model), separators=(",", ":")).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        try:
            writer.write(
                f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            rec.status = int(head[0].split(" ", 2)[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
            chunked = headers.get("transfer-encoding", "").lower() == "chunked"
            if rec.status != 200:
                rec.error = _error_message((await _read_body(reader, chunked)).decode(errors="replace"))
                return
            buf = b""
            async for data in _body_pieces(reader, chunked):
                now = time.perf_counter() - t0
                buf += data
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if self._event(event, rec, now):
                        return
            if rec.error is None:
                rec.error = "the stream ended without [DONE]"
        finally:
            writer.close()

    @staticmethod
    def _event(event: bytes, rec: Record, now: float) -> bool:
        """Applies one SSE event; True when the response is over."""
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                rec.e2e = now
                return True
            ev = json.loads(data)
            if "error" in ev:
                rec.error = _error_message(data.decode(errors="replace"))
                return True
            choices = ev.get("choices")
            if choices and choices[0].get("text"):
                if rec.ttft is None:
                    rec.ttft = now
                rec.chunk_times.append(now)
            if ev.get("usage"):
                rec.n_out = int(ev["usage"]["completion_tokens"])
        return False

    async def close(self) -> None:
        pass


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool):
    """The response body as it arrives: de-chunked, or read until the server closes."""
    if not chunked:
        while data := await reader.read(1 << 16):
            yield data
        return
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def _read_body(reader: asyncio.StreamReader, chunked: bool) -> bytes:
    return b"".join([d async for d in _body_pieces(reader, chunked)])


class _WsTransport:
    """``connections`` sockets; each has one reader task dispatching messages by id."""

    def __init__(self, ws_url: str, connections: int) -> None:
        self.ws_url = ws_url
        self.n = connections
        self.sockets: list[Any] = []
        self.readers: list[asyncio.Task] = []
        self.waiting: dict[str, tuple[Record, float, asyncio.Future]] = {}
        self.next = itertools.count()

    async def open(self) -> None:
        from websockets.asyncio.client import connect

        for _ in range(self.n):
            ws = await connect(self.ws_url, max_size=None, compression=None, ping_interval=None)
            self.sockets.append(ws)
            self.readers.append(asyncio.create_task(self._read(ws)))

    async def _read(self, ws) -> None:
        try:
            async for text in ws:
                now = time.perf_counter()
                msg = json.loads(text)
                entry = self.waiting.get(msg.get("id"))
                if entry is None:
                    continue
                rec, t0, fut = entry
                kind = msg.get("type")
                if kind == "token":
                    t = now - t0
                    if rec.ttft is None:
                        rec.ttft = t
                    rec.chunk_times.append(t)
                elif kind == "done":
                    rec.e2e = now - t0
                    rec.n_out = int(msg["usage"]["completion_tokens"])
                    if msg.get("finish_reason") == "abort":
                        rec.error = "aborted"
                    fut.set_result(None)
                elif kind == "error":
                    rec.error = _error_message(json.dumps(msg))
                    fut.set_result(None)
        except Exception as e:  # noqa: BLE001 - the socket died: fail what waits on it
            for rec, _, fut in list(self.waiting.values()):
                if not fut.done():
                    rec.error = f"websocket closed: {e!r}"
                    fut.set_result(None)

    async def run(self, req: Request, model: str, rec: Record, t0: float) -> None:
        ws = self.sockets[next(self.next) % self.n]
        rid = str(req.i)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = (rec, t0, fut)
        try:
            await ws.send(json.dumps({"type": "generate", "id": rid, "request": req.body(model, stream=True)}))
            rec.status = 200
            await fut
        finally:
            self.waiting.pop(rid, None)

    async def close(self) -> None:
        self.waiting.clear()  # first (no await before it): no message reaches a record after the replay
        for ws in self.sockets:
            await ws.close()
        for t in self.readers:
            t.cancel()


def _error_message(body: str) -> str:
    try:
        err = json.loads(body)["error"]
        return f"{err.get('type')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        return body[:500]


# ---------------------------------------------------------------------------------------------
# Replay


async def replay(trace: Trace, url: str, *, protocol: str = "sse", model_for: Callable[[str], str] | None = None,
                 ws_url: str | None = None, ws_connections: int = 4, timeout_s: float = 900.0,
                 lead_s: float = 0.1, records: list[Record] | None = None) -> list[Record]:  # fmt: skip
    """Sends every request of ``trace`` at ``start + t`` and returns their records (trace order).

    ``model_for`` maps a variant name to the request's ``model`` field (default: the name);
    ``ws_url`` defaults to ``url`` with ws:// and /v1/ws; ``lead_s`` is the time between the call
    and the trace's time 0 (connections are opened before). ``records``: a list each request's
    record is appended to when it is sent, so that the caller keeps the records of an
    interrupted replay (the module docstring's Interruption); after a complete replay it holds
    the same records as the returned list."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r}: want one of {', '.join(PROTOCOLS)}")
    model_for = model_for or (lambda v: v)
    models = {v.name: model_for(v.name) for v in trace.variants}
    if protocol == "sse":
        transport: Any = _SseTransport(url, timeout_s)
    else:
        transport = _WsTransport(ws_url or url.replace("http://", "ws://").rstrip("/") + "/v1/ws", ws_connections)
        await transport.open()
    all_records = [Record(i=r.i, variant=r.variant, prompt_len=len(r.prompt), output_len=r.output_len,
                          scheduled=r.t) for r in trace.requests]  # fmt: skip
    sent: list[Record] = records if records is not None else []

    async def one(req: Request, rec: Record, start: float) -> None:
        t0 = time.perf_counter()
        rec.sent = t0 - start
        sent.append(rec)  # tasks start in creation order: trace order
        try:
            async with asyncio.timeout(timeout_s):
                await transport.run(req, models[req.variant], rec, t0)
        except TimeoutError:
            rec.error = f"no complete response within {timeout_s} s"
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"

    tasks = []
    start = time.perf_counter() + lead_s
    try:
        for req, rec in zip(trace.requests, all_records):
            # A loop's timer may fire up to a clock tick early (uvloop's are whole milliseconds):
            # sleep again for what is left, so no request goes out before its time.
            while (delay := start + req.t - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, rec, start)))
        await asyncio.gather(*tasks)
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):  # interrupted: what is in flight stops here
        stopped = time.perf_counter() - start
        for rec in sent:
            if rec.error is None and rec.e2e is None:
                rec.error, rec.interrupted_at = INTERRUPTED, stopped
        raise
    finally:
        # The records stop changing here: the tasks are cancelled before they run again, and
        # transport.close() forgets the ws generations in flight before its first await.
        for t in tasks:
            t.cancel()
        await transport.close()
    return all_records


def event_loop_policy() -> str:
    """Installs uvloop when importable (faster sockets); returns the loop's name."""
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


@contextlib.contextmanager
def no_collector_pauses() -> Iterator[None]:
    """Collects once, then freezes every object alive (torch, numpy, the trace) out of the cyclic
    collector's scans for the block: a full collection over a process that imported torch took
    tens of milliseconds, long enough to make the client send late. Unfrozen afterwards."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_replay(trace: Trace, url: str, **kw) -> list[Record]:
    """Synchronous wrapper of :func:`replay` (its own event loop, uvloop when importable; no
    collector pauses)."""
    event_loop_policy()
    with no_collector_pauses():
        return asyncio.run(replay(trace, url, **kw))


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Replay a trace (bench/workload.py) open-loop against a server.")
    p.add_argument("trace", type=Path)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--protocol", choices=PROTOCOLS, default="sse")
    p.add_argument("--model-prefix", default="", help="prepended to each variant name, e.g. 'base:'")
    p.add_argument("--slo-ttft", type=float, default=SLO_TTFT_S)
    p.add_argument("--slo-tpot", type=float, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the summary and per-request rows as JSON")
    a = p.parse_args()
    trace = Trace.read(a.trace)
    records: list[Record] = []
    try:
        run_replay(trace, a.url, protocol=a.protocol, model_for=lambda v: a.model_prefix + v, records=records)
        interrupted = False
    except KeyboardInterrupt:  # Ctrl-C: report the requests sent so far, then exit 130
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # `timeout -s INT` signals twice: finish the report
        interrupted = True
    summary = summarize(records, a.slo_ttft, a.slo_tpot)
    print(json.dumps(summary, indent=1))
    if interrupted:
        print(f"interrupted: {len(records)} of {len(trace.requests)} requests sent", file=sys.stderr)
    if a.out:
        a.out.write_text(json.dumps({"trace": trace.params, "summary": summary, "interrupted": interrupted,
                                     "requests": [r.row() for r in records]}, indent=1))  # fmt: skip
    if interrupted:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
