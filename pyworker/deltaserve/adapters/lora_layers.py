"""Serving loaded LoRA adapters: adapted linears inside ``DecoderLM`` and the per-step token->adapter map.

``attach_lora(model, adapters)`` turns each block linear that some adapter targets into a
``LoraLinear`` and returns the ``LoraStep`` all of them read; the executor fills the step before
each forward. The decoder itself does not change: it calls ``self_attn.qkv_proj(x)`` as before. ::

    attach_lora(model, {1: A, 2: B})           adapter id -> slot (ids sorted: 1 -> 0, 2 -> 1)
        for each layer i, each module m in (qkv_proj, o_proj, gate_up_proj, down_proj):
            slices of m targeted by some adapter in layer i?  ->  m := LoraLinear(m)
    per step:   step.set_segments([(adapter_id, n_tokens), ...])    in ForwardBatch token order
                model.forward(...)                                  every LoraLinear reads step
                step.clear()
    LoraLinear.forward(x)  [T, in]:
        out = x @ W.T + bias                                        the base, once for all tokens
        for each slot s present in the step (rows R_s of its tokens, gathered once per module):
            xs = x[R_s]
            for each output slice (start, size) of this module that adapter s adapts:
                out[R_s, start:start+size] += scaling * (xs @ A.T) @ B.T      (PEFT's lora.Linear)

A step with no adapter tokens (``step.active`` false) runs only the base matmul: no gather, no
extra op. That is also what CUDA-graph capture records, so captured decode graphs stay valid for
base-only steps; the executor runs steps with adapter tokens eagerly.

Output slices come from ``linear_slots`` (the decoder's one statement of how q/k/v and gate/up are
stacked), so a delta for ``k_proj`` lands in rows ``[q_size, q_size + kv_size)`` of the fused qkv.

A ``LoraLinear`` adopts the wrapped ``nn.Linear``'s ``weight`` and ``bias`` Parameters (the same
tensors, no copy) instead of holding it as a child module, so parameter names, ``state_dict``,
``checkpoint_layout`` and parameter counts are exactly those of the unadapted model. Adapter
factors are plain tensor attributes (not parameters or buffers), moved to the model's device and
dtype once in ``attach_lora``.

This is the torch reference path (gather + two small matmuls per adapter and slice). The Triton
SGMV/MBGMV kernels (``kernels/lora.py``) and the paged adapter pool replace its inner loop later,
behind the same ``LoraStep`` interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..model.decoder import DecoderLM, linear_slots
from .lora import LoraAdapter

#: Sentinel slot of tokens that use no adapter (the base model alone).
NO_ADAPTER = -1


class LoraStep:
    """Which adapter each token of the current step uses; shared by every ``LoraLinear`` of a model.

    Set by the executor before a forward (``set_segments``) and cleared after it (``clear``). While
    clear, every ``LoraLinear`` is exactly its base linear.
    """

    def __init__(self, slot_of: dict[int, int], device: torch.device) -> None:
        self.slot_of = dict(slot_of)
        """Adapter id (the wire's ``adapter_id``, > 0) -> slot index into each LoraLinear's factors."""
        self.device = device
        """Where the row-index tensors are built (the model's device)."""
        self.token_slots: torch.Tensor | None = None
        """[T] int64 on ``device``: each token's slot, NO_ADAPTER for base tokens; None while clear."""
        self.groups: list[tuple[int, torch.Tensor]] = []
        """(slot, [n] int64 token rows on ``device``) for each distinct slot present, base excluded."""

    @property
    def active(self) -> bool:
        """True when some token of the current step uses an adapter."""
        return bool(self.groups)

    def set_segments(self, segments: Sequence[tuple[int, int]]) -> None:
        """The step's tokens as consecutive runs ``(adapter_id, num_tokens)`` (0 = base), in batch order.

        Raises KeyError naming an adapter id that was not attached (the executor validates ids
        first, so this is a bug guard).
        """
        slots: list[int] = []
        rows: dict[int, list[int]] = {}
        for adapter_id, n in segments:
            if adapter_id == 0:
                slot = NO_ADAPTER
            elif adapter_id in self.slot_of:
                slot = self.slot_of[adapter_id]
            else:
                raise KeyError(f"LoraStep: adapter id {adapter_id} is not attached (have {sorted(self.slot_of)})")
            if slot != NO_ADAPTER and n > 0:
                rows.setdefault(slot, []).extend(range(len(slots), len(slots) + n))
            slots.extend([slot] * n)
        if not rows:
            self.clear()
            return
        self.token_slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.groups = [(slot, torch.tensor(r, dtype=torch.long, device=self.device)) for slot, r in sorted(rows.items())]

    def clear(self) -> None:
        """No adapter tokens: every LoraLinear computes the base alone."""
        self.token_slots = None
        self.groups = []


@dataclass(frozen=True, eq=False)
class SliceFactors:
    """One adapter's factors for one output slice of a (fused) linear."""

    start: int
    """First output row of the slice in the fused module (``linear_slots``)."""
    size: int
    """Output rows of the slice (== ``b.shape[0]``)."""
    a: torch.Tensor
    """``lora_A`` [rank, in_features], on the model's device and dtype."""
    b: torch.Tensor
    """``lora_B`` [size, rank], on the model's device and dtype."""
    scaling: float
    """``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA)."""


class LoraLinear(nn.Linear):
    """A block linear plus the LoRA deltas of the adapters the current ``LoraStep`` selects per token."""

    def __init__(self, base: nn.Linear, step: LoraStep, factors: dict[int, list[SliceFactors]]) -> None:
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        # The base's own Parameters (same tensors): names and state_dict stay those of the plain model.
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.step = step
        """The per-step token -> adapter-slot map, shared with the executor and the other LoraLinears."""
        self.factors = factors
        """Slot -> the factors of each output slice that adapter adapts here (slots without any: absent)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        step = self.step
        if not step.active:
            return out
        if x.dim() != 2:
            raise ValueError(f"LoraLinear: expected [tokens, {self.in_features}] input, got {list(x.shape)}")
        for slot, rows in step.groups:
            slices = self.factors.get(slot)
            if not slices:
                continue
            xs = x.index_select(0, rows)
            for f in slices:
                delta = ((xs @ f.a.T) @ f.b.T) * f.scaling
                out[:, f.start : f.start + f.size].index_add_(0, rows, delta)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, adapter_slots={sorted(self.factors)}"


def attach_lora(model: DecoderLM, adapters: dict[int, LoraAdapter]) -> LoraStep:
    """Wraps every block linear of ``model`` that some adapter targets; returns the shared step map.

    ``adapters``: adapter id (> 0, as requests name it) -> adapter validated against this model's
    config (``load_lora_adapter(dir, model.config, ...)``). Slots are assigned in id order. Factors
    are copied to the model's device and dtype here, once. Raises ValueError for an adapter made for
    another shape of model, or when the model already has LoRA attached.
    """
    cfg = model.config
    device, dtype = model.device, model.dtype
    for adapter_id, adapter in adapters.items():
        if isinstance(adapter_id, bool) or not isinstance(adapter_id, int) or adapter_id <= 0:
            raise ValueError(f"attach_lora: adapter id {adapter_id!r} must be a positive integer (0 is the base model)")
        if adapter.num_layers != cfg.num_layers:
            raise ValueError(
                f"attach_lora: adapter {adapter_id} ({adapter.path}) was validated for {adapter.num_layers} layers, "
                f"the model has {cfg.num_layers}"
            )
    slot_of = {adapter_id: slot for slot, adapter_id in enumerate(sorted(adapters))}
    step = LoraStep(slot_of, device)
    slots = linear_slots(cfg)
    by_module: dict[str, list[str]] = {}
    for proj, s in slots.items():
        by_module.setdefault(s.module, []).append(proj)

    for i, layer in enumerate(model.model.layers):
        for module_path, projs in by_module.items():
            parent_path, _, leaf = module_path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            base = getattr(parent, leaf)
            if isinstance(base, LoraLinear):
                raise ValueError(f"attach_lora: layer {i} {module_path} already has LoRA attached")
            factors: dict[int, list[SliceFactors]] = {}
            for adapter_id, adapter in adapters.items():
                for proj in projs:
                    w = adapter.get(i, proj)
                    if w is None:
                        continue
                    s = slots[proj]
                    if tuple(w.a.shape) != (w.rank, base.in_features) or tuple(w.b.shape) != (s.size, w.rank):
                        raise ValueError(
                            f"attach_lora: adapter {adapter_id} ({adapter.path}) layer {i} {proj}: A {list(w.a.shape)} / "
                            f"B {list(w.b.shape)} do not fit [{w.rank}, {base.in_features}] / [{s.size}, {w.rank}]"
                        )
                    factors.setdefault(slot_of[adapter_id], []).append(
                        SliceFactors(
                            start=s.start,
                            size=s.size,
                            a=w.a.to(device=device, dtype=dtype).contiguous(),
                            b=w.b.to(device=device, dtype=dtype).contiguous(),
                            scaling=w.scaling,
                        )
                    )
            if factors:
                setattr(parent, leaf, LoraLinear(base, step, factors))
    return step
