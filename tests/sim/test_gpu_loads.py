"""Delta loads beside the steps in the simulator (``SchedulerConfig.gpu_load_reports``,
router/crates/py/src/sim_loop.rs): with the daemon's reports a delta's copy to the GPU runs on the
worker's load stream while other requests' steps go on, and its requests are admitted once it is
reported; and what a worker recording says of them (``gpu_ready``, deltaserve.sim.record). Small
traces: well under a second each."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deltaserve import _native, sim
from deltaserve.sim.record import (
    copies_beside,
    copy_waits,
    reports_gpu_loads,
    steps_to_samples,
    transfer_bandwidths,
)
from deltaserve.sim.trace import from_requests


def test_gpu_load_reports_is_a_config_field_the_daemon_config_turns_on():
    cfg = _native.SchedulerConfig(16, 64, 512)
    assert cfg.gpu_load_reports is False and cfg.as_dict()["gpu_load_reports"] is False
    assert "gpu_load_reports=False" in repr(cfg)
    cfg.gpu_load_reports = True
    assert cfg.gpu_load_reports is True and cfg.as_dict()["gpu_load_reports"] is True
    assert "gpu_load_reports=True" in repr(cfg)
    assert cfg != _native.SchedulerConfig(16, 64, 512), "the field takes part in equality"
    cfg.validate()
    daemon = sim.daemon_config(sim.default_model())
    assert daemon.host_copy_reports and daemon.gpu_load_reports


def test_delta_graph_tokens_is_a_config_field_the_daemon_config_takes_from_the_model():
    cfg = _native.SchedulerConfig(16, 64, 512)
    assert cfg.delta_graph_tokens == 0 and cfg.as_dict()["delta_graph_tokens"] == 0
    cfg.delta_graph_tokens = 512
    assert cfg.as_dict()["delta_graph_tokens"] == 512 and "delta_graph_tokens=512" in repr(cfg)
    assert cfg != _native.SchedulerConfig(16, 64, 512), "the field takes part in equality"
    cfg.validate()
    assert sim.daemon_config(sim.default_model()).delta_graph_tokens == 0, "its model replays no delta step"
    model = dataclasses.replace(sim.default_model(), graph_max_delta_tokens=384)
    assert sim.daemon_config(model).delta_graph_tokens == 384


def long_request_and_a_delta() -> sim.SimTrace:
    """A base request decoding for ~5 s and, from 0.5 s, a request of a delta (3.4 GB: read ~2.2 s,
    copied ~0.125 s on the bundled model) that is read and loaded while the first runs."""
    return from_requests([{"t": 0.0, "prompt_len": 64, "output_len": 1000},
                          {"t": 0.5, "variant": "d0", "prompt_len": 64, "output_len": 16}],
                         [{"name": "d0", "kind": "full"}])  # fmt: skip


def test_a_delta_copies_beside_the_running_requests_steps_with_gpu_load_reports():
    trace = long_request_and_a_delta()
    model = sim.default_model()
    copy_s = model.memory.delta_bytes / model.host_to_gpu_bps["delta"]
    runs = {}
    for reports in (False, True):
        cfg = sim.daemon_config(model)
        cfg.gpu_load_reports = reports
        runs[reports] = sim.replay(trace, cfg, model, record_steps=True)
        assert runs[reports].completed.all() and list(runs[reports].output_tokens) == [1000, 16]
    off, on = runs[False], runs[True]
    longest = {r: max(end - start for _w, _id, _ahead, start, end, *_ in runs[r].steps) for r in runs}
    assert longest[False] > copy_s, "the step that admits the delta's request holds the copy"
    assert longest[True] < copy_s / 10, "no step holds it: it runs on the load stream"
    # The copy goes out where the read is reported, as the admission without reports; the request
    # is admitted once the copy is reported, and the base request is not held up meanwhile.
    assert on.scheduled_s[1] >= off.scheduled_s[1] + copy_s
    assert on.finish_s[0] < off.finish_s[0] - copy_s / 2
    assert on.counters["gpu_load_deferrals"] > 0 and off.counters["gpu_load_deferrals"] == 0
    assert on.busy_s[0] < off.busy_s[0] - copy_s / 2, "the copy is not the device's busy time"
    assert sim.replay(trace, record_steps=True).steps == on.steps, "the daemon's config has the reports"


MB = 1_000_000


def recording(gpu_ready: bool = True) -> list[dict]:
    """Nine steps of a worker with reports (``gpu_ready``; without: as recorded before the field): delta
    3 loaded ahead of its request while request 1 runs, delta 4 loaded ahead but its request admitted
    before the report (nothing else ran: the step waited for the rest), delta 3 again dropped and
    loaded with its request in an idle worker (the step holds the copy: 6 ms beyond the 0.5 ms
    outside the forward of steps without ops)."""

    def step(recv, sent, new=(), running=(), ops=(), host=(), gpu=(), outside_us=500):
        s = {"recv": recv, "sent": sent, "new": [list(n) for n in new], "running": [list(r) for r in running],
             "released": [], "ops": list(ops), "host_ready": list(host),
             "timing": {"gap_us": 0, "forward_us": 1000, "total_us": 1000 + outside_us}}  # fmt: skip
        if gpu_ready:
            s["gpu_ready"] = list(gpu)
        return s

    return [
        step(0.000, 0.002, running=[(1, 1)], ops=[[3, 0, 1], [4, 0, 1]]),
        step(0.002, 0.004, running=[(1, 1)], host=[3, 4]),
        step(0.004, 0.006, running=[(1, 1)], ops=[[3, 1, 1]], outside_us=600),  # its launch, 0.1 ms
        step(0.006, 0.008, running=[(1, 1)], gpu=[3]),
        step(0.008, 0.010, new=[(2, 4, 0, 4, 3)], running=[(1, 1)]),
        step(0.010, 0.012, running=[(2, 1)], ops=[[4, 1, 1]]),
        step(0.012, 0.030, new=[(5, 4, 0, 4, 4)], outside_us=17000),
        step(0.030, 0.032, running=[(5, 1)], gpu=[4]),
        step(0.032, 0.040, new=[(6, 4, 0, 4, 3)], ops=[[3, 2, 1], [3, 1, 1]], outside_us=6500),
    ]


def test_a_recording_with_gpu_ready_keeps_delta_copies_beside_the_steps_out_of_step_times():
    steps, old = recording(), recording(gpu_ready=False)
    deltas = {3, 4}
    assert reports_gpu_loads(steps) and not reports_gpu_loads(old)
    assert [sorted(copies_beside(s, deltas)) for s in steps] == [[], [], [3], [], [], [4], [], [], []]
    assert copy_waits(steps, deltas) == [False] * 6 + [True, False, False], "request 5 came before 4's report"
    assert copy_waits(old, deltas) == [False] * 9
    variants = {3: ("delta", 100 * MB), 4: ("delta", 100 * MB)}
    # Only the copy inside its step measures: 100 MB in 6 ms. Read as before the field, the load
    # ahead's 0.1 ms of launch would count as a copy at 1 TB/s.
    assert transfer_bandwidths(steps, variants)["host_to_gpu_bps"] == {"delta": pytest.approx(100 * MB / 0.006)}
    was = transfer_bandwidths(old, variants)["host_to_gpu_bps"]["delta"]
    assert was == pytest.approx(np.median([100 * MB / 0.0001, 100 * MB / 0.006]))
    # Fit samples leave out the steps with copies, and the one that waited for 4's.
    assert len(steps_to_samples(steps, ranks={}, deltas=deltas)) == 5
    assert len(steps_to_samples(old, ranks={}, deltas=deltas)) == 6
