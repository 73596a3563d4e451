"""What every multi-LoRA launch passes of its weights: ``LaunchTables`` (one slice or a stack) and ``align``.

Every kernel reads a rank row at ``pool + offset + k`` with the int64 offset loaded from the
adapter's row of the offsets table; ``tl.multiple_of(offset, ALIGN)`` (``LoraWeights.offset_align``,
capped by ``align``) lets the compiler use vector loads, as ``col_align`` does for a stacked slice's
width and first column in out. Ranks are clamped to r_max, so a bad rank in
an unchecked table never reads past the offsets row. A ``LoraWeights`` launches as one slice (slice
strides 0); a ``LoraStack`` adds a slice grid axis, and each program computes exactly what the
per-slice path's does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import LoraStack, LoraWeights


@dataclass(frozen=True)
class LaunchTables:
    """What a launch needs of a ``LoraWeights`` (one slice) or a ``LoraStack`` (n slices): the
    tables' base pointers and slice / adapter strides, and each slice's width and first column."""

    n: int
    a_off: torch.Tensor
    b_off: torch.Tensor
    rank: torch.Tensor
    scale: torch.Tensor
    a_off_slice: int
    a_off_row: int
    b_off_slice: int
    b_off_row: int
    rank_slice: int
    scale_slice: int
    dims: torch.Tensor
    cols: torch.Tensor
    max_width: int
    stacked: bool
    col_align: int = 1
    """What every slice's width and first column are multiples of (a stack; 1 for one slice, whose
    width is a launch argument): the expand promises it (``col_align``) so out's row segments load and
    store as vectors, not element by element."""

    @staticmethod
    def of(w: LoraWeights | LoraStack) -> LaunchTables:
        """The tables of ``w``: one slice (slice strides 0) or a stack."""
        if isinstance(w, LoraStack):
            return LaunchTables(
                w.num_slices,
                w.a_offsets,
                w.b_offsets,
                w.rank,
                w.scale,
                w.a_offsets.stride(0),
                w.a_offsets.stride(1),
                w.b_offsets.stride(0),
                w.b_offsets.stride(1),
                w.rank.stride(0),
                w.scale.stride(0),
                w.out_dims_dev,
                w.out_offsets_dev,
                max(w.out_dims),
                True,
                math.gcd(*w.out_dims, *w.out_offsets),
            )
        # One slice: slice strides 0; dims / cols are never read (STACKED false), any pointer will do.
        return LaunchTables(
            1,
            w.a_offsets,
            w.b_offsets,
            w.rank,
            w.scale,
            0,
            w.a_offsets.stride(0),
            0,
            w.b_offsets.stride(0),
            0,
            0,
            w.rank,
            w.rank,
            w.out_dim,
            False,
        )


def col_align(tab: LaunchTables, out: torch.Tensor) -> int:
    """COL_ALIGN for the stacked expands: ``tab.col_align`` capped at one 16-byte vector of out."""
    return max(1, min(tab.col_align, 16 // out.element_size()))


def align(w: LoraWeights | LoraStack, pool: torch.Tensor) -> int:
    """ALIGN for the kernels: the offsets' promised alignment, capped at one 16-byte vector."""
    return min(w.offset_align, 16 // pool.element_size())
