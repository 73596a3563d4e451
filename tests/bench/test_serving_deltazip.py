"""The DeltaZip-analogue serving experiment (bench/serving deltazip) end to end on the CPU: its
smoke version served by the real daemon (4 compressed deltas of the tiny smoke-llama base, 2 GPU
slots) and by the whole-model swapping baseline (4 full checkpoints, 2 resident), one after the
other on the same files (``--server deltaserve,swap``). Every point of both result files must be
there with every request answered at its forced length; the probe after the points must show
four different logprob sequences through the daemon (the deltas are applied, each its own).
Also: the experiment's documented defaults, flag merging, and refusals of bad input."""

from __future__ import annotations

import json
import os

import pytest

from bench import serving
from bench import workload as wl
from bench.common import SHAPES, SMOKE_SHAPE
from bench.serving import variants

VARIANTS = {f"ft{i:02d}" for i in range(4)}
"""The smoke experiment's variants (workload.deltazip names)."""


def test_deltazip_smoke_through_deltaserve_and_swap(tmp_path):
    from e2e.daemon import daemon_binary

    devices = os.environ.get("DELTASERVE_TEST_DEVICES", "cpu")
    work = tmp_path / "work"
    first = serving.main(["deltazip", "--smoke", "--server", "deltaserve,swap", "--daemon", str(daemon_binary()),
                          "--devices", devices, "--out-dir", str(tmp_path), "--work-dir", str(work), "--no-plots"])  # fmt: skip
    assert first is not None and first.name.startswith("deltazip-smoke-deltaserve-")
    results = {
        res["server"]: res for res in (json.loads(f.read_text()) for f in tmp_path.glob("deltazip-smoke-*.json"))
    }
    assert set(results) == {"deltaserve", "swap"}

    labels = [p.label for p in serving.experiment("deltazip", smoke=True).points]
    assert len(labels) == 4  # zipf-1.5 and uniform, two rates each
    for server, res in results.items():
        log = (tmp_path / f"deltazip-smoke-{server}-server.log").read_text(errors="replace")[-3000:]
        assert res["complete"] is True and res["model"] == SMOKE_SHAPE and res["adapters"] == 4
        assert [p["label"] for p in res["points"]] == labels
        for point in res["points"]:
            s, rows = point["summary"], point["requests"]
            assert point["trace"]["kind"] == "deltazip" and point["trace"]["n_variants"] == 4
            assert s["requests"] == s["completed"] == len(rows) == 4, (server, point["label"], s["errors"], log)
            assert s["failed"] == 0 and s["output_len_mismatch"] == 0 and s["throughput_req_s"] > 0
            assert s["e2e_s"]["mean"] > 0
            for r in rows:
                assert r["error"] is None and r["variant"] in VARIANTS and r["n_out"] == r["output_len"], (server, r)
        probe = res["probe"]
        assert probe["errors"] == {} and set(probe["outputs"]) == VARIANTS, (server, probe, log)
    assert results["deltaserve"]["server_flags"] == ["--max-deltas", "2"]
    assert results["swap"]["server_flags"] == ["--resident", "2"]
    # Four different deltas: four different logprob sequences for one prompt (unapplied deltas would
    # give the base's four times).
    probe = results["deltaserve"]["probe"]
    assert set(probe["token_logprobs"]) == VARIANTS and probe["distinct_logprobs"] == 4, probe

    # Each delta is its own directory (own manifest) whose payload is a link to a shared file;
    # each swap variant is a link to a full checkpoint directory.
    shape_dir = work / SMOKE_SHAPE
    for name in VARIANTS:
        d = shape_dir / "deltazip-deltaserve" / name
        assert (d / "manifest.json").is_file() and not (d / "manifest.json").is_symlink()
        payload = d / "delta.safetensors"
        assert payload.is_symlink() and payload.resolve().parent.parent.name == "delta-payloads-4bit-2of4"
        m = shape_dir / "deltazip-swap" / name
        assert m.is_symlink() and (m / "config.json").is_file() and list(m.glob("*.safetensors"))
    # The disk-space estimate used before writing 7B files matches what was written.
    full_est, delta_est = variants.checkpoint_bytes(SHAPES[SMOKE_SHAPE])
    delta_real = (shape_dir / "delta-payloads-4bit-2of4" / "w0" / "delta.safetensors").stat().st_size
    full_real = sum(f.stat().st_size for f in (shape_dir / "base").glob("*.safetensors"))
    assert 0.9 < delta_real / delta_est < 1.1 and 0.9 < full_real / full_est < 1.1, (delta_real, delta_est)


