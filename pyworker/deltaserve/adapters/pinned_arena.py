"""``PinnedArena``: one block of page-locked host memory, pinned once at start-up, that the host copies
of variants (LoRA adapters and deltas) are carved from.

Why: pinning memory (``cudaHostAlloc``) is a slow driver call (tens of ms for an S2 adapter's
64 MB) that stalls the main thread's own driver calls while it runs: every small host-to-device
copy and event record of a step launched meanwhile waits for it (``bench/pinned_alloc_contention.py``).
Under S-LoRA's n ≥ 1000 workloads the host tier pins a fresh copy for nearly every request. With
an arena the loader threads only write into memory pinned before the first request, as vLLM pins
its CPU swap space at start-up.

The memory is an ordinary allocation registered with the driver (``cudaHostRegister``), so its size
is exactly what was asked (torch's pinned allocator rounds up to a power of two). Regions are
4 KiB-aligned, best fit over a free list that coalesces neighbours (``slack_for`` sizes the room
that keeps a host tier filled to its budget from fragmenting it). A region given back may still
be the source of a copy queued on the device, so ``give`` takes the event recorded after the last
such copy, and the region is reused only once that event has completed (``take`` waits for it when
nothing else fits: ``take`` runs on loader threads). ``take`` returns None when no free range is
large enough (full or fragmented); the caller pins a copy on its own then.

Thread-safe: loader threads take, the main thread gives. One arena per worker serves both host
tiers (LoRA adapters and deltas: the router's host budget covers both); ``host_buffer``,
``give_back`` and ``release_hook`` are how the pools use it.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger("deltaserve.worker")

C = TypeVar("C")

ALIGN = 4096
"""Region alignment in bytes (a page: DMA from any region is page-aligned)."""


def slack_for(budget: int) -> int:
    """Bytes to add to a host tier's ``budget`` so copies of mixed sizes, evicted least recently used
    to stay within it, still find contiguous room: an eighth, at least 1 GiB. Simulated over S2's
    sizes (1 : 2 : 4 : 8) with power-law popularity (n = 1000-5000), budgets of 32 to 384 of the
    largest copy never ran out of room with it; without it 1-3 % of reads did
    (``bench/arena_fragmentation.py``)."""
    return max(budget // 8, 1 << 30)


class PinnedArena:
    """``capacity`` bytes of host memory, page-locked when ``pin`` (module docstring)."""

    def __init__(self, capacity: int, *, pin: bool = True, buf: torch.Tensor | None = None) -> None:
        """``buf``: the memory to carve (a uint8 tensor of at least ``capacity`` bytes, e.g. shared
        memory the CPU LoRA helpers map, ``helpers/shm.py``); None allocates it."""
        if capacity <= 0:
            raise ValueError(f"PinnedArena: capacity must be positive, got {capacity}")
        if buf is not None and (buf.dtype != torch.uint8 or buf.numel() < capacity):
            raise ValueError(f"PinnedArena: buf must be a uint8 tensor of >= {capacity} bytes")
        self.capacity = capacity
        self.buf = torch.empty(capacity, dtype=torch.uint8) if buf is None else buf[:capacity]
        self.pinned = False
        if pin:
            err = int(torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), capacity, 0))
            if err != 0:
                raise RuntimeError(f"PinnedArena: cudaHostRegister of {capacity} bytes failed (cudaError {err})")
            self.pinned = True
        self._base = self.buf.data_ptr()
        self._free_starts: list[int] = [0]
        """Offsets of the free ranges, ascending (their sizes in ``_free``)."""
        self._free: dict[int, int] = {0: capacity}
        self._taken: dict[int, int] = {}
        """Offset -> size of every region handed out."""
        self._fenced: deque[tuple[int, int, torch.cuda.Event | None]] = deque()
        """Regions given back whose last copy may still be queued: (offset, size, event), oldest first."""
        self._lock = threading.Lock()
        self._closed = False
        """Closed: ``take`` hands out nothing more."""

    @property
    def free_bytes(self) -> int:
        """Bytes not handed out (fenced regions included)."""
        with self._lock:
            return self.capacity - sum(self._taken.values())

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 view of ``nbytes`` bytes of the arena (contents undefined), or None when no free range
        fits. Waits for the fences of given-back regions when only they could make room."""
        if nbytes <= 0:
            raise ValueError(f"PinnedArena.take: nbytes must be positive, got {nbytes}")
        size = -(-nbytes // ALIGN) * ALIGN
        while not self._closed:
            with self._lock:
                self._reclaim()
                start = self._best_fit(size)
                if start is not None:
                    self._taken[start] = size
                    return self.buf[start : start + nbytes]
                if not self._fenced:
                    return None
                oldest = self._fenced[0][2]
            assert oldest is not None  # fence-less regions are reclaimed at once
            oldest.synchronize()  # outside the lock: ``give`` on the main thread never waits for the device
        return None

    def owns(self, view: torch.Tensor) -> bool:
        """Whether ``view``'s memory starts inside this arena (it may have been taken from it)."""
        return self._base <= view.data_ptr() < self._base + self.capacity

    def give(self, view: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        """Returns the region ``view`` was taken as; ``after``: the event recorded after the last copy
        queued from it (None: no copy can be pending). Raises ValueError for a view this arena did not
        hand out (or one given back already)."""
        start = view.data_ptr() - self._base
        with self._lock:
            size = self._taken.pop(start, None)
            if size is None:
                raise ValueError(f"PinnedArena.give: no region taken at offset {start}")
            self._fenced.append((start, size, after))
            self._reclaim()

    def close(self) -> None:
        """Unregisters the memory after the device's queued work (a copy from it may be pending); the
        arena hands out nothing after, and views still held are plain host memory."""
        self._closed = True
        if self.pinned:
            self.pinned = False
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._base)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
            pass

    def _best_fit(self, size: int) -> int | None:
        """The start of the smallest free range that holds ``size`` bytes (lowest address on ties),
        split off the front of it; None when none does."""
        best, best_have = None, 0
        for start, have in self._free.items():
            if have >= size and (best is None or have < best_have or (have == best_have and start < best)):
                best, best_have = start, have
        if best is None:
            return None
        self._remove_free(best)
        if best_have > size:
            self._add_free(best + size, best_have - size)
        return best

    def _reclaim(self) -> None:
        """Frees the fenced regions whose events completed, oldest first."""
        while self._fenced:
            start, size, event = self._fenced[0]
            if event is not None and not event.query():
                return
            self._fenced.popleft()
            self._release(start, size)

    def _release(self, start: int, size: int) -> None:
        """Adds [start, start + size) to the free list, merged with free neighbours."""
        i = bisect.bisect_left(self._free_starts, start)
        if i < len(self._free_starts):
            nxt = self._free_starts[i]
            if start + size == nxt:
                size += self._free[nxt]
                self._remove_free(nxt)
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free[prev] == start:
                start, size = prev, self._free[prev] + size
                self._remove_free(prev)
        self._add_free(start, size)

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free[start] = size

    def _remove_free(self, start: int) -> None:
        self._free_starts.pop(bisect.bisect_left(self._free_starts, start))
        del self._free[start]


def host_buffer(arena: PinnedArena | None, nbytes: int, *, pin: bool, what: str) -> torch.Tensor:
    """``nbytes`` of host memory (uint8, contents undefined) for a variant's host copy: a region of
    ``arena`` when it has room, else allocated on its own (page-locked when ``pin``). ``what`` names
    the copy in the warning a full or fragmented arena gives."""
    if arena is not None:
        region = arena.take(nbytes)
        if region is not None:
            return region
        log.warning(
            "the pinned host arena (%d bytes) has no room for a %d-byte %s copy: pinning it on its own "
            "(slow, and it stalls the steps launched meanwhile)",
            arena.capacity,
            nbytes,
            what,
        )
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def give_back(arena: PinnedArena | None, view: torch.Tensor, *, may_be_queued: bool, device: torch.device) -> None:
    """Returns ``view``'s region to ``arena`` if it came from there; ``may_be_queued``: copies from it may
    still be queued on ``device`` (an event after them fences the region)."""
    if arena is None or not arena.owns(view):
        return
    fence = None
    if may_be_queued and device.type == "cuda":
        fence = torch.cuda.Event()
        fence.record()
    arena.give(view, fence)


def release_hook(
    arena: PinnedArena | None, device: torch.device, memory_of: Callable[[C], torch.Tensor]
) -> Callable[[C, bool], None]:
    """A ``HostTier`` release hook that gives a dropped copy's memory (``memory_of(copy)``) back to
    ``arena``. It holds the arena and the device, never the pool: a pool (and the KV cache it views)
    stays free of reference cycles, so a dropped executor gives its device memory back at once."""

    def release(copy: C, may_be_queued: bool) -> None:
        give_back(arena, memory_of(copy), may_be_queued=may_be_queued, device=device)

    return release


__all__ = ["ALIGN", "PinnedArena", "give_back", "host_buffer", "release_hook", "slack_for"]
