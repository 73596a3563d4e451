"""Checkpoints the decoder must not load, refused with the field named; and generation_config.json.

A quantized checkpoint (``quantization_config``: FP8, AWQ, GPTQ, bitsandbytes; or FP8 / integer
weight tensors without it) is refused before any weight is read: loading it would drop its scales.
So is an architecture outside the table, a bidirectional Gemma 3 and a partial rotary factor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.model import ModelConfig, load_model


def edited(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    ],
    ids=lambda q: q["quant_method"],
)
def test_quantized_checkpoint_is_refused_naming_the_field(tiny_llama: Path, tmp_path: Path, quant: dict) -> None:
    d = edited(tiny_llama, tmp_path / "m", quantization_config=quant)
    with pytest.raises(
        ValueError, match=rf"field 'quantization_config' is set \(quant_method '{quant['quant_method']}'\)"
    ):
        load_model(d)


def test_fp8_weights_without_a_quantization_config_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    sd = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    sd[name] = sd[name].to(torch.float8_e4m3fn)
    sd[name.replace(".weight", ".weight_scale")] = torch.ones(1)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{name}' is stored as F8_E4M3: a quantized checkpoint"):
        load_model(d)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"architectures": ["DeepseekV3ForCausalLM"]},
            r"unsupported architecture 'DeepseekV3ForCausalLM' in field 'architectures'",
        ),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            r"unsupported architecture 'Gemma3ForConditionalGeneration'",
        ),
        ({"architectures": []}, r"field 'architectures' is missing or empty"),
        ({"hidden_act": "relu"}, r"unsupported 'hidden_act' 'relu'"),
        ({"partial_rotary_factor": 0.75}, r"'partial_rotary_factor' 0.75 is not supported"),
    ],
)
def test_unsupported_configs_are_refused(tiny_llama: Path, tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(edited(tiny_llama, tmp_path / "m", **changes))


def _gemma3_config(**extra: object) -> dict:
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "sliding_window": 512,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256,
    }
    raw.update(extra)
    return raw


def test_gemma3_classic_config_spelling_and_bidirectional_refusal() -> None:
    """A transformers-4 Gemma 3 config (no layer_types: every 6th layer global; rope_local_base_freq)."""
    cfg = ModelConfig.from_dict(_gemma3_config())
    assert cfg.layer_windows == (512, 512, 512, 512, 512, None)
    assert cfg.local_rope_theta == 10000.0 and cfg.local_rope_scaling is None
    assert cfg.rope_theta == 1000000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.scale == 256**-0.5 and cfg.hidden_act == "silu" and cfg.final_softcap is None
    with pytest.raises(ValueError, match="'use_bidirectional_attention' is not supported"):
        ModelConfig.from_dict(_gemma3_config(use_bidirectional_attention=True))


def test_generation_config_eos_ids_and_sampling_defaults() -> None:
    gen = {"eos_token_id": [1, 106], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    cfg = ModelConfig.from_dict(_gemma3_config(eos_token_id=1), generation_config=gen)
    assert cfg.eos_token_ids == [1, 106]
    assert cfg.generation_defaults == {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
