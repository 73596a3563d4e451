"""One LoRA adapter as data: its rows' places in pages of the KV pool (``AdapterLayout``), the read
plan of its directory, and its host and GPU copies. ``lora_pool.py`` moves adapters between them.

There is ONE GPU pool: the KV
cache tensor ``[L, 2, NB, block_size, H_kv, D]`` (``model/kv_cache.py``). A page ``p`` is, in
every layer ``l``, two regions of ``S = block_size * H_kv * D`` elements of the layer's flat view
``kv.kv[l].view(-1)``: K half at ``p * S``, V half at ``(NB + p) * S``. A page holds either a
request's K/V or part of an adapter.

Layout of one adapter (``AdapterLayout``; the same in every layer, so one offsets table serves all)::

    rows, in order: for each projection the adapter targets, in linear_slots order (q k v o gate up down),
                    r_p = its largest rank over layers:
                        r_p rows of A   (A[j, :],  in_dim elements each)
                        r_p rows of B^T (B[:, j],  out_dim elements each)
    regions of pages [p1, p2, ...]:  K(p1) V(p1) K(p2) V(p2) ...
    first fit, in order: a row goes at the current position of the current region if it fits
                         entirely, else at the start of the next region
    num_blocks = ceil(regions used / 2); a row wider than S cannot be placed (inspect refuses it)

    layer flat view:  |K(p1): A_q0 A_q1 .. B_q0 ..  (tail) | ... | V(p1): .. | ...
    host copy:        [L, sum(used part of each region)]  the regions' used parts back to back
                      (so every row is contiguous in it and each region is one slice of it)

Layers where a projection has a smaller rank (PEFT ``rank_pattern``) or no adapter leave its last
rows zero; the per-layer rank table says how many rows are read (0 = not adapted there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .lora import LoraSpec, TensorCopy

MAX_VEC_BYTES = 16
"""Widest vector load the kernels may use on aligned rows (``LoraWeights.offset_align``)."""


@dataclass(frozen=True)
class SliceRows:
    """Where one projection's rank rows sit in an adapter's regions."""

    index: int
    """Position of the projection in ``linear_slots`` order (its row in the a_off/b_off tables)."""
    proj: str
    """HF projection name, e.g. ``"q_proj"``."""
    rank: int
    """r_p: the largest rank this projection has over layers (rows placed for A and for B^T)."""
    in_dim: int
    """Width of an A row."""
    out_dim: int
    """Width of a B^T row."""
    a_pos: tuple[tuple[int, int], ...]
    """(region, element offset inside it) of ``A[j, :]`` for j < rank."""
    b_pos: tuple[tuple[int, int], ...]
    """(region, element offset inside it) of ``B[:, j]`` for j < rank."""
    packed_start: int
    """Element offset of this projection's first A row in a layer's packed host row."""


@dataclass(frozen=True)
class AdapterLayout:
    """One adapter's rows inside pages (module docstring); independent of which pages it gets."""

    region_elems: int
    """S: elements per region (half a page of one layer)."""
    slices: tuple[SliceRows, ...]
    """The targeted projections, in ``linear_slots`` order."""
    region_used: tuple[int, ...]
    """Elements used at the front of each region (its tail is left unused)."""

    @property
    def num_regions(self) -> int:
        return len(self.region_used)

    @property
    def num_blocks(self) -> int:
        """Pages the adapter takes: two regions (K and V half) per page."""
        return -(-self.num_regions // 2)

    @property
    def packed_elems(self) -> int:
        """Elements of one layer's packed host row (every row, back to back)."""
        return sum(self.region_used)

    @classmethod
    def plan(
        cls, ranks: dict[str, int], features: dict[str, tuple[int, int]], order: Sequence[str], region_elems: int
    ) -> AdapterLayout:
        """First-fit placement of the rows of projections ``ranks`` (proj -> r_p) in ``order``.

        Raises ValueError naming the projection when a row is wider than a region.
        """
        region, off, used = 0, 0, [0]
        packed = 0
        slices = []

        def place(width: int) -> tuple[int, int]:
            nonlocal region, off
            if off + width > region_elems:
                region, off = region + 1, 0
                used.append(0)
            pos = (region, off)
            off += width
            used[region] = off
            return pos

        for index, proj in enumerate(order):
            r = ranks.get(proj, 0)
            if r == 0:
                continue
            fin, fout = features[proj]
            for what, width in (("lora_A row (in_features)", fin), ("lora_B column (out_features)", fout)):
                if width > region_elems:
                    raise ValueError(
                        f"{proj}: a {what} has {width} elements but a page half holds {region_elems} "
                        f"(block_size x kv heads x head_dim); raise --block-size"
                    )
            a_pos = tuple(place(fin) for _ in range(r))
            b_pos = tuple(place(fout) for _ in range(r))
            slices.append(SliceRows(index, proj, r, fin, fout, a_pos, b_pos, packed))
            packed += r * (fin + fout)
        return cls(region_elems, tuple(slices), tuple(used))


@dataclass(frozen=True, eq=False)
class PlacementTables:
    """An adapter layout as host tensors, so placing it on pages is a few vector ops and one region copy
    (``LoraPool.to_gpu``), not a Python loop over its rows and regions."""

    region_src: torch.Tensor
    """[R] int64: where each region's used part starts in a layer's packed host row."""
    region_used: torch.Tensor
    """[R] int64: elements used at the front of each region."""
    row_region: torch.Tensor
    """[2, n_slices, r_max] int64: region of A row j (``[0]``) and B^T row j (``[1]``) of each slice; -1
    past its rank or for a slice it does not target."""
    row_inner: torch.Tensor
    """[2, n_slices, r_max] int64: element offset of that row inside its region (0 where -1 above)."""

    @classmethod
    def of(cls, layout: AdapterLayout, n_slices: int, r_max: int) -> PlacementTables:
        used = torch.tensor(layout.region_used, dtype=torch.int64)
        region = torch.full((2, n_slices, r_max), -1, dtype=torch.int64)
        inner = torch.zeros(2, n_slices, r_max, dtype=torch.int64)
        for s in layout.slices:
            for half, pos in enumerate((s.a_pos, s.b_pos)):
                region[half, s.index, : s.rank] = torch.tensor([k for k, _ in pos], dtype=torch.int64)
                inner[half, s.index, : s.rank] = torch.tensor([o for _, o in pos], dtype=torch.int64)
        return cls(torch.cumsum(used, 0) - used, used, region, inner)


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """How to read one adapter into a host copy, from its config and header (``LoraPool._plan``)."""

    spec: LoraSpec
    """The validated config and tensor sites."""
    layout: AdapterLayout
    """Where its rows go inside its pages."""
    copies: list[TensorCopy]
    """The native reads that fill the packed copy (``LoraPool._copies``)."""
    rank: torch.Tensor
    """[L, n_slices] int32: rows per layer and slice (0 = not adapted there)."""
    scale: torch.Tensor
    """[L, n_slices] float32: the LoRA scaling per layer and slice."""
    host_bytes: int
    """Bytes of the packed host copy."""
    tables: PlacementTables
    """The layout as tensors, for ``to_gpu``."""


@dataclass(frozen=True, eq=False)
class HostCopy:
    """An adapter read, validated and packed in host memory, ready to be copied into pages."""

    layout: AdapterLayout
    """Where its rows go inside its pages."""
    packed: torch.Tensor
    """[L, layout.packed_elems] in the pool dtype (pinned on CUDA): every layer's rows back to back."""
    rank: torch.Tensor
    """[L, n_slices] int32 on CPU: rows read per layer and slice (0 = not adapted there)."""
    scale: torch.Tensor
    """[L, n_slices] float32 on CPU: the LoRA scaling per layer and slice."""
    max_rank: int
    """Largest rank over its modules."""
    target_modules: tuple[str, ...]
    """Adapted projections, in ``linear_slots`` order."""
    tables: PlacementTables
    """The layout as tensors, for ``to_gpu``."""

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


@dataclass(eq=False)
class GpuEntry:
    """An adapter placed on pages: the device tables one step slot is filled from."""

    block_ids: tuple[int, ...]
    """The pages holding it, in region order."""
    a_off: torch.Tensor
    """[n_slices, r_max] int64 on the device: element offset of A row j of each slice (0 beyond its rank)."""
    b_off: torch.Tensor
    """[n_slices, r_max] int64 on the device: element offset of B^T row j of each slice."""
    rank: torch.Tensor
    """[L, n_slices] int32 on the device."""
    scale: torch.Tensor
    """[L, n_slices] float32 on the device."""


def offset_align(dims: Sequence[int], itemsize: int) -> int:
    """Largest power of two (at most 16 bytes of elements) dividing every dim: every row offset is a
    sum of them, so every offset the tables ever hold is a multiple of it."""
    align = max(1, MAX_VEC_BYTES // itemsize)
    while align > 1 and any(d % align for d in dims):
        align //= 2
    return align


__all__ = [
    "AdapterLayout",
    "GpuEntry",
    "HostCopy",
    "MAX_VEC_BYTES",
    "PlacementTables",
    "ReadPlan",
    "SliceRows",
    "offset_align",
]