def test_deltazip_defaults_are_the_documented_ones():
    exp = serving.experiment("deltazip")
    assert exp.shape == "llama-2-7b" and exp.probe_variants == 4
    assert [(p.trace["popularity"], p.trace["rate"]) for p in exp.points] == [
        ("zipf-1.5", 0.5), ("zipf-1.5", 1.0), ("uniform", 0.5), ("uniform", 1.0)]  # fmt: skip
    for p in exp.points:
        assert p.workload == "deltazip"
        t = p.trace
        assert (t["n_variants"], t["duration"], t["input_range"], t["output_range"]) == (32, 60.0, (8, 512), (8, 128))
        trace = wl.deltazip(**t)
        assert len(trace.requests) == int(t["rate"] * 60) and {v.kind for v in trace.variants} == {"full"}
    assert exp.server_flags["deltaserve"][:2] == ("--max-deltas", "3")
    assert exp.server_flags["swap"] == ("--resident", "auto")  # as many full models as fit (vLLM-SCB)
    one = serving.experiment("deltazip", rate=[2.0], popularity=["uniform"], duration=10)
    assert [(p.trace["popularity"], p.trace["rate"], p.trace["duration"]) for p in one.points] == [("uniform", 2.0, 10)]
    # Smoke: 4 requests per point, rates in the sweep's order.
    smoke = serving.experiment("deltazip", smoke=True)
    assert [len(wl.deltazip(**p.trace).requests) for p in smoke.points] == [4, 4, 4, 4]
    assert [p.trace["rate"] for p in smoke.points] == [3.0, 4.0, 3.0, 4.0]


def test_server_flags_replace_the_experiments_and_go_to_their_server():
    merged = serving.merge_flags(("--max-deltas", "3", "--lora-host-bytes", "99"), ["--max-deltas=5", "--x"])
    assert merged == ["--lora-host-bytes", "99", "--max-deltas=5", "--x"]
    assert serving.merge_flags(("--resident", "3"), ["--resident", "1"]) == ["--resident", "1"]
    flags = ["--max-batch=8", "swap:--resident=1", "deltaserve:--max-deltas=4", "--devices=cuda:0"]
    assert serving.flags_for("swap", flags) == ["--max-batch=8", "--resident=1", "--devices=cuda:0"]
    assert serving.flags_for("deltaserve", flags) == ["--max-batch=8", "--max-deltas=4", "--devices=cuda:0"]


def test_bad_deltazip_input_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--cv"):
        serving.experiment("deltazip", cv=[2.0])
    with pytest.raises(SystemExit, match="--popularity 'zipf'"):
        serving.experiment("deltazip", popularity=["zipf"])
    with pytest.raises(SystemExit, match="--popularity"):
        serving.experiment("slora-s1", popularity=["uniform"])
    exp = serving.experiment("deltazip", smoke=True)
    variants = wl.deltazip(**exp.points[0].trace).variants
    with pytest.raises(SystemExit, match="--server peft"):
        serving.prepare_variants(exp, "peft", variants, tmp_path, "cpu")
    assert list(tmp_path.iterdir()) == []  # nothing written
    with pytest.raises(SystemExit):
        serving.main(["deltazip", "--smoke", "--prepare-only"])
    assert "--prepare-only needs --work-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving.main(["deltazip", "--smoke", "--server", "deltaserve,nope"])
    assert "'nope': want one of" in capsys.readouterr().err
