"""bench/step_breakdown.py on a hand-made recording: each step gets its kind, a slow eager launch is
charged to the eager step rather than to the decode step whose output it delayed, the run's total
is kept, and a recording without floors reports none."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.step_breakdown import breakdown, decode_groups, kind_of, main, own_seconds, read_recording


def _step(step_id, sent, busy_ms, launch, new=(), running=(), ops=(), graph=True, floor_us=None):
    timing = {"gap_us": 0, "forward_us": 0, "total_us": int(busy_ms * 1e3), "busy_us": int(busy_ms * 1e3)}
    if floor_us is not None:
        timing["floor_us"] = floor_us
    return {"step_id": step_id, "sent": sent, "launch": list(launch), "new": [list(n) for n in new],
            "running": [list(r) for r in running], "ops": [list(o) for o in ops], "graph": graph,
            "timing": timing, "device_s": busy_ms / 1e3}  # fmt: skip


def _run(floors: bool):
    f = 100 if floors else None
    # Decode step 1 (graph) is in flight when eager step 2 launches for 0.5 s, so step 1's output
    # leaves at 0.52 s: its busy time (0.51 s) holds step 2's launch, step 2's (0.02 s) does not.
    return [
        _step(1, 0.52, 510, (0.00, 0.01), running=[(1, 1)], floor_us=f),
        _step(2, 0.54, 20, (0.011, 0.511), new=[(2, 40, 0, 40, 1)], running=[(1, 1)], graph=False, floor_us=f),
        _step(3, 0.60, 50, (0.55, 0.551), new=[(3, 8, 0, 8, 2)], ops=[(2, 1, 1)], floor_us=f),
        _step(4, 0.61, 10, (0.60, 0.601), new=[(4, 8, 0, 8, 0)], floor_us=f),
        _step(5, 0.62, 10, (0.61, 0.611), running=[(1, 1), (4, 1)], graph=False, floor_us=f),
    ]


def test_kinds() -> None:
    assert [kind_of(s) for s in _run(True)] == ["decode (graph)", "eager", "loads", "mixed", "decode (eager)"]


def test_a_slow_eager_launch_is_charged_to_the_eager_step() -> None:
    steps = _run(True)
    own = own_seconds(steps)
    assert own[0] == pytest.approx(0.51 - 0.5)
    assert own[1] == pytest.approx(0.02 + 0.5)
    assert sum(own) == pytest.approx(sum(s["timing"]["busy_us"] for s in steps) / 1e6)
    result = breakdown(steps, top=1)
    assert result["slowest"][0]["step_id"] == 2
    assert result["kinds"]["eager"]["own_over_floor"] == pytest.approx(0.52 / 100e-6)
    assert result["floor_s"] == pytest.approx(5 * 100e-6)


def test_a_recording_without_floors_reports_none(tmp_path) -> None:
    path = tmp_path / "steps.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for s in reversed(_run(False)):  # read back in the order the worker sent them
            f.write(json.dumps(s) + "\n")
    steps = read_recording(path)
    assert [s["step_id"] for s in steps] == [1, 2, 3, 4, 5]
    result = breakdown(steps)
    assert result["floor_s"] is None
    assert all("floor_s" not in r and r["own_over_floor"] is None for r in result["kinds"].values())
    with pytest.raises(SystemExit):
        main([str(path), "--out", str(tmp_path)])  # a result file must say where the recording came from


def test_decode_groups_by_batch_and_variants() -> None:
    """Decode graph steps grouped by batch bin and by the variants besides the base their rows run (known from
    the steps that admitted them); eager decodes, prompt steps and rows never admitted in the recording are
    left out; medians of device span and floor, and the group's Σ device ÷ Σ floor."""
    admit = _step(1, 0.1, 10, (0.0, 0.001), new=[(1, 8, 0, 8, 3), (2, 8, 0, 8, 0), (3, 8, 0, 8, 3), (4, 8, 0, 8, 5)])
    steps = [
        admit,
        _step(2, 0.2, 4, (0.1, 0.101), running=[(1, 1), (2, 1)], floor_us=2000),  # batch 2, variant 3 only
        _step(3, 0.3, 6, (0.2, 0.201), running=[(1, 1), (3, 1)], floor_us=2000),  # batch 2, variant 3 only
        _step(4, 0.4, 9, (0.3, 0.301), running=[(1, 1), (2, 1), (3, 1), (4, 1)], floor_us=3000),  # batch 4: 3, 5
        _step(5, 0.5, 9, (0.4, 0.401), running=[(1, 1), (4, 1)], graph=False, floor_us=3000),  # eager: out
        _step(6, 0.6, 9, (0.5, 0.501), running=[(1, 1), (9, 1)], floor_us=3000),  # row 9 never admitted: out
    ]
    groups = decode_groups(steps)
    assert [(g["batch"], g["variants"], g["steps"]) for g in groups] == [("1-3", 1, 2), ("4-7", 2, 1)]
    assert groups[0]["device_ms_p50"] == pytest.approx(5.0) and groups[0]["floor_ms_p50"] == pytest.approx(2.0)
    assert groups[0]["device_over_floor"] == pytest.approx(10 / 4)
    assert breakdown(steps)["decode_groups"] == groups
