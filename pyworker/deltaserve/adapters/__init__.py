"""Variant deltas applied on top of the base model.

Layout:

- ``lora``  PEFT LoRA directories -> validated ``LoraAdapter`` (per layer and projection ``A [r, in]``,
            ``B [out, r]``, rank, alpha, scaling), plus the torch references ``lora_delta_ref`` and
            ``merged_weight`` that kernels and serving are tested against.
- ``lora_layers``  serving them: ``attach_lora(model, adapters) -> LoraStep`` wraps the targeted block
            linears in ``LoraLinear`` (base + per-token adapter delta); the executor sets the
            step's token -> adapter map before each forward.
"""

from .lora import LoraAdapter, LoraAdapterError, LoraWeights, load_lora_adapter, lora_delta_ref, merged_weight
from .lora_layers import NO_ADAPTER, LoraLinear, LoraStep, attach_lora

__all__ = [
    "LoraAdapter", "LoraAdapterError", "LoraWeights", "load_lora_adapter", "lora_delta_ref", "merged_weight",
    "NO_ADAPTER", "LoraLinear", "LoraStep", "attach_lora",
]  # fmt: skip
