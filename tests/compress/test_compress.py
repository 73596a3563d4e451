"""ΔCompress end to end on tiny models (CPU): the OBS solver against naive rounding, the delta directory
(manifest, reader, lossless payload, reference materialiser), lineage refusals, and a scaled-down
version of DeltaZip's quality claim.

The quality check fine-tunes every weight of the tiny Llama on a synthetic task that needs the
decoder blocks (predict a fixed permutation of the token two positions back: attention must move
it), then compares task accuracy of the fine-tune, of ``W_base + dequant(Δ̃)`` at 4-bit 2:4, and of
the same compressor on the full fine-tuned weights (the paper's SparseGPT baseline).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.compress import DeltaFormatError, DeltaLineageError, check_lineage, load_delta, materialize
from deltaserve.compress.__main__ import main as compress_main
from deltaserve.compress.calib import DEFAULT_TEXTS, calibration_samples, load_calibration
from deltaserve.compress.compressor import CompressConfig, compress
from deltaserve.compress.obs import layer_objective, obs_compress, rtn_compress
from deltaserve.formats.packed_delta import dequantize, pack
from helpers.tiny_models import make_tiny_model

TASK_VOCAB = 32
"""Distinct task tokens (ids FIRST_ID .. FIRST_ID + TASK_VOCAB - 1)."""
FIRST_ID = 16
"""First task token id (past the tokenizer's special tokens)."""
TASK_LEN = 16
"""Tokens per task sequence."""
TASK_OFFSET = 2
"""Target at position t is PERM[token at t - TASK_OFFSET]."""
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _task(n: int, gen: torch.Generator, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random task sequences and their targets (-100 where there is none)."""
    x = torch.randint(0, TASK_VOCAB, (n, TASK_LEN), generator=gen)
    target = torch.full_like(x, -100)
    target[:, TASK_OFFSET:] = perm[x[:, :-TASK_OFFSET]]
    return x + FIRST_ID, target


def _accuracy(model_dir: Path, ids: torch.Tensor, target: torch.Tensor) -> float:
    """Task accuracy of the HF model in ``model_dir`` (transformers, greedy argmax per position)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        pred = model(ids).logits.argmax(-1)
    sel = target != -100
    return float((pred[sel] == target[sel]).float().mean())


@pytest.fixture(scope="module")
def task(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Llama fully fine-tuned on the offset-permutation task, plus its data."""
    from transformers import LlamaForCausalLM

    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(TASK_VOCAB, generator=gen) + FIRST_ID
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention on shared CI cores
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        model.train()
        steps, lr = 200, 3e-3
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15)
        for _ in range(steps):
            ids, target = _task(32, gen, perm)
            logits = model(ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("task") / "finetuned"
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(tiny_llama / name, out / name)
    calib_ids, _ = _task(64, torch.Generator().manual_seed(7), perm)
    calib = out.parent / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": row.tolist()}) + "\n" for row in calib_ids))
    eval_ids, eval_target = _task(256, torch.Generator().manual_seed(123), perm)
    return {"dir": out, "calib": calib, "eval": (eval_ids, eval_target)}


def _layer_inputs(model_dir: Path, samples: list[list[int]], modules: list[str]) -> dict[str, torch.Tensor]:
    """Inputs ``[n, in]`` of each HF module over the calibration samples (one transformers forward each)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen: dict[str, list[torch.Tensor]] = {m: [] for m in modules}
    handles = [
        model.get_submodule(m).register_forward_pre_hook(lambda _m, a, m=m: seen[m].append(a[0].flatten(0, -2)))
        for m in modules
    ]
    with torch.no_grad():
        for s in samples:
            model(torch.tensor([s]))
    for h in handles:
        h.remove()
    return {m: torch.cat(xs) for m, xs in seen.items()}


OBJECTIVE_MODULES = ["model.layers.1.self_attn.q_proj", "model.layers.0.mlp.down_proj"]


@pytest.fixture(scope="module")
def objective_inputs(tiny_llama: Path) -> dict[str, torch.Tensor]:
    """Base-model inputs of ``OBJECTIVE_MODULES`` over 16 built-in calibration texts."""
    samples = calibration_samples(load_calibration(None), tiny_llama, 16, 64, vocab_size=10**6)
    return _layer_inputs(tiny_llama, samples, OBJECTIVE_MODULES)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("module", OBJECTIVE_MODULES)
def test_obs_objective_beats_rounding_and_magnitude_pruning(
    tiny_llama: Path, task: dict, objective_inputs: dict[str, torch.Tensor], bits: int, sparse: bool, module: str
) -> None:
    x = objective_inputs[module]
    hessian = 2.0 * x.T @ x / x.shape[0]
    delta = (
        load_file(task["dir"] / "model.safetensors")[f"{module}.weight"]
        - load_file(tiny_llama / "model.safetensors")[f"{module}.weight"]
    )
    res = obs_compress(delta, hessian, bits, sparse, 64)
    naive = rtn_compress(delta, bits, sparse, 64)
    for r in (res, naive):  # what the solver returns is exactly what the packed format stores
        assert torch.equal(dequantize(pack(r.codes, r.mask, r.scales, r.zeros, bits, 64)), r.dequant)
    if sparse:
        assert int((res.dequant.reshape(-1, 4) != 0).sum(-1).max()) <= 2
    ours, baseline = layer_objective(delta, res.dequant, hessian), layer_objective(delta, naive.dequant, hessian)
    # The objective itself, measured directly on the captured inputs.
    direct = float(((x @ (delta - res.dequant).T) ** 2).sum() / ((x @ delta.T) ** 2).sum())
    assert direct == pytest.approx(ours, rel=1e-3)
    assert ours < 0.95 * baseline, (ours, baseline)


def test_quality_delta_keeps_accuracy_and_beats_full_weight_compression(
    tiny_llama: Path, task: dict, tmp_path: Path
) -> None:
    ids, target = task["eval"]
    acc_base = _accuracy(tiny_llama, ids, target)
    acc_ft = _accuracy(task["dir"], ids, target)
    assert acc_base < 0.2 and acc_ft > 0.9, (acc_base, acc_ft)  # the task is learned, and new
    results = {}
    for full in (False, True):
        out = tmp_path / ("full" if full else "delta")
        compress(tiny_llama, task["dir"], out, CompressConfig(calib=str(task["calib"]), full_weights=full), None)
        results[full] = _accuracy(materialize(out, tiny_llama, tmp_path / f"model-{full}"), ids, target)
    acc_delta, acc_full = results[False], results[True]
    print(
        f"accuracy: base {acc_base:.3f}, fine-tune {acc_ft:.3f}, 4-bit 2:4 delta {acc_delta:.3f}, full {acc_full:.3f}"
    )
    assert acc_delta >= acc_ft - 0.05, (acc_ft, acc_delta)
    assert acc_delta > acc_full, (acc_delta, acc_full)


def test_cli_writes_a_delta_dir_the_reader_and_materializer_agree_on(
    tiny_llama: Path, task: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "delta"
    rc = compress_main(
        ["--base", str(tiny_llama), "--finetuned", str(task["dir"]), "--out", str(out), "--bits", "2",
         "--nsamples", "8", "--seqlen", "32"]
    )  # fmt: skip
    assert rc == 0
    captured = capsys.readouterr()
    assert "compression ratio vs fp16" in captured.out and "model.layers.1.mlp.down_proj" in captured.out
    assert "layer [" in captured.err and "2/2" in captured.err

    manifest, packed, dense = load_delta(out)
    assert manifest["mode"] == "delta" and manifest["compression"]["bits"] == 2
    assert manifest["compression"]["calibration"] == {
        "source": "builtin",
        "samples": 8,
        "tokens": manifest["compression"]["calibration"]["tokens"],
        "seqlen": 32,
    }
    assert sorted(packed) == sorted(f"model.layers.{i}.{'mlp' if n in LINEARS[4:] else 'self_attn'}.{n}"
                                    for i in range(2) for n in LINEARS)  # fmt: skip
    assert all(p.bits == 2 and p.sparse and p.group_size == 64 for p in packed.values())
    assert "model.embed_tokens.weight" in dense and "lm_head.weight" in dense
    assert all(t.dtype == torch.float16 for t in dense.values())
    ratio = manifest["sizes"]["compression_ratio"]
    on_disk = (out / "delta.safetensors").stat().st_size
    assert ratio == pytest.approx(manifest["sizes"]["finetuned_fp16_bytes"] / on_disk)
    assert ratio > 1.0

    # The dense reference model is exactly W_base + dequant(Δ̃) (+ fp16 dense deltas).
    ref = load_file(materialize(out, tiny_llama, tmp_path / "ref") / "model.safetensors")
    base = load_file(tiny_llama / "model.safetensors")
    ft = load_file(task["dir"] / "model.safetensors")
    assert set(ref) == set(base)
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(ref[f"{q}.weight"], base[f"{q}.weight"] + dequantize(packed[q]))
    emb = "model.embed_tokens.weight"
    assert torch.equal(ref[emb], base[emb] + dense[emb].float())
    assert (ref[emb] - ft[emb]).abs().max() < 1e-3  # fp16 rounding of the delta only
    # The compressed linears approximate the fine-tune's, much better than the base does.
    err = (ref[f"{q}.weight"] - ft[f"{q}.weight"]).norm() / (base[f"{q}.weight"] - ft[f"{q}.weight"]).norm()
    assert err < 0.7


def test_lossless_payload_reads_back_identical(tiny_llama: Path, task: dict, tmp_path: Path) -> None:
    cfg = dict(calib=str(task["calib"]), nsamples=16)
    plain = compress(tiny_llama, task["dir"], tmp_path / "plain", CompressConfig(**cfg), None)
    packed_ = compress(tiny_llama, task["dir"], tmp_path / "lossless", CompressConfig(lossless=True, **cfg), None)
    assert packed_["payload"]["codec"] in ("zstd", "lzma") and plain["payload"]["codec"] == "none"
    assert (tmp_path / "lossless" / packed_["payload"]["file"]).is_file()
    assert not (tmp_path / "lossless" / "delta.safetensors").exists()
    assert packed_["payload"]["raw_bytes"] == plain["payload"]["bytes"]
    _, p1, d1 = load_delta(tmp_path / "plain")
    _, p2, d2 = load_delta(tmp_path / "lossless")
    assert p1.keys() == p2.keys() and d1.keys() == d2.keys()
    for name in p1:
        for suffix, t in p1[name].tensors().items():
            assert torch.equal(t, p2[name].tensors()[suffix]), (name, suffix)
    for name in d1:
        assert torch.equal(d1[name], d2[name])


def test_unchanged_tensors_are_dropped_and_dense_config(tiny_llama: Path, tmp_path: Path) -> None:
    # A "fine-tune" that only changed layer 0's MLP: every dense delta is zero and dropped.
    ft_dir = tmp_path / "ft"
    shutil.copytree(tiny_llama, ft_dir)
    tensors = load_file(ft_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for n in ("gate_proj", "up_proj", "down_proj"):
        w = tensors[f"model.layers.0.mlp.{n}.weight"]
        tensors[f"model.layers.0.mlp.{n}.weight"] = w + 0.01 * torch.randn(w.shape, generator=gen)
    save_file(tensors, str(ft_dir / "model.safetensors"))
    out = tmp_path / "delta"
    manifest = compress(tiny_llama, ft_dir, out, CompressConfig(sparse=False, group_size=32, nsamples=8), None)
    assert not any(e["kind"] == "dense" for e in manifest["tensors"].values())
    assert "model.embed_tokens.weight" in manifest["dropped"] and "lm_head.weight" in manifest["dropped"]
    _, packed, dense = load_delta(out)
    assert dense == {} and all(not p.sparse and p.qindices is None for p in packed.values())
    # Unchanged linears compress to an exactly zero delta.
    assert not dequantize(packed["model.layers.1.self_attn.q_proj"]).any()
    assert dequantize(packed["model.layers.0.mlp.up_proj"]).abs().max() > 0


def test_lineage_refusals(tiny_llama: Path, tiny_qwen2: Path, task: dict, tmp_path: Path) -> None:
    cfg = CompressConfig(calib=str(task["calib"]), nsamples=4)
    # A fine-tune of another shape: the message names the config.json field.
    wider = make_tiny_model(tmp_path, "llama", seed=0, intermediate_size=96)
    with pytest.raises(DeltaLineageError, match="'intermediate_size'.*96.*expected 128"):
        compress(tiny_llama, wider, tmp_path / "a", cfg, None)
    with pytest.raises(DeltaLineageError, match="'architectures'"):
        compress(tiny_llama, tiny_qwen2, tmp_path / "b", cfg, None)
    # Same config, a tensor of another shape: the message names the tensor.
    bad = tmp_path / "bad"
    shutil.copytree(task["dir"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:16]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(DeltaLineageError, match=r"model.layers.1.self_attn.k_proj.weight.*\[16, 64\]"):
        compress(tiny_llama, bad, tmp_path / "c", cfg, None)
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c"))  # refused before writing anything

    out = tmp_path / "ok"
    manifest = compress(tiny_llama, task["dir"], out, cfg, None)
    check_lineage(manifest, tiny_llama, out)  # its own base passes
    with pytest.raises(DeltaLineageError, match="'architectures'"):
        check_lineage(manifest, tiny_qwen2, out)
    with pytest.raises(DeltaLineageError, match="'intermediate_size'"):
        check_lineage(manifest, wider, out)
    with pytest.raises(DeltaLineageError, match="'architectures'"):
        materialize(out, tiny_qwen2, tmp_path / "never")
    # A base whose checkpoint shapes differ from those recorded (config edited to match).
    shapes = dict(manifest["base_shapes"])
    shapes["model.norm.weight"] = [65]
    with pytest.raises(DeltaLineageError, match=r"'model.norm.weight' has shape \[64\].*made for \[65\]"):
        check_lineage(dict(manifest, base_shapes=shapes), tiny_llama, out)

    # Refusals of bad settings and outputs, through the CLI (exit 2, nothing written).
    assert compress_main(["--base", str(tiny_llama), "--finetuned", str(task["dir"]), "--out", str(out)]) == 2
    assert compress_main(
        ["--base", str(tiny_llama), "--finetuned", str(task["dir"]), "--out", str(tmp_path / "g"), "--group-size", "48"]
    ) == 2  # fmt: skip
    assert not (tmp_path / "g").exists()


def test_reader_refuses_damaged_directories(tiny_llama: Path, task: dict, tmp_path: Path) -> None:
    out = tmp_path / "delta"
    compress(tiny_llama, task["dir"], out, CompressConfig(calib=str(task["calib"]), nsamples=4), None)
    manifest = json.loads((out / "manifest.json").read_text())

    def broken(edit) -> Path:  # noqa: ANN001
        d = tmp_path / f"broken{len(list(tmp_path.iterdir()))}"
        shutil.copytree(out, d)
        m = json.loads(json.dumps(manifest))
        edit(m, d)
        (d / "manifest.json").write_text(json.dumps(m))
        return d

    with pytest.raises(DeltaFormatError, match="format_version"):
        load_delta(broken(lambda m, d: m.update(format_version=99)))
    with pytest.raises(DeltaFormatError, match="payload file"):
        load_delta(broken(lambda m, d: (d / "delta.safetensors").unlink()))
    q = "model.layers.0.self_attn.q_proj"
    with pytest.raises(DeltaFormatError, match=rf"'{q}'.*qvalues has shape \[64, 4\], expected \[64, 8\]"):
        load_delta(broken(lambda m, d: m["tensors"][q].update(shape=[64, 128])))
    with pytest.raises(DeltaFormatError, match="not listed"):
        load_delta(broken(lambda m, d: m["tensors"].pop("model.norm.weight")))
    with pytest.raises(DeltaFormatError, match="no manifest.json"):
        load_delta(tmp_path / "nowhere")

    def truncate(d: Path, keep: int) -> None:
        f = d / "delta.safetensors"
        f.write_bytes(f.read_bytes()[:keep])

    size = (out / "delta.safetensors").stat().st_size
    for keep in (4, 200, size - 1):  # inside the length prefix, inside the header, inside the data
        with pytest.raises(DeltaFormatError, match="not a valid safetensors payload"):
            load_delta(broken(lambda m, d, k=keep: truncate(d, k)))
    with pytest.raises(DeltaFormatError, match="not a valid safetensors payload"):
        load_delta(broken(lambda m, d: (d / "delta.safetensors").write_bytes(b"\xff" * 64)))


def test_reader_views_one_buffer_with_safetensors_values(tiny_llama: Path, task: dict, tmp_path: Path) -> None:
    """The payload is read once: every tensor is a view of one buffer, equal to safetensors' own reading."""
    out = tmp_path / "delta"
    compress(tiny_llama, task["dir"], out, CompressConfig(calib=str(task["calib"]), nsamples=4), None)
    _, packed, dense = load_delta(out)
    want = load_file(str(out / "delta.safetensors"))
    got = {f"{n}.{k}": t for n, p in packed.items() for k, t in p.tensors().items()} | dense
    assert got.keys() == want.keys()
    for k, t in got.items():
        assert t.dtype == want[k].dtype and torch.equal(t, want[k]), k
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1


def test_calibration_file_errors(tmp_path: Path, tiny_llama: Path) -> None:
    assert len(load_calibration(None)) == len(DEFAULT_TEXTS) >= 30
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "hello world"}\n\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:3: expected an object"):
        load_calibration(f)
    f.write_text('{"input_ids": [1, 2, 100000]}\n')
    with pytest.raises(ValueError, match="token id 100000 >= vocab_size"):
        calibration_samples(load_calibration(f), tiny_llama, 4, 16, vocab_size=512)
    long = [list(range(2, 50))]
    assert [len(s) for s in calibration_samples(long, tiny_llama, 10, 16, vocab_size=512)] == [16, 16, 16]


def test_calibration_inputs_come_from_the_reconstructed_model(
    tiny_llama: Path, task: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Algorithm 1: every Hessian the compressor builds equals the one of the same linear's inputs in
    the *compressed* model (``materialize``, run by transformers), not in the base or the fine-tune."""

    import deltaserve.compress.compressor as compressor

    seen: list[tuple[str, torch.Tensor]] = []
    real = compressor._collect_hessian

    def recording(layer, module_path, *args):  # noqa: ANN001, ANN202
        hessian = real(layer, module_path, *args)
        seen.append((module_path, hessian.clone()))
        return hessian

    monkeypatch.setattr(compressor, "_collect_hessian", recording)
    out = tmp_path / "delta"
    compress(tiny_llama, task["dir"], out, CompressConfig(bits=2, calib=str(task["calib"]), nsamples=8), None)
    ref_dir = materialize(out, tiny_llama, tmp_path / "ref")
    samples = [json.loads(line)["input_ids"] for line in task["calib"].read_text().splitlines()[:8]]
    hf_input = {"self_attn.qkv_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
                "mlp.gate_up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}  # fmt: skip
    assert [p for p, _ in seen] == list(hf_input) * 2
    modules = [f"model.layers.{i // 4}.{hf_input[path]}" for i, (path, _) in enumerate(seen)]
    inputs = {"reconstructed": _layer_inputs(ref_dir, samples, modules),
              "fine-tuned": _layer_inputs(task["dir"], samples, modules)}  # fmt: skip
    for i, (module, (_, hessian)) in enumerate(zip(modules, seen)):
        want = {name: 2.0 * x[module].T @ x[module] / x[module].shape[0] for name, x in inputs.items()}
        scale = float(want["reconstructed"].abs().max())
        assert float((hessian - want["reconstructed"]).abs().max()) < 1e-4 * scale, module
        if i >= 1:  # past the first linear, compression has changed what the layer sees
            assert float((hessian - want["fine-tuned"]).abs().max()) > 1e-3 * scale, module


@pytest.mark.parametrize("fixture", ["tiny_llama3", "tiny_mistral", "tiny_qwen2", "tiny_llama_tied"])
def test_every_architecture_compresses_and_reconstructs(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Small dense-ish deltas on every table architecture (biases, tied embeddings, sliding window,
    llama3 rope): the reconstruction is much closer to the fine-tune than the base is."""
    from transformers import AutoModelForCausalLM

    base: Path = request.getfixturevalue(fixture)
    ft = tmp_path / "ft"
    shutil.copytree(base, ft)
    tensors = load_file(ft / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        tensors[name] = t + 0.02 * t.abs().mean() * torch.randn(t.shape, generator=gen)
    if "lm_head.weight" in tensors and fixture == "tiny_llama_tied":
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, str(ft / "model.safetensors"))
    out = tmp_path / "delta"
    manifest = compress(base, ft, out, CompressConfig(bits=4, sparse=False, nsamples=16, seqlen=64), None)
    assert ("lm_head.weight" in manifest["tensors"]) == (fixture != "tiny_llama_tied")
    if fixture == "tiny_qwen2":
        assert manifest["tensors"]["model.layers.0.self_attn.k_proj.bias"]["kind"] == "dense"
    ref = materialize(out, base, tmp_path / "ref")
    ids = torch.tensor([list(range(20, 60))])
    logits = {}
    for name, d in (("base", base), ("ft", ft), ("ref", ref)):
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits[name] = model(ids).logits
    err = (logits["ref"] - logits["ft"]).norm() / (logits["base"] - logits["ft"]).norm()
    assert err < 0.3, float(err)
