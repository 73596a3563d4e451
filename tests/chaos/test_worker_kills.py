"""Chaos: the worker SIGKILLed mid-stream, three times, then SIGTERM with requests in flight
(issue 28). One daemon on the tiny model for the module.

- Each round starts ``STREAMS`` SSE streams (more than the KV pool runs at once, so some are
  queued), SIGKILLs the worker once the first ones have a token, and checks that every stream
  ends with an event: an error event (or ``[DONE]`` for one that finished first), or, for a
  request the kill caught before its response began, an HTTP error with an error body; none
  left open. The restart time (the kill to ``/ready`` 200 and a request served) is measured and
  printed, and a greedy request then answers exactly as before the kills.
- Last: SIGTERM with streams in flight that can finish within ``--drain-timeout``. Every one
  finishes with ``[DONE]`` (drained, not cut), the daemon exits 0, none of its descendants
  (workers of every incarnation) outlives it, and no ``/dev/shm`` file of its pid is left,
  the rings of the killed workers' earlier incarnations included. The drain time is printed.
  ``tests/e2e/test_failures.py`` proves the other half: what the drain timeout cuts ends with an
  error event, and the 503 + ``Retry-After`` while draining.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from .daemons import Daemon, tiny_daemon_flags

ROUNDS = 3
STREAMS = 12
EVENT_S = 10.0  # every stream's last event within this of the kill
RESTART_BOUND_S = 120.0
GREEDY = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tiny_llama):
    # 1024 tokens of KV: 4 of the 250-token streams run at once, the rest queue.
    flags = tiny_daemon_flags(tiny_llama, 1024, "--drain-timeout", "60")
    with Daemon(tiny_llama, *flags) as d:
        yield d


def _children(pid: int) -> dict[int, int]:
    """pid -> parent pid of every process."""
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            out[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> set[int]:
    parents = _children(pid)
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def worker_pids(daemon_pid: int) -> list[int]:
    pids = []
    for pid in descendants(daemon_pid):
        try:
            if b"deltaserve.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            pass
    return pids


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        state = [x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(("State", "PPid"))]
        return f"{cmd} {state}"
    except OSError:
        return "gone"


class Stream(threading.Thread):
    """One SSE completion; records its events and when the last one came."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.events: list[str] = []
        self.ended_at: float | None = None
        self.failure: Exception | None = None
        self.status: int | None = None

    def run(self) -> None:
        body = {"prompt": "a long story", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.events.append(r.read().decode())
                    return
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(line[5:].strip())
                        self.first.set()
        except httpx.HTTPError as e:
            self.failure = e
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    @property
    def last(self) -> str:
        return self.events[-1] if self.events else ""


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_worker_sigkilled_mid_stream_three_times(daemon):
    before = httpx.post(f"{daemon.url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    restarts = []
    statuses: Counter = Counter()
    for round_ in range(ROUNDS):
        [pid] = worker_pids(daemon.proc.pid)
        streams = [Stream(daemon.url, 240) for _ in range(STREAMS)]
        for s in streams:
            s.start()
        running = streams[:4]  # the first ones in hold the pool; wait for them
        for s in running:
            assert s.first.wait(30), "no token before the kill"
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for s in streams:
            s.join(EVENT_S + 30)
        assert all(not s.is_alive() for s in streams), "a stream was left open after the kill"
        for s in streams:
            assert s.failure is None, s.failure
            # A stream that had started ends with an error event (or [DONE]); one the kill caught
            # before its response began gets an HTTP error with an OpenAI error body instead.
            last = s.last
            ended = last == "[DONE]" or (last.startswith("{") and "error" in json.loads(last))
            assert ended, f"round {round_}: a stream ended without an event: {s.status} {s.events[-3:]}"
            statuses[s.status] += 1
            assert s.ended_at - killed < EVENT_S, f"the stream's last event came {s.ended_at - killed:.1f} s late"
        while not _ready(daemon.url):
            assert time.monotonic() - killed < RESTART_BOUND_S, "the worker was not restarted"
            time.sleep(0.05)
        r = httpx.post(f"{daemon.url}/v1/completions", json=GREEDY, timeout=60)
        assert r.status_code == 200, r.text
        restarts.append(time.monotonic() - killed)
        assert r.json()["choices"][0]["text"] == before
        errors = sum(s.last != "[DONE]" for s in streams)
        print(f"\nchaos kill {round_ + 1}: {STREAMS} streams, {errors} ended by an error event, "
              f"the last {max(s.ended_at for s in streams) - killed:.2f} s after the kill; "
              f"serving again after {restarts[-1]:.2f} s")  # fmt: skip
    assert daemon.metrics()["deltaserve_worker_restarts_total"] == ROUNDS
    print(f"chaos kills: restart times {[round(t, 2) for t in restarts]} s; response statuses {dict(statuses)}")


def test_sigterm_drains_in_flight_streams_and_leaves_nothing(daemon):
    """Last in the module: it stops the daemon."""
    pid = daemon.proc.pid
    streams = [Stream(daemon.url, 100) for _ in range(8)]
    for s in streams:
        s.start()
    for s in streams:  # all in flight (the pool holds all 8), none still on its way
        assert s.first.wait(30)
    family = descendants(pid)
    assert worker_pids(pid), "no worker running"
    shm = list(Path("/dev/shm").glob(f"deltaserve-{pid}-*"))
    assert shm, "the live worker's rings should be in /dev/shm"
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.wait_exit(90) == 0
    drain_s = time.monotonic() - started
    for s in streams:
        s.join(10)
        assert s.failure is None and s.last == "[DONE]", (s.failure, s.events[-2:])
    alive = {p: _describe(p) for p in family if Path(f"/proc/{p}").exists()}
    assert not alive, f"processes of the daemon outlived it: {alive}"
    left = list(Path("/dev/shm").glob(f"deltaserve-{pid}-*"))
    assert not left, f"/dev/shm files left behind: {left}"
    print(f"\nchaos drain: SIGTERM with {len(streams)} streams in flight, all finished, "
          f"daemon exited after {drain_s:.2f} s, {len(family)} descendants gone, {len(shm)} IPC dirs removed")  # fmt: skip
