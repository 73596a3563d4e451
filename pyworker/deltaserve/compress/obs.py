"""The one-layer solver of ΔCompress: joint 2:4 pruning + group quantization with OBS updates (SparseGPT).

Given a target matrix ``W [out, in]`` (the delta ``Δ = W_ft − W_base``, or the full weight for the
SparseGPT baseline) and the Hessian of the layer's calibration inputs ``H = (2/n) Σ x xᵀ [in, in]``,
``obs_compress`` finds a 2:4 mask M and codes Q (``packed format``: asymmetric, per row and group of
``G`` input columns) that approximately minimise ``‖W X − (Q⊙M) X‖²``::

    dead columns (H_ii = 0): H_ii = 1, W[:, i] = 0
    H += percdamp · mean(diag H) · I                    (damping, 1% by default)
    U  = chol(H⁻¹)ᵀ   (upper)                           rows of U drive the error propagation
    for each block of B columns [i1, i2)  (B = 128, rounded so quant groups never straddle blocks):
        for each column i (in order):
            i % G == 0:  scale, zero of rows from the group's current values [i, i+G)
            i % 4 == 0:  keep, per row, the 2 of columns [i, i+4) with the largest w² / U_ii²
            q   = dequant(quant(w_i)) where kept, 0 where pruned
            e   = (w_i − q) / U_ii
            W[:, i:i2] −= e ⊗ U[i, i:i2]                (OBS update of the block's later columns)
        W[:, i2:] −= E_block · U[i1:i2, i2:]            (lazy update of everything after the block)

This is ``deltazip/core/sparsegpt.py`` (and GPTQ's group quantizer) written once for one layer;
``rtn_compress`` is the naive baseline it is tested against (magnitude 2:4 + round to nearest
with the same quantizer). ``layer_objective`` measures ``‖(W − W̃) X‖² / ‖W X‖²`` from H.

Scales are float16 in the format, so the solver quantizes with the float16-rounded scale (rounded
up, so the group's range still fits) and integer zeros: what it optimises is exactly what
``pack.dequantize`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BLOCK_SIZE = 128
"""SparseGPT column block (the DeltaZip artifact's ``--block-size 128``)."""
DEFAULT_PERCDAMP = 0.01
"""Hessian damping as a fraction of its mean diagonal (the artifact's ``--perc-damp 0.01``)."""
_FP16_TINY = 2.0**-24
"""Smallest positive float16 (subnormal): the floor of a stored scale."""


@dataclass
class QuantResult:
    """One compressed layer, ready for ``pack.pack``."""

    codes: torch.Tensor
    """int32 ``[out, in]`` in ``[0, 2^bits − 1]``; meaningless where ``mask`` is False."""
    mask: torch.Tensor | None
    """bool ``[out, in]`` 2:4 keep mask, or None when dense."""
    scales: torch.Tensor
    """float16 ``[out, in / group_size]``."""
    zeros: torch.Tensor
    """float16 ``[out, in / group_size]`` (integers in code units)."""
    dequant: torch.Tensor
    """float32 ``[out, in]``: ``(codes − zeros) · scales`` where kept, else 0 (equals ``pack.dequantize``)."""


def group_params(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric (scale, zero) per row of ``x [out, g]`` (GPTQ's min/max quantizer, 0 always in range).

    Returns float32 tensors ``[out]`` whose values are exactly representable in float16: the scale
    is rounded up to float16 (floor ``2^-24``), the zero is an integer in ``[0, 2^bits − 1]``.
    """
    maxq = (1 << bits) - 1
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    flat = (xmin == 0) & (xmax == 0)
    xmin = torch.where(flat, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(flat, torch.full_like(xmax, 1.0), xmax)
    scale = (xmax - xmin) / maxq
    s16 = scale.to(torch.float16)
    s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    scale = s16.float().clamp(min=_FP16_TINY)
    zero = torch.round(-xmin / scale).clamp(0, maxq)
    return scale, zero


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``clamp(round(x / scale) + zero, 0, 2^bits − 1)`` as float32.

    ``scale`` / ``zero`` have ``x``'s shape (one per value) or ``x``'s shape without its last
    dimension (one per row of the last dimension).
    """
    maxq = (1 << bits) - 1
    if scale.dim() != x.dim():
        scale, zero = scale.unsqueeze(-1), zero.unsqueeze(-1)
    return torch.clamp(torch.round(x / scale) + zero, 0, maxq)


def _check(w: torch.Tensor, bits: int, sparse: bool, group_size: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"compress: weight must be 2-D [out, in], got {list(w.shape)}")
    if bits not in (2, 4):
        raise ValueError(f"compress {list(w.shape)}: bits must be 2 or 4, got {bits}")
    cols = w.shape[1]
    if group_size <= 0 or group_size % 4 != 0 or cols % group_size != 0:
        raise ValueError(
            f"compress {list(w.shape)}: group_size {group_size} must be a positive multiple of 4 dividing "
            f"in_features {cols}"
        )
    if sparse and cols % 4 != 0:
        raise ValueError(f"compress {list(w.shape)}: 2:4 sparsity needs in_features % 4 == 0")


def obs_compress(
    w: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    sparse: bool,
    group_size: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    percdamp: float = DEFAULT_PERCDAMP,
) -> QuantResult:
    """SparseGPT/OBS joint 2:4 + quantization of ``w [out, in]`` under ``hessian [in, in]`` (module docstring).

    Runs on ``w``'s device in float32; ``hessian`` is not modified.
    """
    _check(w, bits, sparse, group_size)
    rows, cols = w.shape
    if tuple(hessian.shape) != (cols, cols):
        raise ValueError(
            f"compress {list(w.shape)}: hessian has shape {list(hessian.shape)}, expected [{cols}, {cols}]"
        )
    dev = w.device
    W = w.detach().to(torch.float32).clone()
    H = hessian.detach().to(device=dev, dtype=torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    damp = percdamp * torch.mean(torch.diag(H))
    idx = torch.arange(cols, device=dev)
    H[idx, idx] += damp
    L = torch.linalg.cholesky(H)
    Hinv = torch.cholesky_inverse(L)
    U = torch.linalg.cholesky(Hinv, upper=True)
    del H, L, Hinv

    # Quantization groups must not straddle column blocks (their params are read from the block).
    if block_size % group_size != 0:
        block_size = group_size * max(1, block_size // group_size)
    n_groups = cols // group_size
    scales = torch.zeros(rows, n_groups, dtype=torch.float32, device=dev)
    zeros = torch.zeros(rows, n_groups, dtype=torch.float32, device=dev)
    codes = torch.zeros(rows, cols, dtype=torch.float32, device=dev)
    keep = torch.ones(rows, cols, dtype=torch.bool, device=dev)
    Q = torch.zeros(rows, cols, dtype=torch.float32, device=dev)
    scale = zero = torch.zeros(rows, device=dev)

    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()
        U1 = U[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        diag1 = torch.diag(U1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                g = col // group_size
                scale, zero = group_params(W1[:, i : i + group_size], bits)
                scales[:, g], zeros[:, g] = scale, zero
            if sparse and col % 4 == 0:
                saliency = W1[:, i : i + 4] ** 2 / diag1[i : i + 4].unsqueeze(0) ** 2
                pruned = saliency.topk(2, dim=1, largest=False).indices
                keep[:, col : col + 4].scatter_(1, pruned, False)
            wcol = W1[:, i]
            c = quantize_codes(wcol, scale, zero, bits)
            q = torch.where(keep[:, col], (c - zero) * scale, torch.zeros_like(wcol))
            codes[:, col], Q[:, col] = c, q
            err = (wcol - q) / diag1[i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    codes_i = codes.to(torch.int32)
    if sparse:
        codes_i = torch.where(keep, codes_i, torch.zeros_like(codes_i))
    return QuantResult(
        codes=codes_i,
        mask=keep if sparse else None,
        scales=scales.to(torch.float16),
        zeros=zeros.to(torch.float16),
        dequant=Q,
    )


def rtn_compress(w: torch.Tensor, bits: int, sparse: bool, group_size: int) -> QuantResult:
    """The naive baseline: magnitude 2:4 pruning (keep the 2 largest |w| of each 4) + round to nearest.

    Same quantizer and group params as ``obs_compress`` (from the group's values), no Hessian, no
    error propagation.
    """
    _check(w, bits, sparse, group_size)
    rows, cols = w.shape
    W = w.detach().to(torch.float32)
    keep = torch.ones(rows, cols, dtype=torch.bool, device=W.device)
    if sparse:
        top = W.abs().reshape(rows, cols // 4, 4).topk(2, dim=-1).indices
        keep = torch.zeros(rows, cols // 4, 4, dtype=torch.bool, device=W.device).scatter_(-1, top, True)
        keep = keep.reshape(rows, cols)
    grouped = W.reshape(rows, cols // group_size, group_size)
    scale, zero = group_params(grouped.reshape(-1, group_size), bits)
    scale, zero = scale.view(rows, -1), zero.view(rows, -1)
    c = quantize_codes(grouped, scale, zero, bits)
    q = ((c - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(rows, cols)
    q = torch.where(keep, q, torch.zeros_like(q))
    codes = torch.where(keep, c.reshape(rows, cols).to(torch.int32), 0)
    return QuantResult(
        codes=codes,
        mask=keep if sparse else None,
        scales=scale.to(torch.float16),
        zeros=zero.to(torch.float16),
        dequant=q,
    )


def layer_objective(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative layer error ``‖(W − W̃) X‖² / ‖W X‖²``, computed as ``tr(E H Eᵀ) / tr(W H Wᵀ)`` (H undamped).

    Returns the absolute ``tr(E H Eᵀ)`` (= ``(2/n)‖(W − W̃) X‖²``) when ``‖W X‖`` is 0.
    """
    H = hessian.to(device=w.device, dtype=torch.float32)
    e = w.float() - w_hat.float()
    num = float(((e @ H) * e).sum())
    den = float(((w.float() @ H) * w.float()).sum())
    return num / den if den > 0 else num
