"""Adapted linears inside ``DecoderLM``: the base matmul, then the LoRA kernels over the adapter pool.

``attach_lora(model, step, weights)`` turns every block linear (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj`` of every layer) into a ``LoraLinear`` that computes::

    out = x @ W.T + bias                                  the base, once for all tokens
    if step.meta is not None:                             the step has adapter tokens
        kernels.lora.lora_delta_stacked(x, out, stack, step.meta)     decode: two launches per module
                                                                       (MBGMV; fused.py: one); prefill: two (SGMV);
                                                                       mixed: SGMV for the chunk, MBGMV for decode rows
    (both lines are ``kernels.lora.lora_linear_stacked``: in a CUDA graph being captured it runs
    the shrinks on a side stream beside the base matmul, the same bits)
            for each output slice (q|k|v, o, gate|up, down) of the module (``linear_slots``):
                out[t, slice] += scale[a, l, s] * (x[t] A_a^T) B_a^T      for token t of slot a

``stack`` is built once per module: ``kernels.lora.LoraStack.from_slices`` over one
``LoraSlice(offset, size, weights)`` per HF projection the module holds, ``weights`` the
``kernels.lora.LoraWeights`` of that (layer, projection) over the adapter pool's static tables and
the layer's flat KV view (``adapters/lora_pool.py``). The pool's per-projection tables of one module are
views of its stacked tables a uniform stride apart, so the stack is a view of them too (no copy:
the pool's in-place refills reach it, and CUDA graphs keep its pointers). The pool fills the tables
and sets ``step.meta`` per step; the model does not change: it calls ``self_attn.qkv_proj(x)`` as
before, and knows nothing about adapters.

A step with no adapter tokens (``step.meta`` None) runs only the base matmul: no extra op.
With ``step.assist`` set (a cold adapter's prefill whose LoRA the CPU helpers compute,
``helpers/assist.py``), its rows go to the helpers before the base matmul (``assist.send``) and
their results are added after it (``assist.add``). That is
also what CUDA-graph capture records today, so captured decode graphs serve base-only steps.

The kernels dispatch by device: Triton on CUDA, their torch references (``lora_*_ref``) on CPU.

A ``LoraLinear`` adopts the wrapped ``nn.Linear``'s ``weight`` and ``bias`` Parameters (the same
tensors, no copy) instead of holding it as a child module, so parameter names, ``state_dict``,
``checkpoint_layout`` and parameter counts are exactly those of the unadapted model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.lora import LoraMeta, LoraSlice, LoraStack, LoraWeights, lora_linear_stacked
from ..model.decoder import DecoderLM, linear_slots


class LoraAssist(Protocol):
    """What a ``LoraLinear`` calls when CPU helpers compute some rows' LoRA (``helpers.assist.CpuAssist``)."""

    def send(self, layer: int, module_path: str, x: torch.Tensor) -> Any | None: ...

    def add(self, pending: Any, out: torch.Tensor) -> torch.Tensor: ...


class LoraStep:
    """The current step's adapter metadata, shared by every ``LoraLinear`` of a model.

    Set by the adapter pool before a forward (``LoraPool.begin_step``) and cleared after it;
    while ``meta`` is None every ``LoraLinear`` is exactly its base linear.
    """

    def __init__(self) -> None:
        self.meta: LoraMeta | None = None
        """Which tokens use which table slot this step (SGMV / MBGMV); None: no adapter tokens."""
        self.assist: LoraAssist | None = None
        """Set for a step whose cold adapters' rows the CPU helpers compute; None otherwise."""

    @property
    def active(self) -> bool:
        """True when some token of the current step uses an adapter."""
        return self.meta is not None


class LoraLinear(nn.Linear):
    """A block linear plus the LoRA delta of each token's adapter (module docstring)."""

    def __init__(
        self, base: nn.Linear, step: LoraStep, stack: LoraStack, layer: int = -1, module_path: str = ""
    ) -> None:
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        # The base's own Parameters (same tensors): names and state_dict stay those of the plain model.
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.step = step
        """The per-step metadata, shared with the adapter pool and the other LoraLinears."""
        self.stack = stack
        """The adapted slices (one per HF projection this module holds, in output-row order) with
        their stacked tables: one shrink and one expand launch per forward."""
        self.layer = layer
        """Decoder layer index (what the CPU helpers' jobs name)."""
        self.module_path = module_path
        """Path inside the layer, e.g. ``self_attn.qkv_proj``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assist = self.step.assist
        pending = None if assist is None else assist.send(self.layer, self.module_path, x)
        meta = self.step.meta
        if meta is None:
            out = F.linear(x, self.weight, self.bias)
        else:
            if x.dim() != 2:
                raise ValueError(f"LoraLinear: expected [tokens, {self.in_features}] input, got {list(x.shape)}")
            out = lora_linear_stacked(x, self.weight, self.bias, self.stack, meta)
        if pending is not None:
            assert assist is not None
            out = assist.add(pending, out)
        return out

    def extra_repr(self) -> str:
        cols = ", ".join(f"{o}:{o + d}" for o, d in zip(self.stack.out_offsets, self.stack.out_dims))
        return f"in_features={self.in_features}, out_features={self.out_features}, lora_slices=[{cols}]"


def attach_lora(model: DecoderLM, step: LoraStep, weights: Mapping[tuple[int, str], LoraWeights]) -> None:
    """Wraps every block linear of ``model`` in a ``LoraLinear`` reading ``step``.

    ``weights``: (layer, HF projection name) -> that projection's kernel weights, for every layer
    and every name of ``linear_slots(model.config)`` (the adapter pool's ``weights``); the
    projections of one module are stacked (``LoraStack.from_slices``: views, no copy). Raises
    ValueError when one is missing, has the wrong dims, cannot be stacked with the module's other
    projections, or the model already has LoRA attached.
    """
    cfg = model.config
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
            slices = []
            for proj in projs:
                w = weights.get((i, proj))
                s = slots[proj]
                if w is None:
                    raise ValueError(f"attach_lora: no LoRA weights for layer {i} {proj}")
                if (w.in_dim, w.out_dim) != (base.in_features, s.size):
                    raise ValueError(
                        f"attach_lora: layer {i} {proj}: weights are [{w.in_dim} -> {w.out_dim}], the module "
                        f"needs [{base.in_features} -> {s.size}]"
                    )
                slices.append(LoraSlice(s.start, s.size, w))
            try:
                stack = LoraStack.from_slices(slices)
            except ValueError as e:
                raise ValueError(f"attach_lora: layer {i} {module_path}: {e}") from None
            setattr(parent, leaf, LoraLinear(base, step, stack, i, module_path))
