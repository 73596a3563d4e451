"""Variant deltas applied on top of the base model.

Layout:

- ``lora``  PEFT LoRA directories -> validated ``LoraAdapter`` (per layer and projection ``A [r, in]``,
            ``B [out, r]``, rank, alpha, scaling), plus the torch references ``lora_delta_ref`` and
            ``merged_weight`` that kernels and serving are tested against.
"""

from .lora import LoraAdapter, LoraAdapterError, LoraWeights, load_lora_adapter, lora_delta_ref, merged_weight

__all__ = ["LoraAdapter", "LoraAdapterError", "LoraWeights", "load_lora_adapter", "lora_delta_ref", "merged_weight"]
