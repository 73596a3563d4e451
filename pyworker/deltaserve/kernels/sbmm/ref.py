"""``sbmm_ref``: the torch reference of SBMM and its CPU path (one matmul per delta over its tokens)."""

from __future__ import annotations

import torch

from .checks import check_call
from .layout import DeltaWeights
from .meta import DeltaMeta


def sbmm_ref(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> torch.Tensor:
    """Torch reference and CPU path of ``sbmm``: per delta, ``dequantize`` (packed_delta.py) then one matmul."""
    check_call(x, out, w, meta)
    for d, toks in meta.slot_tokens:
        tok = torch.tensor(toks, dtype=torch.long, device=meta.seg_start.device)
        delta = w.reference_delta(d, x.dtype)  # [out, in], at x's precision like the kernel
        out[tok] = (out[tok].float() + x[tok].float() @ delta.T).to(out.dtype)
    return out
