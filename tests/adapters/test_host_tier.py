"""``HostTier``'s byte count (what the worker reports after every step as its host tier) follows
loads as they start, finish, fail and are dropped, while they run on the loader threads; and the
finished loads it lists for ``StepOutput.host_ready``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from deltaserve.adapters.host_tier import AdapterLoadError, HostTier


@dataclass
class Copy:
    nbytes: int


def gated_read(gates: dict[int, threading.Event], fails: int, nbytes) -> Callable[[Path], Copy]:
    """A read of path ``i`` that waits for ``gates[i]``, then fails (``i == fails``) or returns a copy of
    ``nbytes(i)`` bytes."""

    def read(path: Path) -> Copy:
        i = int(path.name)
        gates[i].wait(10)
        if i == fails:
            raise OSError("gone")
        return Copy(nbytes=nbytes(i))

    return read


def test_bytes_follow_loads_through_their_lifetime() -> None:
    tier: HostTier[Copy] = HostTier("adapter")
    gates = {i: threading.Event() for i in range(4)}

    read = gated_read(gates, fails=2, nbytes=lambda i: 1000 * (i + 1))

    for i in range(4):
        tier.load(i, Path(str(i)), read, expected_bytes=100)
    assert tier.nbytes == 400, "running loads count as expected"
    gates[0].set()
    assert tier.wait(0).nbytes == 1000
    assert tier.nbytes == 1000 + 300, "a finished load counts what it measured"
    gates[2].set()
    with pytest.raises(AdapterLoadError, match="adapter 2: loading 2 into host memory failed: gone"):
        tier.wait(2)
    assert tier.nbytes == 1000 + 200, "a failed load counts nothing"
    tier.drop(3)  # dropped while its load runs: counts nothing, now and when it finishes
    assert tier.nbytes == 1000 + 100
    gates[3].set()
    gates[1].set()
    assert tier.wait(1).nbytes == 2000
    assert tier.nbytes == 3000
    tier.drop(0)
    tier.drop(1)
    tier.drop(2)
    assert tier.nbytes == 0 and len(tier) == 0
    with pytest.raises(ValueError, match="adapter 5 is already in host memory"):
        tier.load(5, Path("5"), lambda p: Copy(1), 1)
        tier.load(5, Path("5"), lambda p: Copy(1), 1)
    tier.close()


def test_finished_reads_are_listed_once_until_taken() -> None:
    """``take_finished`` is what a ``StepOutput`` reports as ``host_ready``: every load that finished
    since the last call (failed ones too: the ``to_gpu`` reports those), never a dropped one."""
    tier: HostTier[Copy] = HostTier("delta")
    gates = {i: threading.Event() for i in range(4)}

    read = gated_read(gates, fails=1, nbytes=lambda i: 10)

    for i in (3, 0, 1, 2):
        tier.load(i, Path(str(i)), read, expected_bytes=10)
    assert tier.take_finished() == [], "nothing has finished"
    for i in (0, 1, 3):
        gates[i].set()
    tier.wait(0)
    tier.wait(3)
    with pytest.raises(AdapterLoadError):
        tier.wait(1)
    assert tier.take_finished() == [0, 1, 3]
    tier.wait(0)  # waiting again (a later to_gpu) lists nothing again
    assert tier.take_finished() == [], "each finish is listed once"
    tier.drop(2)
    gates[2].set()
    tier.get(0)  # still there
    assert tier.take_finished() == [], "a dropped load is never listed"
    # A load that finishes on its own (no wait) is listed by its done callback.
    tier.load(7, Path("7"), lambda p: Copy(5), 5)
    entry = tier.get(7)
    assert entry is not None and entry.future.result().nbytes == 5
    for _ in range(1000):  # the callback runs on the loader thread just after the result is set
        if done := tier.take_finished():
            break
        threading.Event().wait(0.001)
    assert done == [7]
    tier.close()


def test_dropped_copies_are_released_once_their_load_finished_well() -> None:
    """``release`` gets each dropped copy back: at once, flagged as possibly read by queued copies,
    when it was ready; when its load finishes, unflagged, when it was still loading; never for a
    failed load or one that is kept."""
    released: list[tuple[int, bool]] = []
    tier: HostTier[Copy] = HostTier("adapter", release=lambda c, queued: released.append((c.nbytes, queued)))
    gates = {i: threading.Event() for i in range(4)}

    read = gated_read(gates, fails=2, nbytes=lambda i: i)

    for i in range(4):
        tier.load(i, Path(str(i)), read, expected_bytes=1)
    gates[0].set()
    tier.wait(0)
    tier.drop(0)
    assert released == [(0, True)], "a ready copy comes back at once, maybe still being uploaded"
    tier.drop(1)  # still loading
    assert released == [(0, True)]
    gates[1].set()
    for _ in range(1000):
        if len(released) == 2:
            break
        threading.Event().wait(0.001)
    assert released == [(0, True), (1, False)], "a load dropped while running comes back when it ends"
    gates[2].set()
    with pytest.raises(AdapterLoadError):
        tier.wait(2)
    tier.drop(2)
    gates[3].set()
    tier.wait(3)
    assert released == [(0, True), (1, False)], "a failed load has nothing to give back; a kept one stays"
    tier.close()
