"""What every SBMM entry point checks of a call (host state only: no device sync), and the dtypes it takes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import DeltaWeights
from .meta import DeltaMeta

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Activation dtypes the op accepts (the pool's scales / zeros are always float16, per the format)."""


def check_call(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> None:
    """Raises ValueError naming the first problem of ``sbmm(x, out, w, meta)``: shapes, dtypes, devices,
    slots out of the pool's range or empty."""
    if x.dim() != 2 or x.shape[0] != meta.num_tokens:
        raise ValueError(f"sbmm: x {list(x.shape)} must be [T = {meta.num_tokens}, in_features]")
    if x.shape[1] != w.in_features:
        raise ValueError(f"sbmm: x has {x.shape[1]} columns, the deltas want in_features = {w.in_features}")
    if x.dtype not in DTYPES:
        raise ValueError(f"sbmm: x dtype {x.dtype}: want one of float32, float16, bfloat16")
    if out.dim() != 2 or tuple(out.shape) != (meta.num_tokens, w.out_features):
        raise ValueError(
            f"sbmm: out {list(out.shape)} must be [T = {meta.num_tokens}, out_features = {w.out_features}]"
        )
    if out.dtype != x.dtype:
        raise ValueError(f"sbmm: dtype mismatch: x {x.dtype}, out {out.dtype}")
    if out.stride(-1) != 1:
        raise ValueError("sbmm: out needs a contiguous last dim (it is updated in place)")
    if not (x.device == out.device == w.device == meta.seg_start.device):
        raise ValueError(
            f"sbmm: x on {x.device}, out on {out.device}, deltas on {w.device}, meta on {meta.seg_start.device}"
        )
    if meta.max_slot >= w.num_slots:
        raise ValueError(f"sbmm: delta slot {meta.max_slot} out of range (the pool has {w.num_slots} slots)")
    empty = sorted(s for s in meta.slots if not w.loaded[s])
    if empty:
        raise ValueError(f"sbmm: delta slot {empty[0]} holds no delta (tokens of the step use it)")


def check_stacked(
    x: torch.Tensor, out: torch.Tensor, slices: Sequence[tuple[DeltaWeights, int]], meta: DeltaMeta
) -> None:
    """Every slice is a valid ``sbmm`` call on its columns; the slices share one config and in_features and
    do not overlap."""
    if not slices:
        raise ValueError("sbmm: a stacked call needs at least one slice")
    if out.dim() != 2:
        raise ValueError(f"sbmm: out {list(out.shape)} must be [T, columns]")
    w0 = slices[0][0]
    end = 0
    for i, (w, col) in enumerate(sorted(slices, key=lambda s: s[1])):
        if (w.bits, w.sparse, w.group_size, w.in_features) != (w0.bits, w0.sparse, w0.group_size, w0.in_features):
            raise ValueError(
                f"sbmm: stacked slice {i} has (bits, sparse, group, in) = "
                f"{(w.bits, w.sparse, w.group_size, w.in_features)}, the first "
                f"{(w0.bits, w0.sparse, w0.group_size, w0.in_features)}"
            )
        if col < end or col + w.out_features > out.shape[1]:
            raise ValueError(
                f"sbmm: stacked slice at columns {col} .. {col + w.out_features} overlaps another or is "
                f"outside out's {out.shape[1]} columns"
            )
        end = col + w.out_features
        check_call(x, out[:, col : col + w.out_features], w, meta)
