"""The whole serving-benchmark pipeline (bench/serving smoke) on the CPU demo model: random
PEFT adapters of the demo model's shape served with --lora-dir, a tiny trace replayed over SSE and
WebSocket, every request answered with exactly its forced output length, a result file written
with the daemon's metrics over each point."""

from __future__ import annotations

import json
import os

from bench import serving

from .daemon import daemon_binary


def test_smoke_experiment_end_to_end(tmp_path):
    devices = os.environ.get("DELTASERVE_TEST_DEVICES", "cpu")
    path = serving.main(["smoke", "--daemon", str(daemon_binary()), "--devices", devices, "--out-dir", str(tmp_path),
                         "--no-plots"])  # fmt: skip
    assert path is not None and path.parent == tmp_path and path.name.startswith("smoke-")
    result = json.loads(path.read_text())
    assert result["server"] == "deltaserve" and result["model"] == "demo" and result["adapters"] == 3
    assert [p["protocol"] for p in result["points"]] == ["sse", "ws"]
    for point in result["points"]:
        rows = point["requests"]
        assert len(rows) == point["summary"]["requests"] == 6
        for r in rows:
            assert r["error"] is None, (point["label"], r, (tmp_path / "smoke-server.log").read_text()[-3000:])
            assert r["n_out"] == r["output_len"] and 4 <= r["n_out"] <= 12  # ignore_eos + max_tokens, U[4, 12]
            assert 0 < r["ttft"] <= r["e2e"]
        s = point["summary"]
        assert s["completed"] == 6 and s["output_len_mismatch"] == 0
        assert s["output_tokens"] == sum(r["output_len"] for r in rows)
        assert s["throughput_req_s"] > 0 and s["slo"]["ttft_s"] == 6.0
        assert {r["variant"] for r in rows} <= {"a0000", "a0001", "a0002"}
        assert point["trace"]["ranks"] == [8, 4]
        m = point["server_metrics"]  # the daemon's /metrics over the point: counters as increases
        assert m["deltaserve_requests_finished_total"] == 6 and m["deltaserve_steps_total"] > 0
        assert m["deltaserve_tokens_generated_total"] == s["output_tokens"]
        assert m["deltaserve_worker_step_us_total"] >= m["deltaserve_worker_forward_us_total"] > 0
        assert m["deltaserve_worker_floor_us_total"] > 0  # the steps' roofline floors (worker/step_floor.py)
        busy_us, floor_us = m["deltaserve_worker_busy_us_total"], m["deltaserve_worker_floor_us_total"]
        assert 0 < busy_us <= m["deltaserve_worker_step_us_total"]  # a step's own time is within its span
        assert point["served_step_efficiency"] == busy_us / floor_us
        assert point["makespan_per_floor"] == s["makespan_s"] * 1e6 / floor_us


def test_smoke_experiment_records_the_workers_steps(tmp_path):
    """``--record``: the worker's steps land beside the result, and their breakdown adds up to the
    daemon's own counters over the points."""
    devices = os.environ.get("DELTASERVE_TEST_DEVICES", "cpu")
    path = serving.main(["smoke", "--daemon", str(daemon_binary()), "--devices", devices, "--out-dir", str(tmp_path),
                         "--no-plots", "--record", "--suffix=-rec"])  # fmt: skip
    result = json.loads(path.read_text())
    b = result["step_breakdown"]
    assert (tmp_path / b["recording"]).is_file() and b["recording"] == "smoke-rec-steps.jsonl.gz"
    assert not (tmp_path / "smoke-rec-steps.jsonl").exists()
    metrics = [p["server_metrics"] for p in result["points"]]
    assert b["steps"] == sum(m["deltaserve_steps_total"] for m in metrics) > 0
    assert round(b["busy_s"] * 1e6) == sum(m["deltaserve_worker_busy_us_total"] for m in metrics)
    assert round(b["floor_s"] * 1e6) == sum(m["deltaserve_worker_floor_us_total"] for m in metrics)
    assert sum(k["steps"] for k in b["kinds"].values()) == b["steps"]
    assert set(b["kinds"]) <= {"loads", "eager", "mixed", "decode (graph)", "decode (eager)"}
