"""Variant deltas applied on top of the base model.

Layout:

- ``lora``  PEFT LoRA directories -> ``LoraSpec`` (validated from config and header: which tensor is
            which site, ranks, scalings; ``read_into`` reads values GIL-free, checked finite) and
            ``LoraAdapter`` (the spec plus ``A [r, in]``, ``B [out, r]`` on CPU), plus the torch
            references ``lora_delta_ref`` and ``merged_weight`` that kernels and serving are tested against.
- ``variants``  the seam: ``VariantPool``, the interface every kind's pool implements (inspect, apply
            an op, begin / end a step, host bytes, finished reads), ``StepRows``, ``VariantKind``.
- ``lora_pool``  LoRA adapters' tiers the router drives (``VariantOp``: host memory, pages of the KV
            pool), ``inspect`` for registration, and the per-step slot tables + ``LoraMeta`` the kernels
            read; ``lora_layout`` where an adapter's rows go in pages, and its host and GPU copies.
- ``lora_layers``  ``attach_lora(model, step, weights)`` wraps the block linears in ``LoraLinear``
            (base + ``kernels.lora.lora_delta_stacked`` over the pool when the step has adapter tokens).
- ``host_tier``  the host-memory tier both pools share: background loads by variant id, bytes, errors.
- ``delta_pool``  compressed full-fine-tune deltas (``deltaserve compress`` directories): their tiers
            (host memory, ``--max-deltas`` GPU slots), ``inspect``, and each step's delta rows.
- ``delta_blocks``  block slots: each layer's attention / FFN piece of the resident deltas held once
            (refcounted by payload file), so deltas sharing a block (zoo variants) run it as one group; the
            embedding and lm_head deltas likewise.
- ``delta_graphs``  the static per-piece buffers a captured delta decode step reads.
- ``delta_placements``  the delta slots as the plan check sees them.
- ``delta_layers``  ``attach_deltas(model, step)``: DeltaZip's decoupled forward, base once plus each
            token's delta (``kernels.sbmm`` for packed linears; dense embedding, norm, bias, lm_head deltas).
"""

from .delta_layers import DeltaLinear, DeltaStep, attach_deltas
from .delta_pool import DeltaError, DeltaPool
from .lora import LoraAdapter, LoraAdapterError, LoraWeights, load_lora_adapter, lora_delta_ref, merged_weight
from .lora_layers import LoraLinear, LoraStep, attach_lora
from .lora_pool import AdapterLayout, AdapterLoadError, AdapterPool, LoraPool
from .variants import StepRows, VariantKind, VariantPool

__all__ = [
    "LoraAdapter", "LoraAdapterError", "LoraWeights", "load_lora_adapter", "lora_delta_ref", "merged_weight",
    "LoraLinear", "LoraStep", "attach_lora", "AdapterLayout", "AdapterLoadError", "AdapterPool", "LoraPool",
    "StepRows", "VariantKind", "VariantPool",
    "DeltaLinear", "DeltaStep", "attach_deltas", "DeltaError", "DeltaPool",
]  # fmt: skip
