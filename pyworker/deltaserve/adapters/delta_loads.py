"""Delta loads beside the steps: a delta's ``to_gpu`` copies (3.4 GB for a Llama-2-7B 4-bit 2:4 delta,
~80 ms over PCIe on an H200) run on their own CUDA stream, launched from one loader thread, so the
steps of every running request go on while they cross, instead of waiting behind them.

The router sends a delta's ``to_gpu`` in a step that computes other requests anyway and admits the
requests that need it once ``StepOutput.gpu_ready`` reports the copy finished (``gpu_load_reports``,
``router/crates/sched/src/admission.rs``); with nothing else to run it admits them in the same step,
whose stream then waits for the copy. The delta pool places the delta on the main thread (its slot,
block slots and bookkeeping: ``DeltaPool._place``) and hands the device work here::

    start(id, work)  main thread: event ``after`` on the step stream (a block slot an evicted delta
                     held may still be read by a step in flight)
                     loader thread, holding LAUNCH_LOCK: the load stream waits for ``after``; ``work``
                     (copies, repacks, tables) on that stream; event ``done``
    wait(ids)        a step that uses a delta still loading: the thread's launches finished, then the
                     step's stream waits for ``done``; a load that failed raises here, in every step
                     that would use it, until ``forget``
    take_ready()     ids whose ``done`` has passed (or whose load failed) since the last call: the
                     next ``StepOutput.gpu_ready``
    forget(id)       ``drop_gpu``: the thread's launches finished; later loads into the same slots
                     follow on the same stream
    host_fence(id)   ``drop_host``: the copy's host memory is given back with its fence recorded on
                     the load stream, after the copies that read it

While the thread launches (~60 ms of Python for a Llama-2-7B delta: ~900 copies and allocations, 224
repacks) it lowers the interpreter's switch interval (``SWITCH_INTERVAL_S``), so the step thread, woken
by a plan or a finished step, takes the GIL back within half a millisecond instead of five.

A CUDA graph capture holds ``LAUNCH_LOCK`` (``worker/cuda_graphs.py``, ``worker/mixed_graphs.py``):
a capture must see no other thread's launches or allocations. Without ``threaded`` (the CPU worker)
``start`` runs the work at once on the caller's thread and reports it ready at the next call.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import torch

LAUNCH_LOCK = threading.Lock()
"""Held by the loader thread while it launches a load's work, and by a CUDA graph capture."""
SWITCH_INTERVAL_S = 0.0005
"""The interpreter's switch interval while the loader thread launches (Python's default is 5 ms)."""


class DeltaLoadError(RuntimeError):
    """A delta's copy to the GPU failed on the loader thread (the step that needs it fails with it)."""


class DeltaLoads:
    """The ``to_gpu`` work of deltas, run beside the steps (module docstring)."""

    def __init__(self, device: torch.device, threaded: bool | None = None) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.threaded = cuda if threaded is None else threaded
        self.stream = torch.cuda.Stream(device) if cuda and self.threaded else None
        """The stream every load's work runs on (None: the caller's)."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="delta-to-gpu") if self.threaded else None
        self._running: dict[int, Future[torch.cuda.Event | None]] = {}
        self._failed: dict[int, BaseException] = {}
        self._ready: list[int] = []

    def start(self, delta_id: int, work: Callable[[], None]) -> None:
        """Runs ``work`` (the delta's device copies) beside the steps; ``delta_id`` must not be loading."""
        assert not self.loading(delta_id), f"delta {delta_id} is loading"
        if self._thread is None:
            work()
            self._ready.append(delta_id)
            return
        after = None
        if self.stream is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))  # the caller's: every step launched so far

        def run() -> torch.cuda.Event | None:
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
            try:
                with LAUNCH_LOCK, torch.inference_mode(), self._on_device(), self._on_stream():
                    if after is not None and self.stream is not None:
                        self.stream.wait_event(after)
                    work()
                    if self.stream is None:
                        return None
                    done = torch.cuda.Event()
                    done.record(self.stream)
                    return done
            finally:
                sys.setswitchinterval(interval)

        self._running[delta_id] = self._thread.submit(run)

    def _on_stream(self) -> torch.cuda.StreamContext | nullcontext[None]:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _on_device(self) -> torch.cuda.device | nullcontext[None]:
        """The worker's device as the loader thread's current one (a thread starts on device 0)."""
        return torch.cuda.device(self.device) if self.stream is not None else nullcontext()

    def loading(self, delta_id: int) -> bool:
        """Whether ``delta_id``'s load is not known finished yet (or failed and not forgotten)."""
        return delta_id in self._running or delta_id in self._failed

    def after_all(self) -> None:
        """Makes the caller's stream wait for every load still running (a failed one is left to the
        ``wait`` of the steps that use it): what a copy made in place, on the step's stream, does
        before it relies on a piece a load beside the steps may still be copying."""
        for delta_id in list(self._running):
            done, _ = self._settle(delta_id)
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)

    def wait(self, delta_ids: Collection[int]) -> None:
        """Makes the caller's stream wait for the loads of ``delta_ids`` still running (ids not loading
        are ignored); DeltaLoadError for one that failed."""
        for delta_id in delta_ids:
            error = self._failed.get(delta_id)
            if error is None and delta_id in self._running:
                done, error = self._settle(delta_id)
                if done is not None:
                    torch.cuda.current_stream(self.device).wait_event(done)
            if error is not None:
                raise DeltaLoadError(f"delta {delta_id}: its copy to the GPU failed ({error!r})") from error

    def _settle(self, delta_id: int) -> tuple[torch.cuda.Event | None, BaseException | None]:
        """Waits for the thread's launches of ``delta_id``'s load: its ``done`` event, or its error (kept
        in ``_failed``, the load no longer running)."""
        future = self._running[delta_id]
        error = future.exception()
        if error is None:
            return future.result(), None
        del self._running[delta_id]
        self._failed[delta_id] = error
        self._ready.append(delta_id)
        return None, error

    def take_ready(self) -> list[int]:
        """Ids whose loads finished on the device (or failed) since the last call, in the order seen."""
        for delta_id, future in list(self._running.items()):
            if not future.done():
                continue
            if future.exception() is not None:
                self._settle(delta_id)
                continue
            done = future.result()
            if done is None or done.query():
                del self._running[delta_id]
                self._ready.append(delta_id)
        ready, self._ready = self._ready, []
        return ready

    def forget(self, delta_id: int) -> None:
        """``delta_id`` leaves the GPU: its thread's launches finish first (its slots' later loads
        follow on the same stream); a failure is dropped with it."""
        future = self._running.pop(delta_id, None)
        if future is not None:
            future.exception()  # waits; an error goes with the delta
        self._failed.pop(delta_id, None)

    @contextmanager
    def host_fence(self, delta_id: int) -> Iterator[None]:
        """The context in which ``delta_id``'s host copy is given back (``pinned_arena.give_back`` records
        the region's fence on the current stream, which must follow every copy that read it): the load
        stream, once the thread's launches finished and after the caller's stream's work so far (a
        ``to_gpu`` run in place, by the block speculation gate, copies on the step's stream)."""
        future = self._running.get(delta_id)
        if future is not None:
            future.exception()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_stream():
            yield

    def close(self) -> None:
        """Waits for the loads being launched and stops the thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)


__all__ = ["LAUNCH_LOCK", "SWITCH_INTERVAL_S", "DeltaLoadError", "DeltaLoads"]
