"""``RMSNorm`` in the two conventions of the architecture table, optionally fused with a residual add.

- Llama (default): HF's ``LlamaRMSNorm``: normalise in float32, round to the input dtype, then
  ``weight * x`` (``kernels.rmsnorm``: Triton on CUDA, its torch reference elsewhere).
- Gemma (``unit_offset``): ``GemmaRMSNorm``: normalise in float32, multiply by ``1 + weight`` in
  float32, round once. The stored weight is HF's (zero-centred); torch ops on every device.

Both take an optional ``row_delta`` ``(table [S, N], index [rows])``: row t's weight is
``weight + table[index[t]]`` (the delta wrappers' ``w + Δw``), broadcast over heads when ``x`` is
``[rows, heads, N]`` (q/k norms); Llama's convention gathers and adds it inside the norm kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.rmsnorm import RowDelta, fused_add_rmsnorm, rmsnorm, row_weights


class RMSNorm(nn.Module):
    """HF-identical RMSNorm (module docstring), optionally fused with the residual add before it."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype | None = None, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.eps = eps
        self.unit_offset = unit_offset
        """Gemma's ``x * (1 + weight)`` in float32 (module docstring)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, row_delta: RowDelta | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if not self.unit_offset:
            if residual is None:
                return rmsnorm(x, self.weight, self.eps, row_delta)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps, row_delta)
        if residual is not None:
            residual = x + residual  # in the model dtype, as HF adds
            x = residual
        weight = self.weight if row_delta is None else row_weights(self.weight, row_delta, x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * (1.0 + weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)
