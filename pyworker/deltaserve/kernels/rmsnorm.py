"""RMSNorm, plain and fused with the residual add that precedes it (Triton, one program per row).

A pre-norm decoder block adds each sub-layer's output to the residual stream and normalises the sum
for the next sub-layer; fusing the two reads each row once and writes it twice (sum and norm).
Numerics are HF's ``LlamaRMSNorm`` exactly: the sum is rounded to the input dtype (HF adds in the
model dtype), the variance and the scaling are float32, the normalised row is rounded back to the
input dtype *before* it is multiplied by ``weight``, and that product is rounded to the output dtype.

Semantics::

    rmsnorm(x, weight, eps):
        for t in range(T):
            xf = float32(x[t])
            n = dtype(x)(xf * rsqrt(mean(xf ** 2) + eps))
            out[t] = out_dtype(weight * n)            # out_dtype = promote(weight.dtype, x.dtype)

    fused_add_rmsnorm(x, residual, weight, eps):
        for t in range(T):
            new_residual[t] = dtype(x)(x[t] + residual[t])
            normed[t] = rmsnorm(new_residual[t], weight, eps)
        return normed, new_residual

Shape:
    x:            [..., N]   float32 / float16 / bfloat16, last dim contiguous
    residual:     [..., N]   same shape and dtype as ``x``
    weight:       [N]
    normed/out:   [..., N]   promote(weight.dtype, x.dtype)
    new_residual: [..., N]   x.dtype

Entry points ``rmsnorm`` / ``fused_add_rmsnorm`` run the Triton kernel on CUDA tensors (or when
``use_triton=True``: CPU tensors then need ``TRITON_INTERPRET=1``) and the torch references
``rmsnorm_ref`` / ``fused_add_rmsnorm_ref`` otherwise; the references are the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import needs_rne_by_hand, round_to, want_triton


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference and CPU path (module docstring, ``rmsnorm``)."""
    in_dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(in_dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference and CPU path (module docstring, ``fused_add_rmsnorm``)."""
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    x_stride, res_stride, out_stride, res_out_stride,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, RNE_IN: tl.constexpr, RNE_OUT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    in_ty = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, in_ty, RNE_IN)  # HF adds in the model dtype
        tl.store(res_out_ptr + row * res_out_stride + cols, x.to(in_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / N
    n = round_to(x * tl.rsqrt(var + eps), in_ty, RNE_IN)  # HF rounds before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * out_stride + cols, round_to(w * n, out_ty, RNE_OUT).to(out_ty), mask=mask)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"{name}: x {list(x.shape)} and weight {list(weight.shape)} must share the last dim N")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"{name}: residual {list(residual.shape)} {residual.dtype} must match x {list(x.shape)} {x.dtype}"
        )


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, n)
    else:
        r2, res_out, ro2 = x2, None, x2  # unused by the kernel (HAS_RESIDUAL=False)
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    _rmsnorm_kernel[(rows,)](
        x2, r2, weight.contiguous(), out2, ro2,
        x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
        n, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        RNE_IN=needs_rne_by_hand(x), RNE_OUT=needs_rne_by_hand(out), num_warps=num_warps,
    )  # fmt: skip
    return out, res_out


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton kernel for ``rmsnorm`` (no dispatch)."""
    _check("rmsnorm", x, weight, None)
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel for ``fused_add_rmsnorm`` (no dispatch)."""
    _check("fused_add_rmsnorm", x, weight, residual)
    return _launch(x, residual, weight, eps)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None) -> torch.Tensor:
    """``weight * rmsnorm(x)`` (module docstring); Triton on CUDA, the reference elsewhere."""
    if want_triton("rmsnorm", x, use_triton):
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual), x + residual)`` (module docstring); Triton on CUDA, the reference elsewhere."""
    if want_triton("fused_add_rmsnorm", x, use_triton):
        return fused_add_rmsnorm_triton(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)
