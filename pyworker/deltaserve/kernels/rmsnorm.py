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

    row_delta = (table, index), either op: row t's weight is its own (a compressed delta's norm
    delta, ``adapters.delta_layers.DeltaRMSNorm``), gathered and added in the kernel:
        weight_t = dtype(weight)(weight + table[index[t]])     # index[t] = 0: table's zero row
        out[t] = out_dtype(weight_t * n)
    For x of shape [rows, heads, N] (q / k norms) index has ``rows`` entries, each row's weight
    serving all of its heads.

Shape:
    x:            [..., N]   float32 / float16 / bfloat16, last dim contiguous
    residual:     [..., N]   same shape and dtype as ``x``
    weight:       [N]
    table:        [S, N]     weight.dtype           (row_delta)
    index:        [rows]     int64, rows = x.shape[0] (row_delta)
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

RowDelta = tuple[torch.Tensor, torch.Tensor]
"""(table [S, N], index [rows] int64): per-row weights ``weight + table[index[t]]`` (module docstring)."""


def row_weights(weight: torch.Tensor, row_delta: RowDelta, x: torch.Tensor) -> torch.Tensor:
    """The per-row weights of ``row_delta`` shaped to broadcast over ``x`` ([rows, 1, N] for
    [rows, heads, N])."""
    table, index = row_delta
    w = weight + table.index_select(0, index)
    return w.view(w.shape[0], *([1] * (x.dim() - 2)), w.shape[1])


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, row_delta: RowDelta | None = None) -> torch.Tensor:
    """Torch reference and CPU path (module docstring, ``rmsnorm``)."""
    in_dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight if row_delta is None else row_weights(weight, row_delta, x)) * xf.to(in_dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, row_delta: RowDelta | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference and CPU path (module docstring, ``fused_add_rmsnorm``)."""
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps, row_delta), new_residual


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, table_ptr, index_ptr,
    x_stride, res_stride, out_stride, res_out_stride, table_stride,
    N, eps, HEADS,
    HAS_RESIDUAL: tl.constexpr, ROW_DELTA: tl.constexpr, BLOCK: tl.constexpr,
    RNE_IN: tl.constexpr, RNE_OUT: tl.constexpr, RNE_W: tl.constexpr,
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
    if ROW_DELTA:  # this row's weight: weight + table[index[row // HEADS]], in the weight's dtype
        d = tl.load(index_ptr + row // HEADS)
        dw = tl.load(table_ptr + d * table_stride + cols, mask=mask, other=0.0).to(tl.float32)
        w = round_to(w + dw, w_ptr.dtype.element_ty, RNE_W)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * out_stride + cols, round_to(w * n, out_ty, RNE_OUT).to(out_ty), mask=mask)


def _check(
    name: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, row_delta: RowDelta | None
) -> None:
    if x.dim() < 1 or x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"{name}: x {list(x.shape)} and weight {list(weight.shape)} must share the last dim N")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"{name}: residual {list(residual.shape)} {residual.dtype} must match x {list(x.shape)} {x.dtype}"
        )
    if row_delta is not None:
        table, index = row_delta
        if table.dim() != 2 or table.shape[1] != weight.shape[0] or table.dtype != weight.dtype:
            raise ValueError(
                f"{name}: row_delta table {list(table.shape)} {table.dtype} must be [S, {weight.shape[0]}] {weight.dtype}"
            )
        if index.dim() != 1 or index.dtype != torch.int64 or x.dim() < 2 or index.shape[0] != x.shape[0]:
            raise ValueError(
                f"{name}: row_delta index {list(index.shape)} {index.dtype} must be int64 [{x.shape[0]}]: "
                f"one entry per row of x {list(x.shape)}"
            )


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, row_delta: RowDelta | None
):
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
    weight = weight.contiguous()
    if row_delta is not None:
        table, index = row_delta[0].contiguous(), row_delta[1]
        heads = rows // index.shape[0]
    else:
        table, index, heads = weight, weight, 1  # unused by the kernel (ROW_DELTA=False)
    _rmsnorm_kernel[(rows,)](
        x2, r2, weight, out2, ro2, table, index,
        x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), table.stride(0) if row_delta else 0,
        n, float(eps), heads,
        HAS_RESIDUAL=residual is not None, ROW_DELTA=row_delta is not None, BLOCK=block,
        RNE_IN=needs_rne_by_hand(x), RNE_OUT=needs_rne_by_hand(out), RNE_W=needs_rne_by_hand(weight),
        num_warps=num_warps,
    )  # fmt: skip
    return out, res_out


def rmsnorm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, row_delta: RowDelta | None = None
) -> torch.Tensor:
    """Triton kernel for ``rmsnorm`` (no dispatch)."""
    _check("rmsnorm", x, weight, None, row_delta)
    return _launch(x, None, weight, eps, row_delta)[0]


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, row_delta: RowDelta | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel for ``fused_add_rmsnorm`` (no dispatch)."""
    _check("fused_add_rmsnorm", x, weight, residual, row_delta)
    return _launch(x, residual, weight, eps, row_delta)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    row_delta: RowDelta | None = None,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``weight * rmsnorm(x)`` (module docstring); Triton on CUDA, the reference elsewhere."""
    if want_triton("rmsnorm", x, use_triton):
        return rmsnorm_triton(x, weight, eps, row_delta)
    return rmsnorm_ref(x, weight, eps, row_delta)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    row_delta: RowDelta | None = None,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual), x + residual)`` (module docstring); Triton on CUDA, the reference elsewhere."""
    if want_triton("fused_add_rmsnorm", x, use_triton):
        return fused_add_rmsnorm_triton(x, residual, weight, eps, row_delta)
    return fused_add_rmsnorm_ref(x, residual, weight, eps, row_delta)
