"""Torch references of the multi-LoRA ops, also their CPU path: a loop per adapter over gathered rows."""

from __future__ import annotations

import torch

from ..segments import tokens_by_slot
from .checks import check_call, check_out
from .layout import LoraWeights
from .meta import LoraMeta


def _token_groups(meta: LoraMeta) -> dict[int, torch.Tensor]:
    """Token indices per adapter (-1 left out), from the host copy of the metadata."""
    groups = tokens_by_slot(meta.seg_start_host, meta.seg_adapter_host)
    return {a: torch.tensor(t, dtype=torch.long, device=meta.seg_start.device) for a, t in groups.items()}


def _gather_rows(pool: torch.Tensor, offsets: torch.Tensor, dim: int) -> torch.Tensor:
    """[r, dim] float32: rows ``pool[offsets[i] : offsets[i] + dim]``."""
    idx = offsets.to(torch.long)[:, None] + torch.arange(dim, device=pool.device)[None, :]
    return pool[idx].float()


def lora_shrink_ref(x: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> torch.Tensor:
    """Torch reference and CPU path of ``lora_shrink`` (the Semantics in ``kernels.lora``): gather + matmul
    per adapter."""
    check_call("lora_shrink", x, w, meta, w.in_dim, "in_dim")
    v = torch.zeros(x.shape[0], w.r_max, dtype=x.dtype, device=x.device)
    ranks = w.rank.tolist()
    for a, tok in _token_groups(meta).items():
        r = ranks[a]
        if r:
            v[tok, :r] = (x[tok].float() @ _gather_rows(w.a_pool, w.a_offsets[a, :r], w.in_dim).T).to(x.dtype)
    return v


def lora_expand_ref(v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> torch.Tensor:
    """Torch reference and CPU path of ``lora_expand``: ``out += scale * v B^T`` per adapter, in place."""
    check_call("lora_expand", v, w, meta, w.r_max, "r_max")
    check_out("lora_expand", out, w, meta)
    ranks, scales = w.rank.tolist(), w.scale.tolist()
    for a, tok in _token_groups(meta).items():
        r = ranks[a]
        if r:
            delta = v[tok, :r].float() @ _gather_rows(w.b_pool, w.b_offsets[a, :r], w.out_dim)
            out[tok] = (out[tok].float() + scales[a] * delta).to(out.dtype)
    return out
