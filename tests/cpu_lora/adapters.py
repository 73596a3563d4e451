"""The two PEFT adapters of the tiny Llama that the CPU-assist tests prefill with: q/v at rank 8,
and all seven projections at rank 16 with rsLoRA. Each test module draws its own (``seed``)."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.peft_adapters import SEVEN, make_peft_adapter

SPECS = {
    1: dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16),
    2: dict(target_modules=SEVEN, r=16, lora_alpha=8, use_rslora=True),
}


def make_adapters(tiny_llama: Path, root: Path, seed: int) -> dict[int, tuple[Path, torch.nn.Module]]:
    """``id -> (directory, the peft model)`` for :data:`SPECS`, adapter ``id`` drawn from ``seed + id``."""
    return {
        aid: make_peft_adapter(tiny_llama, root / f"a{aid}", seed=seed + aid, **kw)[::-1] for aid, kw in SPECS.items()
    }
