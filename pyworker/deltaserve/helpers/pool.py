"""``HelperPool``: the worker's CPU LoRA helper processes, started lazily, pinned, restarted.

Each helper is a ``python -m deltaserve.helpers.main`` child pinned to one CPU (``cores``: the
worker's allowed CPUs, last first, so the lowest stay with the worker's own threads). It maps the
arena read-only and the control and data segments read-write (``shm.py``). Life of one helper::

    (none) ─ start() ─> starting ─ hello (H) ─> ready ─ a job times out / its pipe breaks ─> dead
      ^                                                                                      │
      └────────────────────── start() again (the next step that wants helpers) ─────────────┘

A job is ``submit`` (control words, then the ``J`` doorbell) and ``wait`` (poll the helpers' reply
pipes until every job's ``DONE`` word equals its ``SEQ``, or the deadline). ``wait`` never hangs:
a helper past the deadline, or whose pipe closed, is killed and reported failed, and the caller
computes its rows itself. ``close`` (and the worker's exit: the helpers' ``PR_SET_PDEATHSIG`` and
EOF on their pipes) stops them all, so none outlives its worker.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import protocol as p
from .shm import SharedSegment

log = logging.getLogger("deltaserve.worker")


@dataclass
class HelperProc:
    """One helper process and the worker's ends of its pipes."""

    index: int
    core: int
    proc: subprocess.Popen
    cmd: int
    """Worker -> helper pipe (write end)."""
    reply: int
    """Helper -> worker pipe (read end)."""
    started: float
    ready: bool = False
    macs_per_ms: float = 0.0
    """Its profile: multiply-adds per ms of a shrink + expand on its core."""
    pending: bytearray = field(default_factory=bytearray)
    """Reply bytes read but not parsed yet (a hello may arrive in pieces)."""


def helper_cores(n: int) -> list[int]:
    """CPUs for ``n`` helpers: the worker's allowed CPUs, highest first, wrapping around."""
    cpus = sorted(os.sched_getaffinity(0), reverse=True)
    return [cpus[i % len(cpus)] for i in range(n)]


