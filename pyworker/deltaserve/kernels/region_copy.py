"""Region copy: many runs of one packed row scattered to their places in every layer's row, in one
launch (Triton). Placing a LoRA adapter in the KV pool's pages (``adapters/lora_pool.py``) copies each of
its regions, page halves in every layer, from the uploaded host copy; one ``copy_`` per region cost
the launching thread ~40 µs each (32 regions for a rank-64 q/k/v/o adapter of a 7B model), and the
launches queued behind a busy step.

Semantics::

    for l in range(L):
        for r in range(R):
            s, d, n = table[r]
            dst[l, d : d + n] = src[l, s : s + n]

Shape:
    src:   [L, P]   any dtype, rows contiguous
    dst:   [L, N]   the same dtype, rows contiguous (any row stride)
    table: [R, 3]   int64 host rows (src start, dst start, length); the source runs and the
                    destination runs must not overlap each other (the results would depend on order)
    table_dev:      optional, ``table`` already on dst's device (the caller's asynchronous copy);
                    without it the kernel path copies it there, which waits for the device's queue

Entry point ``copy_regions`` runs the Triton kernel on CUDA tensors (or when ``use_triton=True``:
CPU tensors then need ``TRITON_INTERPRET=1``) and ``copy_regions_ref`` (one ``copy_`` per region)
otherwise. The table is validated on the host, so a bad run is a ValueError and copies nothing
(``table_dev`` must hold the same rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import want_triton

_BLOCK = 4096
"""Elements per program: a page half of Llama-2-7B (16 tokens x 32 heads x 128) is 16 programs."""


def copy_regions_ref(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    """Torch reference and CPU path: one ``copy_`` per region (module docstring)."""
    for s, d, n in table.tolist():
        dst[:, d : d + n].copy_(src[:, s : s + n], non_blocking=True)


@triton.jit
def _copy_regions_kernel(src_ptr, dst_ptr, table_ptr, src_stride, dst_stride, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    s = tl.load(table_ptr + r * 3)
    d = tl.load(table_ptr + r * 3 + 1)
    n = tl.load(table_ptr + r * 3 + 2)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src_ptr + layer * src_stride + s + offs, mask=mask)
    tl.store(dst_ptr + layer * dst_stride + d + offs, v, mask=mask)


def _check(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    if src.dim() != 2 or dst.dim() != 2 or src.shape[0] != dst.shape[0]:
        raise ValueError(f"copy_regions: src {list(src.shape)} and dst {list(dst.shape)} must be [L, *] with one L")
    if src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(f"copy_regions: src ({src.dtype}, {src.device}) and dst ({dst.dtype}, {dst.device}) differ")
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError("copy_regions: src and dst rows must be contiguous")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 3 or table.device.type != "cpu":
        raise ValueError(
            f"copy_regions: table must be a host int64 [R, 3], got {table.dtype} {list(table.shape)} on {table.device}"
        )
    if table.numel() and (
        bool((table < 0).any())
        or bool((table[:, 0] + table[:, 2] > src.shape[1]).any())
        or bool((table[:, 1] + table[:, 2] > dst.shape[1]).any())
    ):
        raise ValueError(
            f"copy_regions: a run of the table is negative or past src ({src.shape[1]}) or dst ({dst.shape[1]}) columns"
        )


def copy_regions_triton(
    src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, table_dev: torch.Tensor | None = None
) -> None:
    """Triton kernel for ``copy_regions`` (no dispatch)."""
    _check(src, dst, table)
    longest = int(table[:, 2].max()) if table.numel() else 0
    if longest == 0 or src.shape[0] == 0:
        return
    block = min(_BLOCK, triton.next_power_of_2(longest))
    grid = (table.shape[0], triton.cdiv(longest, block), src.shape[0])
    if table_dev is None:
        table_dev = table.to(dst.device)
    elif table_dev.shape != table.shape or table_dev.dtype != table.dtype or table_dev.device != dst.device:
        raise ValueError(
            f"copy_regions: table_dev ({table_dev.dtype} {list(table_dev.shape)} on {table_dev.device}) "
            f"is not the table's copy on {dst.device}"
        )
    _copy_regions_kernel[grid](src, dst, table_dev, src.stride(0), dst.stride(0), BLOCK=block, num_warps=4)


def copy_regions(
    src: torch.Tensor,
    dst: torch.Tensor,
    table: torch.Tensor,
    *,
    table_dev: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> None:
    """``dst[:, d:d+n] = src[:, s:s+n]`` for every ``(s, d, n)`` of ``table`` (module docstring)."""
    if want_triton("copy_regions", dst, use_triton):
        copy_regions_triton(src, dst, table, table_dev)
    else:
        _check(src, dst, table)
        copy_regions_ref(src, dst, table)
