"""The compressed-delta benchmarks' data and scripts, on the CPU:

- ``common.write_random_delta_dir`` writes a delta the worker accepts for the tiny Llama (inspection,
  lineage, ``load_delta``), with legal 2:4 positions (exactly 2 kept per group of 4, increasing),
  delta values of the documented size, and that an ``Executor`` serves in a decode step;
- ``common.write_random_checkpoint``: the same seed gives the same base, ``noise`` moves every tensor
  by about ``noise`` x its scale, and the loader reads it;
- ``bench/delta_decode_step.py`` and ``bench/compress_time.py`` run end to end in ``--smoke`` mode and
  write a result JSON with every field the GPU runs report, with sane positive numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench import common
from bench.decode_step import bench_batch
from deltaserve import wire  # noqa: E402
from deltaserve.adapters.delta_blocks import SHARING_ENV  # noqa: E402
from deltaserve.compress.delta_dir import check_lineage, load_delta, materialize  # noqa: E402
from deltaserve.formats.packed_delta import unpack  # noqa: E402
from deltaserve.model.loader import load_model  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402


@pytest.mark.parametrize("bits,sparse", [(4, True), (2, False)])
def test_random_delta_dir_is_a_delta_the_worker_serves(
    tiny_llama: Path, tmp_path: Path, bits: int, sparse: bool
) -> None:
    d = common.write_random_delta_dir(tiny_llama, tmp_path / "d", bits=bits, sparse=sparse, group_size=64, seed=3)
    manifest, packed, dense = load_delta(d)
    check_lineage(manifest, tiny_llama, d)
    assert manifest["mode"] == "delta" and manifest["compression"]["bits"] == bits
    assert len(packed) == 2 * 7 and {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(dense)
    for name, p in packed.items():
        codes, mask = unpack(p)
        per_group = mask.reshape(p.out_features, -1, 4).sum(-1)
        assert bool((per_group == (2 if sparse else 4)).all()), name
        assert int(codes.max()) <= (1 << bits) - 1
        if sparse:  # the stored positions of each group are increasing
            words = p.qindices.to(torch.int64) & 0xFFFFFFFF
            pos = (words.unsqueeze(-1) >> (2 * torch.arange(16))) & 3
            assert bool((pos[..., 0::2] < pos[..., 1::2]).all()), name

    ref = materialize(d, tiny_llama, tmp_path / "ref")
    base_w = load_file(tiny_llama / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    diff = load_file(ref / "model.safetensors")["model.layers.1.mlp.down_proj.weight"] - base_w
    half_range = 1 << (bits - 1)  # |code - zero| bound (zeros: the two middle codes); scales <= 3e-4
    assert 0 < float(diff.abs().max()) <= half_range * 3e-4 * 1.01 + 1e-6
    kept = 0.5 if sparse else 1.0  # exact zeros: the pruned half, and kept codes equal to their zero
    assert abs(float((diff == 0).float().mean()) - ((1 - kept) + kept / (1 << bits))) < 0.05

    ex = Executor(tiny_llama, device="cpu", dtype="float32", block_size=4, kv_cache_bytes=2 << 20)
    delta = wire.VariantKind.DELTA
    info = ex.inspect_variant(str(d), delta)
    assert info.error is None and info.kind == delta and info.summary.startswith(f"{bits}-bit")
    ex.step(
        wire.StepPlan(
            step_id=1,
            adapter_ops=[
                wire.VariantOp(5, wire.TierOp.TO_HOST, str(d), [], delta),
                wire.VariantOp(5, wire.TierOp.TO_GPU, "", [], delta, 0),
            ],
        )
    )
    times = bench_batch(ex, 2, 8, 2, 0, first_id=10, adapter_ids=[5, 0])
    assert len(times) == 2 and ex.delta_pool is not None and ex.delta_pool.slot_of == {5: 0}


def test_random_delta_dir_refuses_a_base_without_weights_and_a_used_out_dir(tiny_llama: Path, tmp_path: Path) -> None:
    random_base = common.write_random_model_dir(common.SMOKE_SHAPE, tmp_path / "random")
    with pytest.raises(ValueError, match="safetensors"):
        common.write_random_delta_dir(random_base, tmp_path / "d1")
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("keep")
    with pytest.raises(ValueError, match="not an empty directory"):
        common.write_random_delta_dir(tiny_llama, used)
    assert [p.name for p in used.iterdir()] == ["x"]


def test_random_checkpoint_base_and_finetune(tmp_path: Path) -> None:
    cfg = common.shape_config(common.SMOKE_SHAPE, num_layers=1)
    a = common.write_random_checkpoint(cfg, tmp_path / "a", seed=4)
    common.write_random_checkpoint(cfg, tmp_path / "b", seed=4)
    common.write_random_checkpoint(cfg, tmp_path / "ft", seed=4, noise=0.05)
    read = {}
    for name in ("a", "b", "ft"):
        read[name] = {}
        for f in sorted((tmp_path / name).glob("*.safetensors")):
            read[name].update(load_file(f))
    assert set(read["a"]) == set(common.checkpoint_tensor_shapes(cfg))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(read["a"][q], read["b"][q])
    moved = (read["ft"][q].float() - read["a"][q].float()).std()
    assert 0.5 * 0.05 * 0.02 < float(moved) < 2 * 0.05 * 0.02
    norm = "model.norm.weight"
    assert bool((read["a"][norm] == 1).all()) and not torch.equal(read["ft"][norm], read["a"][norm])
    model = load_model(a, "cpu", torch.float32)
    assert model.config.num_layers == 1
    with pytest.raises(ValueError, match="already exists"):
        common.write_random_checkpoint(cfg, a)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_delta_decode_step_smoke(tmp_path: Path) -> None:
    from bench import delta_decode_step

    before = os.environ.get(SHARING_ENV)
    path = delta_decode_step.main(["--smoke", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "w")])
    assert os.environ.get(SHARING_ENV) == before, "the run's piece-sharing setting does not outlive it"
    r = json.loads(Path(path).read_text())
    assert r["piece_sharing"] == "off"
    for key in (
        "experiment",
        "commit",
        "date",
        "device",
        "shape",
        "dtype",
        "kv_len",
        "batch",
        "deltas",
        "bits",
        "sparsity",
        "group_size",
        "timed_steps",
        "delta_payload_bytes",
        "delta_slot_gpu_bytes",
        "rows",
        "target",
        "load",
    ):
        assert key in r, key
    assert r["experiment"] == "delta_decode_step" and r["device"] == "cpu" and r["smoke"] is True
    cases = {(row["case"], row["mode"]): row for row in r["rows"]}
    assert set(cases) == {("base", "eager"), ("1 delta", "eager"), (f"{r['deltas']} deltas", "eager")}
    assert all(_positive(row["step_ms"]) and _positive(row["ratio_to_base"]) for row in r["rows"])
    assert cases[("base", "eager")]["ratio_to_base"] == 1.0
    t = r["target"]
    assert t["max_ratio"] == 1.6 and t["ratio"] == cases[(t["case"], "eager")]["ratio_to_base"]
    assert t["met"] == (t["ratio"] <= 1.6)
    assert all(
        _positive(r["load"][k])
        for k in ("bytes", "disk_to_host_ms", "host_to_gpu_ms", "host_to_gpu_GBps", "host_to_gpu_launch_ms")
    )
    assert _positive(r["delta_payload_bytes"]) and r["delta_slot_gpu_bytes"] >= r["load"]["bytes"] // 2
    assert list((tmp_path / "w").iterdir()) == []  # the temp checkpoint and deltas are gone


def test_compress_time_smoke(tmp_path: Path) -> None:
    from bench import compress_time

    path = compress_time.main(["--smoke", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "w")])
    r = json.loads(Path(path).read_text())
    assert r["experiment"] == "compress_time" and r["device"] == "cpu" and r["smoke"] is True
    assert r["layers"] == 1 and r["full_layers"] == 2 and len(r["layer_seconds"]) == 1
    for key in (
        "seconds",
        "setup_seconds",
        "mean_layer_seconds",
        "payload_bytes",
        "finetuned_fp16_bytes",
        "calibration_tokens",
    ):
        assert _positive(r[key]), key
    assert r["seconds_full_depth"] == pytest.approx(r["seconds"] + r["mean_layer_seconds"])
    assert r["compression_ratio"] == pytest.approx(r["finetuned_fp16_bytes"] / r["payload_bytes"])
    assert r["compression_ratio"] > 1 and 0 < r["rel_error_mean"] <= r["rel_error_max"] < 1
    assert r["target"] == {
        "max_seconds": 900,
        "seconds_full_depth": r["seconds_full_depth"],
        "extrapolated": True,
        "met": r["seconds_full_depth"] <= 900,
    }
    assert r["calibration_tokens"] == 4 * 32