class HelperPool:
    """``n`` helper processes over one arena (module docstring)."""

    def __init__(self, n: int, arena: SharedSegment, spec: p.ModelSpec, layout: p.DataLayout) -> None:
        if n < 1:
            raise ValueError(f"HelperPool: n must be >= 1, got {n}")
        self.n = n
        self.arena = arena
        self.spec = spec
        self.layout = layout
        self.control = SharedSegment(n * p.JOB_WORDS * 8, "cpu-lora-control")
        self.words = self.control.array(np.int64).reshape(n, p.JOB_WORDS)
        """[n, JOB_WORDS] the control words (``protocol.py``)."""
        self.data = SharedSegment(layout.size, "cpu-lora-data")
        self.cores = helper_cores(n)
        self.procs: list[HelperProc | None] = [None] * n
        self.seq = 0
        """The last job sequence number handed out."""
        self.restarts = 0
        """Helpers started again after one died or stalled."""
        self._ever_started = [False] * n
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Starts every helper that is not running (returns at once; each is ready after its hello)."""
        if self._closed:
            return
        for i in range(self.n):
            if self.procs[i] is None:
                self._spawn(i)

    def _spawn(self, i: int) -> None:
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        fds = (cmd_r, reply_w, self.arena.fd, self.control.fd, self.data.fd)
        argv = [
            sys.executable, "-m", "deltaserve.helpers.main", "--index", str(i), "--core", str(self.cores[i]),
            "--cmd-fd", str(cmd_r), "--reply-fd", str(reply_w),
            "--arena-fd", str(self.arena.fd), "--arena-size", str(self.arena.size),
            "--control-fd", str(self.control.fd), "--control-size", str(self.control.size),
            "--data-fd", str(self.data.fd), "--data-size", str(self.data.size),
            "--out-offset", str(self.layout.out_offset), "--spec", self.spec.to_json(),
        ]  # fmt: skip
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.Popen(argv, pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(reply_w)
        if self._ever_started[i]:
            self.restarts += 1
        self._ever_started[i] = True
        self.words[i, p.LAYER :] = 0  # SEQ and DONE stay: numbers only grow (a device wait may read DONE)
        self.procs[i] = HelperProc(i, self.cores[i], proc, cmd_w, reply_r, time.monotonic())
        log.debug("cpu-lora helper %d started (pid %d, CPU %d)", i, proc.pid, self.cores[i])

    def kill(self, i: int, why: str) -> None:
        """Stops helper ``i`` for good (a later ``start`` starts a fresh one)."""
        h = self.procs[i]
        if h is None:
            return
        self.procs[i] = None
        log.warning("cpu-lora helper %d (pid %d): %s; stopped, restarted at the next cold prefill", i, h.proc.pid, why)
        for fd in (h.cmd, h.reply):
            try:
                os.close(fd)
            except OSError:
                pass
        if h.proc.poll() is None:
            h.proc.send_signal(signal.SIGKILL)
        try:
            h.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Stops every helper and waits for them."""
        if self._closed:
            return
        self._closed = True
        for h in self.procs:
            if h is not None:
                try:
                    os.write(h.cmd, b"Q")
                except OSError:
                    pass
        for i, h in enumerate(self.procs):
            if h is None:
                continue
            try:
                h.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            if h.proc.poll() is None:
                self.kill(i, "closing")
            else:
                self._forget(i)

    def _forget(self, i: int) -> None:
        h = self.procs[i]
        self.procs[i] = None
        if h is not None:
            for fd in (h.cmd, h.reply):
                try:
                    os.close(fd)
                except OSError:
                    pass

    # ------------------------------------------------------------------ state

    def poll(self) -> None:
        """Reads what the helpers said without waiting: hellos make them ready; a closed pipe kills."""
        for i, h in enumerate(self.procs):
            if h is not None:
                self._drain(i, h, 0.0)

    def ready(self) -> list[int]:
        """Indexes of the ready helpers."""
        return [i for i, h in enumerate(self.procs) if h is not None and h.ready]

    def pid(self, i: int) -> int | None:
        h = self.procs[i]
        return None if h is None else h.proc.pid

    def profile_macs_per_ms(self) -> float | None:
        """The median profile of the ready helpers (None before any hello)."""
        values = sorted(h.macs_per_ms for h in self.procs if h is not None and h.ready)
        return values[len(values) // 2] if values else None

    def wait_ready(self, timeout: float) -> list[int]:
        """Waits up to ``timeout`` s for every running helper's hello; returns the ready ones."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            starting = [h for h in self.procs if h is not None and not h.ready]
            left = deadline - time.monotonic()
            if not starting or left <= 0:
                return self.ready()
            fds = [h.reply for h in starting]
            select.select(fds, [], [], min(left, 0.05))

    def _drain(self, i: int, h: HelperProc, timeout: float) -> bool:
        """Reads helper ``i``'s reply pipe (waiting up to ``timeout`` s); False when it closed."""
        r, _, _ = select.select([h.reply], [], [], timeout)
        if not r:
            return True
        try:
            chunk = os.read(h.reply, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            self.kill(i, "its pipe closed (the process exited)")
            return False
        h.pending += chunk
        while h.pending:
            if h.pending[0:1] == b"d":
                del h.pending[0]
            elif h.pending[0:1] == b"H":
                if len(h.pending) < 5:
                    break
                n = int.from_bytes(h.pending[1:5], "little")
                if len(h.pending) < 5 + n:
                    break
                hello = p.parse_hello(h.pending[5 : 5 + n].decode())
                del h.pending[: 5 + n]
                h.ready, h.macs_per_ms = True, hello["macs_per_ms"]
            else:
                self.kill(i, f"it sent an unknown frame {bytes(h.pending[:1])!r}")
                return False
        return True

    # ------------------------------------------------------------------ jobs

    def send(self, i: int, data: bytes) -> bool:
        """Writes a frame to helper ``i``; False (and the helper killed) when its pipe is broken."""
        h = self.procs[i]
        if h is None:
            return False
        try:
            os.write(h.cmd, data)
            return True
        except OSError as e:
            self.kill(i, f"writing to it failed ({e})")
            return False

    def next_seq(self) -> int:
        """A new job sequence number (one per (step, layer, module) job; see ``protocol.py``)."""
        self.seq += 1
        return self.seq

    def proc(self, i: int) -> subprocess.Popen | None:
        """Helper ``i``'s process (None when it is not running)."""
        h = self.procs[i]
        return None if h is None else h.proc

    def submit(self, i: int, layer: int, module: int, lo: int, hi: int, rows: int, dtype: int) -> int | None:
        """Hands helper ``i`` a job; its sequence number, or None when the helper is gone."""
        self.next_seq()
        w = self.words[i]
        w[p.LAYER], w[p.MODULE], w[p.LO], w[p.HI], w[p.ROWS], w[p.DTYPE], w[p.STATUS] = (
            layer, module, lo, hi, rows, dtype, 0
        )  # fmt: skip
        w[p.SEQ] = self.seq  # last: the job is complete before its number is
        return self.seq if self.send(i, b"J") else None

    def wait(self, jobs: dict[int, int], deadline: float) -> set[int]:
        """Waits until each helper in ``jobs`` (index -> seq) finished its job, or ``deadline``
        (``time.monotonic``); returns the helpers that failed (killed if they stalled or died)."""
        waiting = dict(jobs)
        failed: set[int] = set()
        while waiting:
            for i, seq in list(waiting.items()):
                if int(self.words[i, p.DONE]) == seq:
                    del waiting[i]
                    if int(self.words[i, p.STATUS]) != 0:
                        failed.add(i)
            if not waiting:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                for i in waiting:
                    self.kill(i, "it missed its job's deadline")
                failed.update(waiting)
                break
            live = {self.procs[i].reply: i for i in waiting if self.procs[i] is not None}  # type: ignore[union-attr]
            gone = [i for i in waiting if self.procs[i] is None]
            failed.update(gone)
            for i in gone:
                del waiting[i]
            if not live:
                break
            r, _, _ = select.select(list(live), [], [], left)
            for fd in r:
                i = live[fd]
                h = self.procs[i]
                if h is not None and not self._drain(i, h, 0.0) and i in waiting:
                    if int(self.words[i, p.DONE]) != waiting[i]:
                        failed.add(i)
                        del waiting[i]
        return failed


__all__ = ["HelperPool", "HelperProc", "helper_cores"]
