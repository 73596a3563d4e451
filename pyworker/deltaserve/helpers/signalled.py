"""The sync-free helper invocation (CaraServe §4.2): the launching thread never waits for the helpers.

Per (step, layer, module) job, with sequence number ``seq`` (``HelperPool.next_seq``: one number
per job, increasing for the pool's life, so it names the layer and the step)::

    launching thread (LoraLinear.forward)              device stream, in order
    ─────────────────────────────────────              ─────────────────────────────────────
    send: j frame (seq, layer, module, rows) to each    x rows ─copy─▶ data segment (mapped)
          helper of the step; the job to the watcher    SEQ words := seq           (signal_op.send)
          queue the copy + SEQ write ─────────────────▶ base matmul, ...
    add:  queue the wait on each helper's DONE ───────▶ spin until DONE == seq     (signal_op.wait)
          queue the result's copy in and the add ─────▶ res ─copy─▶ device; out[rows] += res

    helper h: reads its j frame, spins until SEQ ≥ seq, computes its rows, writes DONE = seq.
    watcher (a thread of the worker): sees SEQ ≥ seq, then for each helper of the job: DONE = seq
        in time ─▶ nothing to do; FAILED = seq, the process gone, or its deadline passed ─▶ kills it
        (SIGKILL, waits for the exit: it writes nothing more), computes its rows itself from the
        same host copy (``compute.py``, the helpers' math) and writes DONE = seq on its behalf.

So the device's wait ends with correct rows whether a helper answered or the watcher did, and the
step's output stays correct. The device wait has a bound (``DEVICE_GUARD_S``, far past any job
deadline) for the case where even the watcher cannot answer: it sets the ``failed`` word instead
of hanging, and the step's finish raises (a fatal worker error: the router restarts the worker and
fails its requests, never a hang).

Why the watcher computes the rows rather than falling back to the adapter's GPU pages ("wait for
the GPU load"): by the time a deadline passes the stream has queued the rest of the layer behind
the wait, with the rows treated as base rows by the pools; the host copy gives the same numbers
now, and the load cannot be sooner than the CPU math of one job on one core.

On a CPU worker the same protocol runs on ``signal_op``'s host fallback (the copy and the SEQ
write done at once, the wait a host poll): what the tests exercise. ``assist.py`` picks this path
on CUDA when the op is built (``invocation`` "auto"), and keeps the host-synchronised one ("host")
for CPU workers and as the benchmark's baseline.
"""

from __future__ import annotations

import logging
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import protocol as p
from .compute import RAW_DTYPES, adapter_weights, module_delta, to_f32

log = logging.getLogger("deltaserve.worker")

DEVICE_GUARD_S = 30.0
"""Bound of the device's wait on one job's DONE words; past it the ``failed`` word is set (module
docstring). Far past any job deadline: the watcher answers long before."""
SIGNAL_LOST_S = 120.0
"""The watcher drops a job whose SEQ never comes (its step failed on the device)."""
POLL_S = 5e-4
"""The watcher's look interval at the words: it supervises, it is not on the fast path."""


@dataclass
class SignalledJob:
    """One (step, layer, module) job as the watcher supervises it."""

    seq: int
    layer: int
    module: int
    rows: int
    """Compacted rows of ``x`` in the data segment."""
    code: int
    """``DTYPE_CODES`` of ``x``."""
    in_dim: int
    width: int
    """Columns of the result rows."""
    chunks: list[tuple[int, int, int, int]]
    """(helper, lo, hi, adapter) of the step."""
    entries: dict[int, p.AdapterEntry]
    """The step's adapters by id."""
    procs: dict[int, subprocess.Popen | None]
    """Each chunk's helper process when the job was sent; None: the watcher computes it at once."""
    deadline_s: float
    """How long after SEQ the helpers may take."""
    step: int
    """The step's number (fallbacks count once per step and adapter)."""
    requests: dict[int, int]
    """Requests of each adapter prefilled this step."""


@dataclass
class WatcherCounts:
    fallbacks: int = 0
    """Assisted prefills (requests) with rows the watcher computed."""
    dead: set[int] = field(default_factory=set)
    """Helpers it killed, for the launching thread to clean up (``take_dead``)."""


