"""``PinnedArena``: regions are aligned, disjoint and coalesced when given back; a full or fragmented
arena says so (None) instead of overlapping; a region given back behind an unfinished copy is
reused only after that copy's fence; bad give-backs are refused and change nothing. CPU (unpinned);
the pinned arena's copies run in ``tests/worker/test_host_to_device.py`` (GPU)."""

from __future__ import annotations

import threading

import pytest
import torch

from deltaserve.adapters.pinned_arena import ALIGN, PinnedArena, slack_for

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU


class Fence:
    """Stands in for a ``torch.cuda.Event``: done once ``finish`` is called."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = False

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waited = True
        assert self.done.wait(10), "a fence nobody finishes"

    def finish(self) -> None:
        self.done.set()


def offset(arena: PinnedArena, view: torch.Tensor) -> int:
    return view.data_ptr() - arena.buf.data_ptr()


def test_regions_are_aligned_disjoint_and_coalesce() -> None:
    arena = PinnedArena(16 * ALIGN, pin=False)
    a, b, c = arena.take(1), arena.take(ALIGN + 1), arena.take(3 * ALIGN)
    assert [offset(arena, v) for v in (a, b, c)] == [0, ALIGN, 3 * ALIGN]
    assert [v.numel() for v in (a, b, c)] == [1, ALIGN + 1, 3 * ALIGN]
    assert arena.free_bytes == 10 * ALIGN
    for v, fill in ((a, 1), (b, 2), (c, 3)):
        v.fill_(fill)
    assert a.eq(1).all() and b.eq(2).all() and c.eq(3).all(), "regions overlap"
    arena.give(b)
    d = arena.take(2 * ALIGN)  # best fit: b's hole, not the tail
    assert offset(arena, d) == ALIGN
    arena.give(a)
    arena.give(d)
    arena.give(c)
    assert arena.free_bytes == 16 * ALIGN
    whole = arena.take(16 * ALIGN)  # every range merged back into one
    assert whole is not None and offset(arena, whole) == 0


def test_best_fit_keeps_large_ranges_for_large_copies() -> None:
    """A small copy goes into the smallest hole that holds it, not the first: the large hole stays
    whole for a large copy (first fit would split it and refuse the large one)."""
    arena = PinnedArena(10 * ALIGN, pin=False)
    views = [arena.take(n * ALIGN) for n in (3, 1, 2, 4)]  # [0,3) [3,4) [4,6) [6,10)
    arena.give(views[0])  # hole of 3 at 0
    arena.give(views[2])  # hole of 2 at 4
    small = arena.take(2 * ALIGN)
    assert offset(arena, small) == 4 * ALIGN
    large = arena.take(3 * ALIGN)
    assert large is not None and offset(arena, large) == 0


def test_slack_is_an_eighth_at_least_a_gib() -> None:
    assert slack_for(1 << 30) == 1 << 30
    assert slack_for(48 << 30) == 6 << 30


def test_full_or_fragmented_arena_returns_none() -> None:
    arena = PinnedArena(4 * ALIGN, pin=False)
    views = [arena.take(ALIGN) for _ in range(4)]
    assert arena.take(1) is None, "full"
    arena.give(views[0])
    arena.give(views[2])
    assert arena.free_bytes == 2 * ALIGN
    assert arena.take(2 * ALIGN) is None, "two free pages, not adjacent"
    assert arena.take(ALIGN) is not None


def test_fenced_region_is_reused_only_after_its_fence() -> None:
    arena = PinnedArena(2 * ALIGN, pin=False)
    a, b = arena.take(ALIGN), arena.take(ALIGN)
    late, done = Fence(), Fence()
    done.finish()
    arena.give(a, late)  # a copy from ``a`` may still be queued
    arena.give(b, done)
    # ``b`` is behind ``a`` in the fence queue: neither is free while ``a``'s copy runs.
    got: list[torch.Tensor | None] = []
    t = threading.Thread(target=lambda: got.append(arena.take(ALIGN)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got, "took a region whose copy may still run"
    assert late.waited, "take waits for the oldest fence when nothing else fits"
    late.finish()
    t.join(10)
    assert got and got[0] is not None and offset(arena, got[0]) == 0


def test_give_while_a_loader_waits_on_a_fence_does_not_block() -> None:
    arena = PinnedArena(2 * ALIGN, pin=False)
    a, b = arena.take(ALIGN), arena.take(ALIGN)
    late = Fence()
    arena.give(a, late)
    t = threading.Thread(target=lambda: arena.take(2 * ALIGN))
    t.start()
    t.join(0.2)
    assert t.is_alive()
    gave = threading.Thread(target=lambda: arena.give(b))
    gave.start()
    gave.join(5)
    assert not gave.is_alive(), "give blocked behind a loader waiting for the device"
    late.finish()
    t.join(10)
    assert not t.is_alive()


def test_bad_give_backs_and_sizes_are_refused_and_change_nothing() -> None:
    arena = PinnedArena(4 * ALIGN, pin=False)
    a = arena.take(ALIGN)
    with pytest.raises(ValueError, match="no region taken at offset"):
        arena.give(arena.buf[ALIGN:])  # never taken
    with pytest.raises(ValueError, match="no region taken at offset"):
        arena.give(torch.empty(8, dtype=torch.uint8))  # not the arena's memory
    assert arena.free_bytes == 3 * ALIGN
    arena.give(a)
    with pytest.raises(ValueError, match="no region taken at offset 0"):
        arena.give(a)  # twice
    assert arena.free_bytes == 4 * ALIGN
    with pytest.raises(ValueError, match="nbytes must be positive"):
        arena.take(0)
    with pytest.raises(ValueError, match="capacity must be positive"):
        PinnedArena(0, pin=False)
    assert arena.owns(arena.buf[5:]) and not arena.owns(torch.empty(1))
    arena.close()
    assert arena.take(ALIGN) is None, "a closed arena hands out nothing"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make test-gpu)")
def test_pinned_regions_copy_asynchronously_and_wait_for_their_fence() -> None:
    """On CUDA the arena is page-locked (an asynchronous copy from it queues behind a busy stream) and
    a region given back behind a queued copy is refilled only after that copy ran, so the device
    receives what was in the region when the copy was queued."""
    dev = torch.device("cuda")
    arena = PinnedArena(8 << 20)
    try:
        assert arena.pinned and arena.buf.is_pinned()
        src = arena.take(4 << 20)
        assert src is not None
        src.fill_(7)
        torch.cuda._sleep(200_000_000)  # keep the stream busy: the copy below stays queued
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=dev)
        dst.copy_(src, non_blocking=True)
        fence = torch.cuda.Event()
        fence.record()
        assert not fence.query(), "the copy did not queue behind the busy stream (not pinned?)"
        arena.give(src, fence)
        again = arena.take(8 << 20)  # only fits over ``src``: waits for the fence
        assert again is not None and fence.query()
        again.fill_(1)
        assert bool(dst.eq(7).all()), "the region was refilled before its queued copy ran"
    finally:
        torch.cuda.synchronize()
        arena.close()
