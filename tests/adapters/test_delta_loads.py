"""``DeltaLoads`` (``adapters/delta_loads.py``): a delta's ``to_gpu`` work run beside the steps on one
loader thread, reported ready only once it ran, waited for by the steps that use it, its failure kept
for each of them, and excluded while a CUDA graph is captured (``LAUNCH_LOCK``). On the CPU the
thread is the same; there is no stream, so "finished" is the thread's work done."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from deltaserve.adapters.delta_loads import LAUNCH_LOCK, SWITCH_INTERVAL_S, DeltaLoadError, DeltaLoads

CPU = torch.device("cpu")


@pytest.fixture
def loads():
    loads = DeltaLoads(CPU, threaded=True)
    yield loads
    loads.close()


def gated(done: list[int], delta_id: int) -> tuple[threading.Event, object]:
    """A load's work that waits for its gate, then notes ``delta_id`` in ``done``."""
    gate = threading.Event()

    def work() -> None:
        assert gate.wait(timeout=30), "the test never opened the gate"
        done.append(delta_id)

    return gate, work


def test_without_a_thread_the_work_runs_at_once_and_is_reported_next() -> None:
    loads, done = DeltaLoads(CPU), []
    assert not loads.threaded  # the CPU worker's default
    loads.start(4, lambda: done.append(4))
    assert done == [4] and not loads.loading(4)
    assert loads.take_ready() == [4]
    assert loads.take_ready() == []


def test_a_load_is_reported_only_after_its_work_ran(loads: DeltaLoads) -> None:
    done: list[int] = []
    gate, work = gated(done, 7)
    loads.start(7, work)
    assert loads.loading(7)
    assert loads.take_ready() == [], "reported before its work ran"
    gate.set()
    loads.wait([7, 99])  # 99 is not loading: ignored
    assert done == [7]
    assert loads.take_ready() == [7]
    assert not loads.loading(7) and loads.take_ready() == []


def test_loads_run_in_order_on_one_thread(loads: DeltaLoads) -> None:
    done: list[int] = []
    first_gate, first = gated(done, 1)
    loads.start(1, first)
    loads.start(2, lambda: done.append(2))
    loads.start(3, lambda: done.append(3))
    assert loads.take_ready() == []
    first_gate.set()
    loads.wait([3])
    assert done == [1, 2, 3]  # one stream of work: a later load never overtakes an earlier one
    assert sorted(loads.take_ready()) == [1, 2, 3]


def test_a_failed_load_fails_every_step_that_uses_it_until_forgotten(loads: DeltaLoads) -> None:
    def broken() -> None:
        raise ValueError("slot arena gone")

    loads.start(5, broken)
    for _ in range(2):
        with pytest.raises(DeltaLoadError, match=r"delta 5: its copy to the GPU failed .*slot arena gone"):
            loads.wait([5])
    assert loads.take_ready() == [5], "a failed load is reported too (the step that needs it says why)"
    assert loads.loading(5)
    loads.forget(5)  # drop_gpu
    assert not loads.loading(5)
    loads.wait([5])
    loads.start(5, lambda: None)  # loaded again
    loads.wait([5])


def test_forget_and_the_host_fence_wait_for_the_launches(loads: DeltaLoads) -> None:
    done: list[int] = []
    gate, work = gated(done, 8)
    loads.start(8, work)
    threading.Timer(0.05, gate.set).start()
    with loads.host_fence(8):  # drop_host: the copy's memory is given back after the launches
        assert done == [8]
    gate2, work2 = gated(done, 9)
    loads.start(9, work2)
    threading.Timer(0.05, gate2.set).start()
    loads.forget(9)  # drop_gpu
    assert done == [8, 9] and not loads.loading(9)


def test_after_all_waits_for_every_running_load_but_raises_for_none(loads: DeltaLoads) -> None:
    done: list[int] = []
    gate, work = gated(done, 1)
    loads.start(1, work)
    loads.start(2, lambda: (_ for _ in ()).throw(OSError("bad")))
    threading.Timer(0.05, gate.set).start()
    loads.after_all()  # a copy made in place: every load beside the steps is launched before it
    assert done == [1]
    with pytest.raises(DeltaLoadError):
        loads.wait([2])


def test_no_load_launches_while_a_graph_is_captured(loads: DeltaLoads) -> None:
    done: list[int] = []
    with LAUNCH_LOCK:  # what a capture holds (worker/cuda_graphs.py, worker/mixed_graphs.py)
        loads.start(3, lambda: done.append(3))
        threading.Event().wait(0.1)
        assert done == [] and loads.take_ready() == []
    loads.wait([3])
    assert done == [3]


def test_the_step_thread_gets_the_interpreter_back_quickly_while_a_load_launches(loads: DeltaLoads) -> None:
    seen: list[float] = []
    before = sys.getswitchinterval()
    loads.start(4, lambda: seen.append(sys.getswitchinterval()))
    loads.wait([4])
    assert seen == [min(before, SWITCH_INTERVAL_S)]
    assert sys.getswitchinterval() == before, "restored after the launches"
