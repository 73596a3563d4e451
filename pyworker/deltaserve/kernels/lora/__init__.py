"""Multi-LoRA delta kernels (Triton): SGMV for prefill segments, MBGMV for decode rows, multi-slice expand.

A batch mixes tokens of many adapters (and of none). The base projection ``y = x W^T`` runs once
over the whole batch; these ops add each token's LoRA delta ``scale_a * (x A_a^T) B_a^T`` in two
launches, *shrink* (hidden -> rank) then *expand* (rank -> hidden), as in Punica: per slice
(``lora_delta``), or per fused module for all its slices at once (``lora_delta_stacked``).

The package::

    layout.py     LoraWeights (one projection's adapters as rank rows in flat pools), LoraSlice,
                  LoraStack (a fused module's slices), make_weights
    meta.py       LoraMeta: which tokens use which adapter in one step (SGMV segments, MBGMV rows,
                  or both: a mixed step)
    checks.py     what every entry point checks of a call
    ref.py        lora_shrink_ref, lora_expand_ref: the torch references, the CPU path
    tables.py     what every launch passes of its weights (one slice or a stack), ALIGN
    sgmv.py       SGMV kernels (prefill: segments, tl.dot tiles)
    mbgmv.py      MBGMV kernels (decode: rows of any adapters, bandwidth kernels), the split decode path
    fused.py      the fused decode kernel: a module's shrink + expand of all slices in one launch
    configs/launch.json   the kernels' tuned launch configs
    __init__.py   the entry points (below)

Semantics::

    # lora_shrink: v = zeros(T, r_max); for each token t with adapter a >= 0, r = rank[a]:
    v[t, j] = dtype(sum_k x[t, k] * a_pool[a_offsets[a, j] + k])    for j < r  # fp32 accumulation
    # lora_expand (in place, one slice at columns off .. off + size):
    out[t, off:off + size] = dtype(out[t, off:off + size]
                                   + scale[a] * sum_{j<r} v[t, j] * b_pool[b_offsets[a, j] + n])
    # lora_delta: for each slice with weights: v = lora_shrink(x, w); lora_expand(v, w, out[:, off:off+size])
    # tokens with adapter -1 keep out unchanged; a slice with weights None is untouched
    # lora_delta_stacked(x, out, stack) == lora_delta(x, out, stack.as_slices())   (its reference is exactly that)

Shape:
    x:         [T, in_dim]          float32 / float16 / bfloat16, last dim contiguous
    v:         [T, r_max]           dtype of x (shrink output; rows of adapter -1 and columns >= rank are 0)
    out:       [T, out_width]       dtype of x, last dim contiguous, updated in place
    a_pool:    [a_elems] dtype of x;  b_pool: [b_elems] dtype of x (out_dim = the slice's size)
    a_offsets, b_offsets: [num_adapters, r_max] int64;  rank: [num_adapters] int32;  scale: [num_adapters] float32
    seg_start: [S + 1] int32;  seg_adapter: [S] int32 (MBGMV: S = T)

Stacked (one module, n slices): each kernel is the per-slice one with a slice grid axis, so every
program computes exactly what the per-slice path's does, and the results are equal (sgmv.py and
mbgmv.py draw the grids).

Decode path of ``lora_delta`` / ``lora_delta_stacked`` (``set_decode_path``, env ``DELTASERVE_LORA_DECODE``):
``split`` (the default: MBGMV shrink then expand, two launches per module) or ``fused`` (one launch
per module, fused.py; ``bench/lora_decode_step.py --paths fused,split`` compares them). Split stays
the default because it measured faster: on an H100 (d105e0d, Llama-2-7B shape, b64, rank 16, seven
projections, CUDA graphs) 1 adapter cost 1.10x the base step split and 1.28x fused, 64 distinct
1.21x and 1.40x. The fused kernel recomputes a row block's x·A for every column chunk and launches
slots x row blocks x chunks programs, most of which exit at once.

Prefill (SGMV): a short chunk's shrink splits its input columns over programs (``sgmv.sgmv_split``,
from shapes only; float32 partials of fixed column chunks, summed in chunk order by the expand);
the unsplit shrink sums the same chunks in the same order, so the delta is bit for bit the same
for every SPLIT. ``lora_shrink`` returns the unsplit v (out's dtype).

Mixed steps (``LoraMeta.mixed_step``, a prefill chunk next to decodes): the one-token segments run
on MBGMV over the meta's row list (the split decode path's kernels, whatever ``set_decode_path``
says) and the other segments on SGMV (tiles for them only), so a decode row costs what it costs in a
decode step rather than a 16-token SGMV tile. ``lora_shrink`` / ``lora_expand`` of a mixed meta
compute the same v and out as of its plain SGMV twin (up to summation order).

Overlap (``lora_linear_stacked``, the adapted linear's entry point: the base matmul and the delta):
a module's shrinks need only x, so in CUDA graphs they run on a side stream beside the base matmul
and the expands follow the join; the same kernels in the same order on out, so the same bits.
Measured on an H200 (Llama-2-7B shape, rank 16, seven projections; bench/README "LoRA shrinks beside
the base matmul"): a LoRA variant's 32-token prefix-cache hit step 7.52 -> 6.60 ms; b64 decode, median
of six pairs, 1 adapter 1.152x -> 1.101x the base step, 64 distinct 1.247x -> 1.199x. Eager steps do
not overlap: the fork and join cost host time (an eager b64 decode step took 52 ms overlapped
against 35 ms). ``set_overlap`` / env ``DELTASERVE_LORA_OVERLAP=0`` turn it off.

Entry points ``lora_delta`` / ``lora_delta_stacked`` / ``lora_shrink`` / ``lora_expand`` run the Triton kernels on CUDA
tensors (or when ``use_triton=True``: CPU tensors then need ``TRITON_INTERPRET=1``) and the torch
references ``*_ref`` (a loop per adapter over gathered rows; the CPU path) otherwise. Metadata is
validated on the host when it is built (no device sync per call); weights when they are built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..common import want_triton
from .checks import check_call, check_out
from .fused import FUSED_LAUNCH, fused_decode
from .layout import DTYPES, LoraSlice, LoraStack, LoraWeights, make_weights
from .mbgmv import MB_EXPAND_LAUNCH, MB_SHRINK_LAUNCH, mbgmv_expand, mbgmv_shrink, mbgmv_shrink_partials
from .meta import SGMV_TILE, LoraMeta, sgmv_tiles, single_rows
from .ref import lora_expand_ref, lora_shrink_ref
from .sgmv import sgmv_delta_shrink, sgmv_expand, sgmv_shrink

__all__ = [
    "DECODE_PATHS", "DTYPES", "FUSED_LAUNCH", "MB_EXPAND_LAUNCH", "MB_SHRINK_LAUNCH", "SGMV_TILE", "LoraMeta", "LoraSlice", "LoraStack",
    "LoraWeights", "get_decode_path", "get_overlap", "lora_delta", "lora_delta_stacked", "lora_delta_stacked_ref", "lora_expand",
    "lora_expand_ref", "lora_expand_triton", "lora_linear_stacked", "lora_shrink", "lora_shrink_ref", "lora_shrink_triton",
    "make_weights", "set_decode_path", "set_overlap", "sgmv_tiles", "single_rows",
]  # fmt: skip

DECODE_PATHS = ("fused", "split")
"""Accepted values of ``set_decode_path``."""
_decode_path = os.environ.get("DELTASERVE_LORA_DECODE", "split")
if _decode_path not in DECODE_PATHS:
    raise ValueError(f"DELTASERVE_LORA_DECODE={_decode_path!r}: want one of {', '.join(DECODE_PATHS)}")


def set_decode_path(name: str) -> str:
    """Selects the decode kernels of ``lora_delta`` / ``lora_delta_stacked``: ``fused`` (one launch per
    module) or ``split`` (shrink then expand); returns the previous setting. CUDA graphs keep the
    path they were captured with."""
    global _decode_path
    if name not in DECODE_PATHS:
        raise ValueError(f"lora decode path {name!r}: want one of {', '.join(DECODE_PATHS)}")
    previous, _decode_path = _decode_path, name
    return previous


def get_decode_path() -> str:
    """The current decode path (``fused`` or ``split``)."""
    return _decode_path


def lora_shrink_triton(x: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> torch.Tensor:
    """Triton kernel for ``lora_shrink`` (no dispatch): MBGMV if ``meta.decode``, SGMV and MBGMV's row
    list if ``meta.mixed``, else SGMV."""
    check_call("lora_shrink", x, w, meta, w.in_dim, "in_dim")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = x.shape[0]
    if meta.decode:  # launched whatever the rows' adapters: the grid depends on shapes only
        return mbgmv_shrink(x, w, meta)
    v = torch.zeros(t, w.r_max, dtype=x.dtype, device=x.device)
    if meta.max_adapter < 0 or t == 0:
        return v
    sgmv_shrink(x, w, meta, v)
    if meta.num_rows:
        mbgmv_shrink(x, w, meta, v)
    return v


def lora_expand_triton(v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> torch.Tensor:
    """Triton kernel for ``lora_expand`` (no dispatch), in place on ``out``: MBGMV if ``meta.decode``,
    SGMV and MBGMV's row list (v's rows gathered) if ``meta.mixed``, else SGMV."""
    check_call("lora_expand", v, w, meta, w.r_max, "r_max")
    check_out("lora_expand", out, w, meta)
    if v.stride(-1) != 1:
        v = v.contiguous()
    if out.shape[0] == 0:
        return out
    if meta.decode:
        mbgmv_expand(v, w, meta, out)
        return out
    if meta.max_adapter < 0:
        return out
    sgmv_expand(v, w, meta, out)
    if meta.num_rows:
        assert meta.rows is not None
        mbgmv_expand(v.index_select(0, meta.rows), w, meta, out)
    return out


def _lora_delta_triton(x: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> None:
    """One slice on the Triton path. Decode, fused: one launch; split: the expand reads the shrink's
    float32 partials directly (two launches, no zero fill, no finished v); prefill: SGMV shrink then
    expand (``sgmv_delta_shrink``: split-K for short chunks, the same result); mixed: the chunk's SGMV, then
    the split decode path over the row list."""
    check_call("lora_shrink", x, w, meta, w.in_dim, "in_dim")
    check_out("lora_expand", out, w, meta)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not x.shape[0]:
        return
    if meta.decode and _decode_path == "fused":
        fused_decode(x, w, meta, out)
        return
    _expand_half(_shrink_half(x, w, meta), w, meta, out)


def lora_shrink(x: torch.Tensor, w: LoraWeights, meta: LoraMeta, *, use_triton: bool | None = None) -> torch.Tensor:
    """``v[t, :rank_a] = x[t] A_a^T`` (module docstring); Triton on CUDA, the reference elsewhere."""
    if want_triton("lora_shrink", x, use_triton):
        return lora_shrink_triton(x, w, meta)
    return lora_shrink_ref(x, w, meta)


def lora_expand(
    v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor, *, use_triton: bool | None = None
) -> torch.Tensor:
    """``out[t] += scale_a * v[t, :rank_a] B_a^T`` in place (module docstring); returns ``out``."""
    if want_triton("lora_expand", v, use_triton):
        return lora_expand_triton(v, w, meta, out)
    return lora_expand_ref(v, w, meta, out)


def lora_delta(
    x: torch.Tensor, out: torch.Tensor, slices: Sequence[LoraSlice], meta: LoraMeta, *, use_triton: bool | None = None
) -> torch.Tensor:
    """Adds every slice's LoRA delta of ``x`` into its columns of ``out`` (in place); returns ``out``.

    A plain projection is one slice ``LoraSlice(0, out_dim, w)``; qkv is three, gate_up two. The
    adapted linear computes ``out = base(x)`` and then ``lora_delta(x, out, slices, meta)``.
    """
    if out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"lora_delta: out {list(out.shape)} must be [T = {x.shape[0]}, out_width]")
    for i, s in enumerate(slices):
        if s.offset < 0 or s.size < 0 or s.offset + s.size > out.shape[1]:
            raise ValueError(
                f"lora_delta: slice {i} (columns {s.offset} .. {s.offset + s.size}) is outside "
                f"out's {out.shape[1]} columns"
            )
        if s.weights is not None and s.weights.out_dim != s.size:
            raise ValueError(f"lora_delta: slice {i} has {s.size} columns, its weights out_dim {s.weights.out_dim}")
    triton_path = want_triton("lora_delta", x, use_triton)
    for s in slices:
        if s.weights is None:
            continue
        cols = out[:, s.offset : s.offset + s.size]
        if triton_path:
            _lora_delta_triton(x, s.weights, meta, cols)
        else:
            lora_expand_ref(lora_shrink_ref(x, s.weights, meta), s.weights, meta, cols)
    return out


def lora_delta_stacked(
    x: torch.Tensor, out: torch.Tensor, stack: LoraStack, meta: LoraMeta, *, use_triton: bool | None = None
) -> torch.Tensor:
    """``lora_delta(x, out, stack.as_slices(), meta)`` for all the stack's slices at once (decode: one
    launch fused, two split; prefill: two), in place on ``out``; returns ``out``. The adapted linear of a fused
    module (qkv, gate_up) computes ``out = base(x)`` then ``lora_delta_stacked(x, out, stack, meta)``.
    """
    _check_stacked(x, out, stack, meta)
    if want_triton("lora_delta_stacked", x, use_triton):
        _lora_delta_stacked_triton(x, out, stack, meta)
        return out
    return lora_delta_stacked_ref(x, out, stack, meta)


def lora_delta_stacked_ref(x: torch.Tensor, out: torch.Tensor, stack: LoraStack, meta: LoraMeta) -> torch.Tensor:
    """Torch reference and CPU path of ``lora_delta_stacked``: the per-slice references, slice by slice."""
    _check_stacked(x, out, stack, meta)
    return lora_delta(x, out, stack.as_slices(), meta, use_triton=False)


def _check_stacked(x: torch.Tensor, out: torch.Tensor, stack: LoraStack, meta: LoraMeta) -> None:
    check_call("lora_delta_stacked", x, stack.slice_weights[0], meta, stack.in_dim, "in_dim")
    if out.dim() != 2 or out.shape[0] != meta.num_tokens or out.shape[1] < stack.out_width:
        raise ValueError(
            f"lora_delta_stacked: out {list(out.shape)} must be [T = {meta.num_tokens}, "
            f">= {stack.out_width}] (the last slice ends at column {stack.out_width})"
        )
    if out.dtype != stack.b_pool.dtype:
        raise ValueError(f"lora_delta_stacked: dtype mismatch: out {out.dtype}, adapter weights {stack.b_pool.dtype}")
    if out.stride(-1) != 1:
        raise ValueError("lora_delta_stacked: out needs a contiguous last dim (it is updated in place)")


def _lora_delta_stacked_triton(x: torch.Tensor, out: torch.Tensor, stack: LoraStack, meta: LoraMeta) -> None:
    """All slices on the Triton path. Decode, fused: one launch (fused.py); split: MBGMV shrink over
    (T, SPLIT, n_slices) into float32 partials, MBGMV expand over (T, column tiles, n_slices);
    prefill: SGMV shrink into v [n_slices, T, r_max] (or split-K partials), SGMV expand
    (``sgmv_delta_shrink``); mixed: that over the chunk's tiles, and the split decode path over the row
    list. Each program computes what the per-slice path's does."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0] == 0:
        return
    if meta.decode and _decode_path == "fused":
        fused_decode(x, stack, meta, out)
        return
    _expand_half(_shrink_half(x, stack, meta), stack, meta, out)


