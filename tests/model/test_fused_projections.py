"""Fused qkv / gate_up projections: the loader stacks HF's tensors, and nothing else changes.

Tiny Llama, Qwen2 (q/k/v bias) and tied-embedding checkpoints:

- the fused parameters are exactly HF's q/k/v (gate/up) weights and biases stacked in the
  ``linear_slots`` order, and each slot's output rows are that HF linear's output (the layout
  adapter wrappers rely on);
- logits equal HF transformers' (prefill over shuffled pages, then decode), with the decoder's
  small ops on their torch references and, once more, on the Triton kernels (interpreter on CPU);
- ``state_dict()`` speaks HF's names and round-trips through ``load_state_dict``;
- a checkpoint missing ``k_proj`` (weight or bias) or with a misshaped ``v_proj`` is refused with
  a message naming the HF tensor.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from deltaserve.kernels import common as kernel_common
from deltaserve.kernels import rmsnorm as rms_mod
from deltaserve.model import DecoderLM, ForwardBatch, ModelConfig, PagedKVCache, load_model, random_model
from deltaserve.model.decoder import GATE_UP_SLICES, QKV_SLICES, linear_slots

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU

ATOL = 1e-4  # as tests/model/test_decoder_vs_hf.py
MODELS = {"llama": "tiny_llama", "qwen2": "tiny_qwen2", "tied": "tiny_llama_tied"}


@pytest.fixture(params=list(MODELS))
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(MODELS[request.param])


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run_prefill_then_decode(model: DecoderLM, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits for every token: a prefill of all but the last 3, then 3 single-token decodes."""
    cfg = model.config
    blocks = 32
    kv = PagedKVCache(cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    pages = list(range(1, blocks))
    random.Random(0).shuffle(pages)
    table = pages[: -(-len(ids) // block_size)]
    out = []
    cut = len(ids) - 3
    with torch.no_grad():
        for lo, hi in [(0, cut)] + [(p, p + 1) for p in range(cut, len(ids))]:
            batch = ForwardBatch.build([(ids[lo:hi], lo, table, True)], block_size)
            batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
            out.append(model(batch, kv))
    return torch.cat(out)


def prompt(model: DecoderLM, n: int = 29) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()


def test_fused_parameters_are_hf_tensors_stacked(model_dir: Path) -> None:
    model = load_model(model_dir)
    cfg = model.config
    sd = load_file(model_dir / "model.safetensors")
    slots = linear_slots(cfg)
    assert list(slots) == list(cfg.arch.linear_names)  # the architecture table still names HF linears
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.qkv_proj, torch.nn.Linear) and isinstance(mlp.gate_up_proj, torch.nn.Linear)
        assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
        fused_modules = ((attn.qkv_proj, "self_attn", QKV_SLICES), (mlp.gate_up_proj, "mlp", GATE_UP_SLICES))
        for fused, parent, names in fused_modules:
            leaves = ("weight", "bias") if fused.bias is not None else ("weight",)
            for leaf in leaves:
                want = torch.cat([sd[f"model.layers.{i}.{parent}.{n}.{leaf}"] for n in names])
                assert torch.equal(getattr(fused, leaf), want), f"layer {i} {parent} {leaf}"
        assert (attn.qkv_proj.bias is not None) == (cfg.architecture == "Qwen2ForCausalLM")
        # Each slot's output rows are that HF linear applied to x.
        gen = torch.Generator().manual_seed(i)
        for name, slot in slots.items():
            parent = slot.module.split(".")[0]
            w = sd[f"model.layers.{i}.{parent}.{name}.weight"]
            b = sd.get(f"model.layers.{i}.{parent}.{name}.bias")
            module = layer.get_submodule(slot.module)
            x = torch.randn(5, module.in_features, generator=gen)
            got = module(x)[:, slot.start : slot.start + slot.size]
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-6, rtol=1e-6)


def test_fused_model_logits_match_hf(model_dir: Path) -> None:
    model = load_model(model_dir)
    ids = prompt(model)
    torch.testing.assert_close(run_prefill_then_decode(model, ids), hf_logits(model_dir, ids), atol=ATOL, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU model: needs the Triton interpreter")
@pytest.mark.parametrize("name", ["tiny_llama3", "tiny_qwen2"])
def test_fused_model_on_triton_kernels_matches_hf(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same forward with rmsnorm / rope / silu_mul forced onto their Triton kernels."""
    path = request.getfixturevalue(name)
    model = load_model(path)
    ids = prompt(model, 21)
    monkeypatch.setattr(kernel_common, "_backend", "triton")
    calls = {"n": 0}
    real = rms_mod.fused_add_rmsnorm_triton

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(rms_mod, "fused_add_rmsnorm_triton", counted)
    got = run_prefill_then_decode(model, ids)
    assert calls["n"] > 0, "the Triton path was not taken"
    torch.testing.assert_close(got, hf_logits(path, ids), atol=ATOL, rtol=0)


def test_state_dict_speaks_hf_names_and_round_trips(model_dir: Path) -> None:
    model = load_model(model_dir)
    sd = model.state_dict()
    on_disk = load_file(model_dir / "model.safetensors")
    assert set(on_disk) <= set(sd) and set(sd) - set(on_disk) <= {"lm_head.weight"}
    for key, t in on_disk.items():
        assert torch.equal(sd[key], t), key
    other = random_model(model.config, "cpu", torch.float32, seed=1)
    other.load_state_dict(sd)
    ids = prompt(model, 9)
    assert torch.equal(run_prefill_then_decode(other, ids), run_prefill_then_decode(model, ids))
    # A state dict lacking one part of a fused tensor is refused by strict loading, naming it.
    del sd["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        other.load_state_dict(sd)


def edited_checkpoint(src: Path, dst: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    if drop is not None:
        del sd[drop]
    if reshape is not None:
        sd[reshape] = torch.zeros(sd[reshape].shape[0] + 1, *sd[reshape].shape[1:])
    save_file(sd, dst / "model.safetensors")
    return dst


def test_loader_refuses_checkpoint_missing_k_proj(tiny_llama: Path, tiny_qwen2: Path, tmp_path: Path) -> None:
    d = edited_checkpoint(tiny_llama, tmp_path / "a", drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.k_proj\.weight$"):
        load_model(d)
    d = edited_checkpoint(tiny_qwen2, tmp_path / "b", drop="model.layers.0.self_attn.k_proj.bias")
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.0\.self_attn\.k_proj\.bias$"):
        load_model(d)
    d = edited_checkpoint(tiny_qwen2, tmp_path / "c", reshape="model.layers.1.mlp.up_proj.weight")
    msg = r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \[129, 64\], expected \[128, 64\]"
    with pytest.raises(ValueError, match=msg):
        load_model(d)


def test_random_model_has_fused_shapes(tiny_qwen2: Path) -> None:
    cfg = ModelConfig.from_model_dir(tiny_qwen2)
    model = random_model(cfg, "cpu", torch.float32, seed=2)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert layer.self_attn.qkv_proj.bias.shape == (cfg.q_size + 2 * cfg.kv_size,)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert layer.self_attn.qkv_proj.weight.std() > 0.01 and (layer.self_attn.qkv_proj.bias == 0).all()
