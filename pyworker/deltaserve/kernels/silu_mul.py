"""SiLU-and-mul, the SwiGLU activation over a fused gate_up projection output (Triton).

The MLP's ``gate_up_proj`` writes ``[gate | up]`` side by side; this op reads both halves once and
writes their product, instead of three elementwise passes (silu, mul) over separate tensors.
Numerics are HF's ``act_fn(gate) * up`` in the input dtype: silu is computed in float32 and
rounded to the dtype, then the product is rounded to it.

Semantics::

    for t in range(T):
        gate, up = gate_up[t, :I], gate_up[t, I:]
        out[t] = dtype(dtype(gate / (1 + exp(-gate))) * up)

Shape:
    gate_up: [..., 2 * I]   float32 / float16 / bfloat16, last dim contiguous; gate first, then up
    out:     [..., I]       dtype of gate_up, contiguous

Entry point ``silu_and_mul`` runs the Triton kernel on CUDA tensors (or when ``use_triton=True``:
CPU tensors then need ``TRITON_INTERPRET=1``) and ``silu_and_mul_ref``, the CPU path, otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import needs_rne_by_hand, round_to, want_triton

_BLOCK = 1024
"""Columns per program: a row of Llama-2-7B's I = 11008 is 11 programs."""


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference and CPU path (module docstring)."""
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :i]) * gate_up[..., i:]


@triton.jit
def _silu_mul_kernel(in_ptr, out_ptr, in_stride, out_stride, I, BLOCK: tl.constexpr, RNE: tl.constexpr):  # noqa: E741
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    ty = out_ptr.dtype.element_ty
    g = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(in_ptr + row * in_stride + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), ty, RNE)  # HF rounds silu's output to the dtype
    tl.store(out_ptr + row * out_stride + cols, round_to(act * u, ty, RNE).to(ty), mask=mask)


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: gate_up {list(gate_up.shape)} must have an even last dim [gate | up]")


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton kernel for ``silu_and_mul`` (no dispatch)."""
    _check(gate_up)
    two_i = gate_up.shape[-1]
    i = two_i // 2
    x = gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((*gate_up.shape[:-1], i), dtype=gate_up.dtype, device=gate_up.device)
    rows = x.shape[0]
    if rows == 0 or i == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(i))
    grid = (rows, triton.cdiv(i, block))
    _silu_mul_kernel[grid](x, out, x.stride(0), i, i, BLOCK=block, RNE=needs_rne_by_hand(out), num_warps=4)
    return out


def silu_and_mul(gate_up: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (module docstring); Triton on CUDA, the reference elsewhere."""
    _check(gate_up)
    if want_triton("silu_and_mul", gate_up, use_triton):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)
