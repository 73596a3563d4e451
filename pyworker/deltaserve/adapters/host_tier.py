"""The host-memory tier of variants on the worker: copies read in background threads, by variant id.

Shared by the LoRA pool (``lora_pool.py``) and the delta pool (``delta_pool.py``): ``to_host``
starts a load (``load``), ``to_gpu`` waits for it (``wait``: a failed load is ``AdapterLoadError``,
fatal for the worker), ``drop_host`` forgets it (``drop``). ``nbytes`` is what the worker reports
as its host tier: finished copies measured, running loads as expected. A mapping of variant id ->
``HostEntry`` (``in``, iteration, ``get``) for the executor's plan validation.

``nbytes`` is read after every step (``StepOutput.adapter_host_bytes``), so it is a running total
kept as loads start, finish and are dropped, not a sum over the (thousands of) entries.

``release`` (optional) gets back each copy the tier lets go of (``drop``), once its load has
finished well: the pools return the copy's memory to the worker's pinned arena. Its second argument
says whether the copy may be the source of copies still queued on the device (it was ready
before the drop, so a ``to_gpu`` may have read it), or not (the load was still running).

``take_finished`` hands out the ids whose loads finished since it was last called
(``StepOutput.host_ready``): the router admits a request whose variant is still being read only
when the step would compute nothing else, since the step's ``to_gpu`` waits for the read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

LOAD_THREADS = 4
"""Background threads reading variants into host memory per pool (disk and parsing bound; torch and
safetensors release the GIL while they copy). S-LoRA's n = 2000 point, where nearly every request
needs an adapter that is not resident, waits on these loads."""


class AdapterLoadError(RuntimeError):
    """A ``to_host`` load failed (directory vanished or changed since ``inspect``).

    Raised by ``to_gpu`` (the first op that needs the copy). Fatal for the worker: the router
    believes the variant is loadable, so the loop reports a fatal ``WorkerError`` and exits.
    """


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


C = TypeVar("C", bound=_Sized)


@dataclass(eq=False)
class HostEntry(Generic[C]):
    """A variant in the host tier: its load (maybe still running) and what it is expected to cost."""

    path: Path
    """The directory it is read from."""
    future: Future[C]
    """The background load; its result is the copy, its exception why the load failed."""
    expected_bytes: int
    """Bytes the copy will take, counted while the load runs."""
    counted: int = 0
    """What ``HostTier.nbytes`` counts for it now: ``expected_bytes`` while loading, the copy's
    ``nbytes`` once loaded, 0 when the load failed or the entry was dropped."""
    dropped: bool = False
    """Forgotten by ``drop``: a load finishing later counts nothing."""
    settled: bool = False
    """Its finish was counted and listed for ``take_finished`` (once, by the first ``_settle``)."""


class HostTier(Generic[C]):
    """Host copies of one pool's variants, loaded in the background (module docstring)."""

    def __init__(self, what: str, release: Callable[[C, bool], None] | None = None) -> None:
        self.what = what
        """How errors name a variant: ``adapter`` or ``delta``."""
        self._release = release
        """Called with each dropped copy (module docstring)."""
        self.entries: dict[int, HostEntry[C]] = {}
        self._nbytes = 0
        self._finished: set[int] = set()
        """Ids whose loads finished (well or not) since the last ``take_finished``."""
        self._lock = threading.Lock()
        """Guards ``_nbytes``, ``_finished`` and the entries' ``counted`` (loads settle on the
        loader threads)."""
        self._loader = ThreadPoolExecutor(max_workers=LOAD_THREADS, thread_name_prefix=f"{what}-load")

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self.entries

    def __iter__(self) -> Iterator[int]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, variant_id: int) -> HostEntry[C] | None:
        return self.entries.get(variant_id)

    def load(self, variant_id: int, path: Path, read: Callable[[Path], C], expected_bytes: int) -> None:
        """Starts ``read(path)`` in the background as ``variant_id``'s copy."""
        if variant_id in self.entries:
            raise ValueError(f"{self.what} {variant_id} is already in host memory")
        entry = HostEntry(path, self._loader.submit(read, path), expected_bytes, counted=expected_bytes)
        with self._lock:
            self._nbytes += expected_bytes
        self.entries[variant_id] = entry
        entry.future.add_done_callback(lambda _: self._settle(variant_id, entry))  # at once if done

    def _settle(self, variant_id: int, entry: HostEntry[C]) -> None:
        """A load finished: count the copy's measured bytes instead of the expected ones, and list it
        for ``take_finished`` (idempotent)."""
        f = entry.future
        measured = 0 if f.cancelled() or f.exception() is not None else f.result().nbytes
        with self._lock:
            if not entry.dropped and not entry.settled:
                entry.settled = True
                self._nbytes += measured - entry.counted
                entry.counted = measured
                self._finished.add(variant_id)

    def take_finished(self) -> list[int]:
        """Ids whose loads finished (well or not) since the last call, ascending; a dropped one is
        not listed."""
        with self._lock:
            done, self._finished = self._finished, set()
        return sorted(done)

    def drop(self, variant_id: int) -> None:
        """Frees the copy (a load still running finishes, and its result is dropped)."""
        entry = self.entries.pop(variant_id)
        entry.future.cancel()
        with self._lock:
            self._finished.discard(variant_id)
            entry.dropped = True
            self._nbytes -= entry.counted
            entry.counted = 0
        if self._release is not None:
            release, was_ready = self._release, entry.future.done()

            def give_back(f: Future[C]) -> None:  # at once if done, else on the loader thread
                if not f.cancelled() and f.exception() is None:
                    release(f.result(), was_ready)

            entry.future.add_done_callback(give_back)

    @property
    def nbytes(self) -> int:
        """Bytes of the copies held: finished ones measured, running loads as expected."""
        return self._nbytes

    def ready(self, variant_id: int) -> C | None:
        """The copy if its load has finished well, else None (no waiting)."""
        entry = self.entries.get(variant_id)
        if entry is None or not entry.future.done() or entry.future.cancelled() or entry.future.exception():
            return None
        return entry.future.result()

    def wait(self, variant_id: int) -> C:
        """The copy, after its load finishes (and is counted); AdapterLoadError if the load failed."""
        entry = self.entries[variant_id]
        try:
            entry.future.exception()  # waits; the done callback may not have run yet
            self._settle(variant_id, entry)
            return entry.future.result()
        except Exception as e:  # noqa: BLE001 - any load failure means the same to the router
            raise AdapterLoadError(
                f"{self.what} {variant_id}: loading {entry.path} into host memory failed: {e}"
            ) from e

    def close(self) -> None:
        """Stops the loader threads (running loads finish)."""
        self._loader.shutdown(wait=False, cancel_futures=True)