class _Shrunk(NamedTuple):
    """What a stack's shrinks left for its expands: the chunk's SGMV v (or partials) and the MBGMV
    rows' partials, each None when the step has none."""

    chunk: torch.Tensor | None
    rows: torch.Tensor | None


def _shrink_half(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta) -> _Shrunk:
    """Launches the shrinks of a split-path step, one slice or a stack (x contiguous, T > 0); reads
    only x and the tables."""
    if meta.decode:  # launched whatever the rows' adapters: the grid depends on shapes only
        return _Shrunk(None, mbgmv_shrink_partials(x, w, meta))
    if meta.max_adapter < 0:
        return _Shrunk(None, None)
    rows = mbgmv_shrink_partials(x, w, meta) if meta.num_rows else None
    return _Shrunk(sgmv_delta_shrink(x, w, meta), rows)


def _expand_half(shrunk: _Shrunk, w: LoraWeights | LoraStack, meta: LoraMeta, out: torch.Tensor) -> None:
    """Launches the expands of ``_shrink_half``'s results into ``out``: the chunk's, then the rows'."""
    if shrunk.chunk is not None:
        sgmv_expand(shrunk.chunk, w, meta, out)
    if shrunk.rows is not None:
        mbgmv_expand(shrunk.rows, w, meta, out)