class Watcher:
    """The worker's supervisor of signalled jobs (module docstring); one thread, started lazily."""

    def __init__(self, words: np.ndarray, data: np.ndarray, arena: np.ndarray, spec: p.ModelSpec, out_offset: int):
        self.words = words
        """[helpers, JOB_WORDS] int64 control words."""
        self.data = data
        """The data segment as uint8."""
        self.arena = arena
        self.spec = spec
        self.out_offset = out_offset
        self._jobs: queue.Queue[SignalledJob | None] = queue.Queue()
        self._lock = threading.Lock()
        self._counts = WatcherCounts()
        self._fell_back: set[tuple[int, int]] = set()
        self._thread: threading.Thread | None = None
        self.idle = threading.Event()
        """Set while no job is queued or being watched."""
        self.idle.set()

    def submit(self, job: SignalledJob) -> None:
        """Watches ``job`` (call before the device can signal it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cpu-lora-watcher", daemon=True)
            self._thread.start()
        self.idle.clear()
        self._jobs.put(job)

    def take_fallbacks(self) -> int:
        with self._lock:
            n, self._counts.fallbacks = self._counts.fallbacks, 0
        return n

    def take_dead(self) -> set[int]:
        with self._lock:
            dead, self._counts.dead = self._counts.dead, set()
        return dead

    def is_dead(self, helper: int) -> bool:
        with self._lock:
            return helper in self._counts.dead

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            if self._jobs.empty():
                self.idle.set()
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._watch(job)
            except Exception:  # noqa: BLE001 - the device guard catches what the watcher misses
                log.exception("cpu-lora watcher: job %d", job.seq)

    def _watch(self, job: SignalledJob) -> None:
        words = self.words
        helpers = sorted({h for h, *_ in job.chunks})
        start = time.monotonic()
        while int(words[helpers[0], p.SEQ]) < job.seq:  # the device copied x (every row gets SEQ)
            if time.monotonic() - start > SIGNAL_LOST_S:
                log.error("cpu-lora watcher: job %d was never signalled; dropped", job.seq)
                return
            time.sleep(POLL_S)
        deadline = time.monotonic() + job.deadline_s
        waiting = {h for h in helpers if job.procs.get(h) is not None}
        for h in helpers:
            if h not in waiting:
                self._answer(job, h)
        while waiting:
            for h in sorted(waiting):
                if int(words[h, p.DONE]) == job.seq:
                    waiting.discard(h)
                    continue
                proc = job.procs[h]
                assert proc is not None
                failed = int(words[h, p.FAILED]) == job.seq
                if failed or proc.poll() is not None or time.monotonic() > deadline:
                    why = "it failed the job" if failed else "it exited" if proc.poll() is not None else "deadline"
                    self._kill(h, proc, why)
                    waiting.discard(h)
                    self._answer(job, h)
            if waiting:
                time.sleep(POLL_S)

    def _kill(self, h: int, proc: subprocess.Popen, why: str) -> None:
        """Stops helper ``h`` for good before its rows are rewritten (no late write can land)."""
        log.warning(
            "cpu-lora helper %d (pid %d): %s on a signalled job; the worker computes its rows", h, proc.pid, why
        )
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("cpu-lora helper %d (pid %d) did not exit after SIGKILL", h, proc.pid)
        with self._lock:
            self._counts.dead.add(h)

    def _answer(self, job: SignalledJob, h: int) -> None:
        """Computes helper ``h``'s rows of ``job`` and writes its DONE word."""
        in_dim, rows, width = job.in_dim, job.rows, job.width
        x = np.frombuffer(self.data, dtype=RAW_DTYPES[job.code], count=rows * in_dim, offset=0).reshape(rows, in_dim)
        out = np.frombuffer(self.data, dtype=np.float32, count=rows * width, offset=self.out_offset)
        out = out.reshape(rows, width)
        for helper, lo, hi, aid in job.chunks:
            if helper != h:
                continue
            entry = job.entries[aid]
            weights = adapter_weights(self.arena, entry)
            module_delta(to_f32(x[lo:hi], job.code), weights, entry, self.spec, job.layer, job.module, out[lo:hi])
            with self._lock:
                if (job.step, aid) not in self._fell_back:
                    self._fell_back = {k for k in self._fell_back if k[0] >= job.step - 2}  # older steps are done
                    self._fell_back.add((job.step, aid))
                    self._counts.fallbacks += job.requests.get(aid, 0)
        self.words[h, p.DONE] = job.seq  # after the rows: the device's wait then reads them


__all__ = ["DEVICE_GUARD_S", "SignalledJob", "Watcher"]
