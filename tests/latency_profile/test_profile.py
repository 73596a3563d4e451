"""``deltaserve profile`` (``pyworker/deltaserve/profile``) on the tiny Llama, CPU: the grid's samples
carry the simulator's features (Σ rank varying apart from the token count), the fit is the
simulator's ``LatencyModel`` with R² per step kind, and the file round-trips (what the daemon's
``--latency-profile`` and ``deltaserve sim --latency-model`` read). Bad input is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.profile.__main__ import main
from deltaserve.profile.measure import measure, random_lora_dir
from deltaserve.sim.latency import LatencyModel
from helpers.executors import make_executor


def test_the_grid_varies_rank_apart_from_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    from deltaserve.model.arch import ModelConfig

    cfg = ModelConfig.from_model_dir(tiny_llama)
    ex = make_executor(tiny_llama, max_deltas=0)
    dirs = {1: random_lora_dir(tmp_path / "r4", cfg, 4, ["q_proj", "v_proj"]),
            2: random_lora_dir(tmp_path / "r8", cfg, 8, ["q_proj", "v_proj"])}  # fmt: skip
    dirs[3] = dirs[2]
    ranks = {1: 4, 2: 8, 3: 8}
    samples = measure(ex, dirs, ranks, batches=[1, 2], prompts=[6], ctx=4, reps=1)
    decode = [s for s in samples if s["prefill_tokens"] == 0]
    prefill = [s for s in samples if s["prefill_tokens"] > 0]
    assert all(s["step_s"] > 0 for s in samples)
    # batch 2: base, one rank-4 adapter (Σ 4), one rank-8 adapter, two distinct rank-8 ones (Σ 16)
    assert sorted((s["seqs"], s["lora_rank_sum"], s["lora_segments"]) for s in decode if s["seqs"] == 2) == [
        (2, 0, 0), (2, 4, 1), (2, 8, 1), (2, 16, 2),
    ]  # fmt: skip
    assert sorted(s["lora_rank_sum"] for s in prefill) == [0, 4, 8] and all(s["tokens"] == 6 for s in prefill)
    assert all(s["prefill_attention"] == 36 for s in prefill)


def test_the_command_writes_a_fitted_model(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "profile.json"
    args = ["--model", str(tiny_llama), "--dtype", "float32", "--batches", "1,2", "--ranks", "4,8", "--prompts",
            "6,12", "--targets", "q_proj,v_proj", "--ctx", "4", "--reps", "1", "--kv-cache-bytes", str(8 << 20),
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    model = LatencyModel.load(out)
    assert model.device == "cpu" and set(model.r2) == {"decode", "prefill"}
    assert model.samples == {"decode": 8, "prefill": 6}  # decode: 3 at batch 1, 5 at batch 2
    assert json.loads(capsys.readouterr().out)["out"] == str(out)
    assert main([*args[:-2], "--out", str(tmp_path / "x.json"), "--targets", "nope_proj"]) == 2
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "y.json")]) == 2
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_llama), "--batches", "0", "--out", str(out)])
