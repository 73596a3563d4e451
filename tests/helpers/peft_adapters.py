"""PEFT LoRA adapters made by the ``peft`` library itself, for tests (never by our own writer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every projection a Llama-family layer has."""


def hf_model(base_dir: Path) -> torch.nn.Module:
    """The base checkpoint as a transformers model (float32, eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **lora: Any):
    """Build a PEFT LoRA model on the base with non-zero random A and B, save it; return (peft_model, dir)."""
    from peft import LoraConfig, get_peft_model

    model = hf_model(base_dir)
    pm = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                # B is the one PEFT zeroes by default: both get entries of 1/sqrt(fan-in) size, so
                # the delta is as large as the base weights' (initializer_range 0.15) at any rank.
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    pm = pm.to(dtype).eval()
    pm.save_pretrained(out_dir, safe_serialization=True)
    assert (out_dir / "adapter_model.safetensors").is_file()
    return pm, out_dir
