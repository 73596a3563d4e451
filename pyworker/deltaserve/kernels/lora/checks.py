"""What the multi-LoRA entry points check of a call against its weights and metadata (host state only)."""

from __future__ import annotations

import torch

from .layout import LoraWeights
from .meta import LoraMeta


def check_call(op: str, x: torch.Tensor, w: LoraWeights, meta: LoraMeta, width: int, width_name: str) -> None:
    """Raises ValueError naming the first problem of ``op``'s input ``x`` ([T, ``width``]) with ``w`` and
    ``meta``: shape, dtype, device, adapter ids past the weights' slots."""
    if x.dim() != 2 or x.shape[0] != meta.num_tokens:
        raise ValueError(f"{op}: input {list(x.shape)} must be [T = {meta.num_tokens}, {width_name}]")
    if x.shape[1] != width:
        raise ValueError(f"{op}: input has {x.shape[1]} columns, the weights want {width_name} = {width}")
    if x.dtype != w.a_pool.dtype:
        raise ValueError(f"{op}: dtype mismatch: input {x.dtype}, adapter weights {w.a_pool.dtype}")
    if x.device != w.a_pool.device or x.device != meta.seg_start.device:
        raise ValueError(f"{op}: input on {x.device}, weights on {w.a_pool.device}, meta on {meta.seg_start.device}")
    if meta.max_adapter >= w.num_adapters:
        raise ValueError(f"{op}: adapter id {meta.max_adapter} out of range (the weights have {w.num_adapters} slots)")


def check_out(op: str, out: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> None:
    """Raises ValueError naming the first problem of ``op``'s output ``out`` ([T, out_dim], updated in place)."""
    if out.dim() != 2 or out.shape != (meta.num_tokens, w.out_dim):
        raise ValueError(f"{op}: out {list(out.shape)} must be [T = {meta.num_tokens}, out_dim = {w.out_dim}]")
    if out.dtype != w.b_pool.dtype:
        raise ValueError(f"{op}: dtype mismatch: out {out.dtype}, adapter weights {w.b_pool.dtype}")
    if out.stride(-1) != 1:
        raise ValueError(f"{op}: out needs a contiguous last dim (it is updated in place)")