_overlap = os.environ.get("DELTASERVE_LORA_OVERLAP", "1")
if _overlap not in ("0", "1"):
    raise ValueError(f"DELTASERVE_LORA_OVERLAP={_overlap!r}: want 1 (on) or 0 (off)")
_overlap_on = _overlap == "1"


def set_overlap(on: bool) -> bool:
    """Whether ``lora_linear_stacked`` overlaps a module's shrinks with its base matmul in CUDA graphs
    it captures (on by default; env ``DELTASERVE_LORA_OVERLAP=0`` turns it off); returns the previous
    setting. CUDA graphs keep what they were captured with."""
    global _overlap_on
    previous, _overlap_on = _overlap_on, bool(on)
    return previous


def get_overlap() -> bool:
    """The current ``set_overlap`` setting."""
    return _overlap_on


def lora_linear_stacked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stack: LoraStack,
    meta: LoraMeta,
    *,
    use_triton: bool | None = None,
    overlap: bool | None = None,
) -> torch.Tensor:
    """``out = F.linear(x, weight, bias)``, then ``lora_delta_stacked(x, out, stack, meta)``; returns out.

    Overlapped (``overlap`` True; None: while a CUDA graph is being captured and ``set_overlap`` is
    on), on CUDA tensors on the Triton path: the shrinks, which need only x, run on a side stream
    beside the base matmul, and the expands wait for both (a fork and a join; in a graph, two
    branches). The kernels, their launches and their order on out are the split path's, so out is
    bit for bit what the plain call gives; only the device's order of work changes. Not overlapped:
    eager steps (a fork and a join cost host time an eager step has none of to spare), CPU tensors,
    and the fused decode path (one launch per module, nothing to split off).

    The side stream's memory: its buffers are allocated on it and freed once the expands that read
    them are queued on the main stream; the side stream runs only work queued after a later fork,
    which follows those expands, so a freed buffer is never rewritten while it is read.
    """
    if overlap is None:
        overlap = _overlap_on and x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not (
        overlap
        and x.is_cuda
        and x.shape[0]
        and not (meta.decode and _decode_path == "fused")
        and want_triton("lora_linear_stacked", x, use_triton)
    ):
        out = torch.nn.functional.linear(x, weight, bias)
        return lora_delta_stacked(x, out, stack, meta, use_triton=use_triton)
    if x.stride(-1) != 1:
        x = x.contiguous()
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(main)  # the fork: x is ready
    out = torch.nn.functional.linear(x, weight, bias)
    _check_stacked(x, out, stack, meta)
    with torch.cuda.stream(side):
        shrunk = _shrink_half(x, stack, meta)
    main.wait_stream(side)  # the join
    _expand_half(shrunk, stack, meta, out)
    return out


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The overlap's side stream of ``device`` (one per device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream
