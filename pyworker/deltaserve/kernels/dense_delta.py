"""Dense delta rows (Triton): every logits row's dense lm_head / embedding delta, in one launch.

A compressed full fine-tune (a *delta*, ``deltaserve.compress``) packs its block linears (SBMM,
``kernels/sbmm/``) but keeps a few tensors as dense deltas in the model dtype, the widest being
the lm_head delta (or the embedding delta when the weights are tied), ``[vocab, hidden]``. In a
step every logits row may belong to a different delta, and the head adds ``x[r] @ D_{slot(r)}^T``
to row r. Eagerly that is a loop over the step's deltas with shapes that depend on the step
(``out[rows] += x[rows] @ d.T``), which a CUDA graph cannot capture. This op does the same in one
launch whose grid depends only on T and N, reading each used delta once per work tile.

Delta table: slot s's dense delta ``D_s`` is ``table[s]``, one ``[num_slots, N, K]`` contiguous
tensor (slot ids are the model's delta slots, shared with ``DeltaWeights``; -1 = no delta).

Batch metadata: ``sbmm.DeltaMeta`` (``rows`` for decode, ``segments`` for prefill; no dense
segments), read exactly as the SBMM tl.dot kernel reads it: ``order`` lists the step's delta rows
grouped by slot, ``tiles`` cuts each slot's run into work tiles of at most ``block_m`` rows
(first, end, slot), padding tiles (slot -1) up to ``grid_tiles`` (decode: T). Program (tile, n
block) loads its tile's x rows through ``order``, multiplies them with ``D_slot[n block, :]`` over
K on tensor cores, and writes its out rows back through ``order``.

Semantics (what ``DeltaLmHead`` computed eagerly, in this rounding order)::

    for each row t with slot s >= 0:
        prod = dtype(sum_k float32(x[t, k]) * float32(D_s[n, k]))    # fp32 accumulation, one rounding
        out[t, n] = dtype(float32(out[t, n]) + float32(prod))          # the in-place add, a second one
    rows with slot -1 keep out unchanged

Shape:
    x:      [T, K]              float32 / float16 / bfloat16, last dim contiguous
    out:    [T, N]              dtype of x, last dim contiguous, updated in place
    table:  [num_slots, N, K]   dtype of x, contiguous
    meta:   DeltaMeta over the T rows; meta.dense empty; meta.max_slot < num_slots

The launch is CUDA-graph safe: its grid is ``(meta.grid_tiles, cdiv(N, BLOCK_N))`` (decode: T
tiles, whatever the slots) and it runs even when the step has no delta rows (every tile padding),
so a graph captured once replays any step whose metadata tensors were refilled in place (with the
same ``block_m``). Under the Triton interpreter (CPU tensors) the tiles are upcast to float32
before ``tl.dot``, whose low-precision path is wrong there; float32 inputs always use IEEE
precision, not TF32.

Entry point ``dense_delta_rows`` runs the Triton kernel on CUDA tensors (``use_triton=True``
forces it; CPU tensors then need ``TRITON_INTERPRET=1``) and ``dense_delta_rows_ref`` (one matmul
per used slot, the CPU path) otherwise. Every call checks its inputs before touching ``out``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import needs_rne_by_hand, round_to, want_triton
from .sbmm.meta import DeltaMeta
from .sbmm.tiles import tile_tokens, work_tile

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes of x, out and table (all three the same)."""

# One launch config per tile height, no autotune (the interpreter cannot run multi-config autotune;
# tuned configs go to data files, STYLE #23).
LAUNCH: dict[int, dict[str, int]] = {
    16: {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    64: {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
}
"""Launch config by BLOCK_M (``launch_config``: 16, or 64 for 32- and 64-row tiles); tunable, module-level
so a tuning run can swap it. BLOCK_K is a power of two >= 16. From a sweep on the H200 (Llama-2-7B lm_head,
32000 x 4096 float16; BLOCK_N 32..256, BLOCK_K 64..256, 4 / 8 warps, 3 / 4 stages): 16-row tiles
(decode, a few rows per delta) are memory-bound and every config with BLOCK_K 128 or 256 came within
3% of the best (1 row of 1 delta: 73 us, 8 rows of 8 deltas: 493 us, ~1.0 of the copy bandwidth); 64-row
tiles want wider tiles: 256 rows of 1 delta 297 -> 204 us, 64 rows 99 -> 84 us with BLOCK_N 128, BLOCK_K 64."""


def launch_config(meta: DeltaMeta) -> dict[str, int]:
    """The launch config of a call with ``meta``: ``LAUNCH`` by the kernel's BLOCK_M."""
    return LAUNCH[16 if block_m(meta) <= 16 else 64]


def block_m(meta: DeltaMeta) -> int:
    """The kernel's BLOCK_M for ``meta``: its work-tile size rounded up to a power of two, at least 16
    (``tl.dot``'s smallest tile; decode tiles of 1..4 rows are padded)."""
    return max(16, triton.next_power_of_2(meta.block_m))


def _check_call(x: torch.Tensor, out: torch.Tensor, table: torch.Tensor, meta: DeltaMeta) -> None:
    """Raises ValueError naming the first problem of a call; reads host state only (no device sync)."""
    if x.dim() != 2 or x.shape[0] != meta.num_tokens:
        raise ValueError(f"dense_delta_rows: x {list(x.shape)} must be [T = {meta.num_tokens}, K]")
    if x.dtype not in DTYPES:
        raise ValueError(f"dense_delta_rows: x dtype {x.dtype}: want one of float32, float16, bfloat16")
    if out.dtype != x.dtype or table.dtype != x.dtype:
        raise ValueError(f"dense_delta_rows: dtype mismatch: x {x.dtype}, out {out.dtype}, table {table.dtype}")
    t, k = x.shape
    if out.dim() != 2 or out.shape[0] != t:
        raise ValueError(f"dense_delta_rows: out {list(out.shape)} must be [T = {t}, N]")
    n = out.shape[1]
    if table.dim() != 3 or tuple(table.shape[1:]) != (n, k):
        raise ValueError(
            f"dense_delta_rows: table {list(table.shape)} must be [num_slots, N = {n}, K = {k}] "
            f"(out {list(out.shape)}, x {list(x.shape)})"
        )
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(
            f"dense_delta_rows: x (strides {x.stride()}) and out (strides {out.stride()}) need a contiguous last dim"
        )
    if not table.is_contiguous():
        raise ValueError(f"dense_delta_rows: table (strides {table.stride()}) must be contiguous")
    if not (x.device == out.device == table.device == meta.order.device):
        raise ValueError(
            f"dense_delta_rows: x on {x.device}, out on {out.device}, table on {table.device}, "
            f"meta on {meta.order.device}"
        )
    if meta.dense:
        raise ValueError(
            f"dense_delta_rows: meta has dense segments {list(meta.dense)}: build it without "
            "dense_min_m (every delta row must be in a work tile)"
        )
    if meta.max_slot >= table.shape[0]:
        raise ValueError(
            f"dense_delta_rows: delta slot {meta.max_slot} out of range (the table has {table.shape[0]} slots)"
        )


def dense_delta_rows_ref(x: torch.Tensor, out: torch.Tensor, table: torch.Tensor, meta: DeltaMeta) -> torch.Tensor:
    """Torch reference and CPU path of ``dense_delta_rows``: per used slot, one float32 matmul over its
    rows, rounded to the dtype, then added to out and rounded again (the module's Semantics)."""
    _check_call(x, out, table, meta)
    for s, toks in meta.slot_tokens:
        tok = torch.tensor(toks, dtype=torch.long, device=x.device)
        prod = (x[tok].float() @ table[s].float().T).to(out.dtype)
        out[tok] = (out[tok].float() + prod.float()).to(out.dtype)
    return out


@triton.jit
def _dense_delta_kernel(
    x_ptr,
    out_ptr,
    order_ptr,
    tiles_ptr,
    d_ptr,
    N,
    K,
    x_stride,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE: tl.constexpr,
):
    """Program (work tile, n block): ``out[rows, ns] = dtype(out + dtype(x[rows] @ D_slot[ns, :]^T))``
    for the tile's rows (through ``order``); padding tiles exit at once."""
    slot, start, end = work_tile(tiles_ptr)
    if slot < 0:  # a padding row of the tile table
        return
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    at, row_ok, rows = tile_tokens(order_ptr, start, end, BLOCK_M)
    x_rows = x_ptr + rows[:, None] * x_stride
    d_rows = d_ptr + slot * N * K + ns.to(tl.int64)[:, None] * K  # slot is int64: no overflow past 2^31
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        dt = tl.load(d_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's low-precision dot is wrong: fp32 tiles holding dtype values
            xt = xt.to(tl.float32)
            dt = dt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(dt), acc, input_precision=DOT_PREC)
    ty = out_ptr.dtype.element_ty
    prod = round_to(acc, ty, RNE)  # x @ D^T in the dtype (the matmul's rounding)
    o_ptrs = out_ptr + rows[:, None] * out_stride + ns[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + prod, ty, RNE).to(ty), mask=mask)  # the in-place add's rounding


def dense_delta_rows_triton(x: torch.Tensor, out: torch.Tensor, table: torch.Tensor, meta: DeltaMeta) -> torch.Tensor:
    """The Triton kernel of ``dense_delta_rows`` (no dispatch), in place on ``out``: one launch over
    ``(meta.grid_tiles, cdiv(N, BLOCK_N))`` programs (``launch_config``), launched even when no row has a delta."""
    _check_call(x, out, table, meta)
    n, k = table.shape[1], table.shape[2]
    if meta.grid_tiles == 0 or n == 0:
        return out
    upcast = not x.is_cuda
    prec = "ieee" if upcast or x.dtype == torch.float32 else "tf32"  # tf32: unused by fp16 / bf16 dots
    cfg = launch_config(meta)
    _dense_delta_kernel[(meta.grid_tiles, triton.cdiv(n, cfg["BLOCK_N"]))](
        x, out, meta.order, meta.tiles, table, n, k, x.stride(0), out.stride(0),
        BLOCK_M=block_m(meta), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], UPCAST=upcast, DOT_PREC=prec,
        RNE=needs_rne_by_hand(out), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    return out


def dense_delta_rows(
    x: torch.Tensor, out: torch.Tensor, table: torch.Tensor, meta: DeltaMeta, *, use_triton: bool | None = None
) -> torch.Tensor:
    """``out[t] += x[t] @ table[slot(t)]^T`` in place for every row with a slot (module docstring);
    returns ``out``. The Triton kernel on CUDA (``use_triton=True`` forces it), the reference elsewhere."""
    if want_triton("dense_delta_rows", x, use_triton):
        return dense_delta_rows_triton(x, out, table, meta)
    return dense_delta_rows_ref(x, out, table, meta)
