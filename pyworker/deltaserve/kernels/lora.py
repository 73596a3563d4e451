"""Multi-LoRA delta kernels (Triton): SGMV for prefill segments, MBGMV for decode rows, multi-slice expand.

A batch mixes tokens of many adapters (and of none). The base projection ``y = x W^T`` runs once
over the whole batch; these ops add each token's LoRA delta ``scale_a * (x A_a^T) B_a^T`` in two
launches, *shrink* (hidden -> rank) then *expand* (rank -> hidden), as in Punica: per slice
(``lora_delta``), or per fused module for all its slices at once (``lora_delta_stacked``).

Weight layout (S-LoRA unified paging: adapter rows live inside KV-cache pages): every adapter's
weights for one projection are *rank rows* at arbitrary element offsets in flat 1-D pools. Row ``j``
of adapter ``a`` is ``A_a[j, :]`` (``in_dim`` contiguous elements at ``a_offsets[a, j]`` in
``a_pool``) and column ``j`` of ``B_a``, i.e. ``B_a[:, j]`` (``out_dim`` contiguous elements at
``b_offsets[a, j]`` in ``b_pool``). The two pools may be one tensor (a layer's whole KV pool viewed
flat), rows of different adapters interleave with KV data, and rows need not be ordered::

    pool (1-D)  |KV..KV|A_1[0,:]|A_1[1,:]|..|B_1[:,0]|..|KV....KV|A_0[0,:]|B_0[:,0]|..|
                        ^ a_offsets[1, 0]    ^ b_offsets[1, 0]    ^ a_offsets[0, 0]
    a_offsets [num_adapters, r_max] int64   element offset of A_a[j, :] (entries j >= rank[a] unread)
    b_offsets [num_adapters, r_max] int64   element offset of B_a[:, j]
    rank      [num_adapters] int32          rank[a] <= r_max; 0 = slot unused / not adapted here
    scale     [num_adapters] float32        lora_alpha / r (or alpha / sqrt(r) for rsLoRA)

The tables may be refilled in place between calls (the worker keeps static tables, CUDA graphs keep
their pointers): kernels read them on the device every call, and for decode (``meta.decode``) the
launch grid depends only on shapes (T, r_max, dims), never on the tables or on which rows have an
adapter. ``offset_align`` promises every offset is a multiple of that many elements, so the kernels
may use 16-byte vector loads (``make_weights`` promises what its dims allow; 1 allows odd offsets).

Adapter ids are slots ``0 .. num_adapters - 1`` shared by all projections of a model; ``-1`` means
"no adapter" (the token gets no delta). A fused projection (qkv: 3 slices, gate_up: 2) has one
``LoraWeights`` per slice, or ``None`` for a slice without LoRA (``LoraSlice``). A ``LoraStack``
holds a module's adapted slices with tables stacked along a leading slice axis (views with any
uniform slice stride, e.g. the adapter pool's per-projection rows; ``LoraStack.from_slices``)::

    a_offsets, b_offsets [n_slices, num_adapters, r_max] int64   (slice i = one LoraWeights' table)
    rank, scale          [n_slices, num_adapters] int32 / float32  (rank 0: the adapter skips slice i)
    out_dims, out_offsets  (n_slices,) ints                          slice i = out[:, off_i : off_i + dim_i]

Batch metadata (``LoraMeta``, built once per step and reused by every layer and projection):

    SGMV (prefill): tokens grouped into contiguous segments, one adapter per segment
        seg_start [S + 1] int32   token range of segment s is seg_start[s] .. seg_start[s + 1]
        seg_adapter [S] int32     adapter of segment s, or -1
        tiles [n, 2] int32        (segment, first token) of every 16-token tile of a segment with
                                  an adapter: the launch grid (never segments x longest segment)
    MBGMV (decode): one token per row, rows of any adapters in any order
        row_adapter [T] int32     stored as seg_adapter with seg_start = 0, 1, ..., T

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

Compute is never padded to the largest rank in the batch: every program loops to (in tiles of 16)
its own adapter's rank, and SGMV programs whose rank tile lies past the rank exit at once, so decode
cost follows the sum of the rows' ranks (S-LoRA's MBGMV), not batch x max rank (BGMV). The SGMV
kernels use ``tl.dot`` on [16+, 16+] tiles (Tensor Cores on the GPU). The MBGMV kernels are
bandwidth kernels (no ``tl.dot``): the shrink splits each row's input columns over programs
(program (row block, s) writes float32 partial sums of columns s*BLOCK_K.. for all of its rows'
rank rows; no atomics, so results are deterministic) and the expand, tiled over output columns, sums
a row's partials in a fixed order, rounds v to the activation dtype and applies it (``lora_delta``:
two launches, no zero fill). ``lora_shrink`` at decode finishes v with a third small kernel summing
the same partials, so the fused path and shrink-then-expand agree up to the order of that float32
sum. A program takes BLOCK_T consecutive rows (``MB_SHRINK_LAUNCH`` / ``MB_EXPAND_LAUNCH``, by step
size); it is latency-bound (its weight rows are found through two table lookups), so each kernel
issues its loads in three dependent rounds (adapters and x / out / partials; ranks and the first
rank tile's offsets; the weight rows) and the tuned launches favour many small one-warp programs.

Stacked (one module, n slices; each kernel is the per-slice one with a slice grid axis, so every
program computes exactly what the per-slice path's does, and the results are equal)::

    decode   shrink grid (row blocks, SPLIT, n_slices) -> float32 partials [n_slices, SPLIT, T, r_max]
             expand grid (row blocks, tiles of the widest slice, n_slices); a tile past its slice's width
             (GQA k / v next to q) or a slice of rank 0 for the row's adapter exits at once
    prefill  shrink grid (token tiles, n_slices * rank tiles) -> v [n_slices, T, r_max]
             expand grid (token tiles, n_slices * column tiles of the widest slice)

The decode grids depend only on T, in_dim, r_max, n_slices and the widest slice (shapes), never
on the tables: the slices' widths and first columns come from small static device tensors.

Entry points ``lora_delta`` / ``lora_delta_stacked`` / ``lora_shrink`` / ``lora_expand`` run the Triton kernels on CUDA
tensors (or when ``use_triton=True``: CPU tensors then need ``TRITON_INTERPRET=1``) and the torch
references ``*_ref`` (a loop per adapter over gathered rows; the CPU path) otherwise. Metadata is
validated on the host when it is built (no device sync per call); weights when they are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import triton
import triton.language as tl

from .common import needs_rne_by_hand, round_to, want_triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Activation / weight dtypes the ops accept."""

# SGMV tiles: tl.dot needs every dimension >= 16. One launch config per kernel (no autotune: the
# interpreter cannot run multi-config autotune; tuned configs go to data files, STYLE #23).
_SG_BLOCK_M = 16
"""SGMV: tokens of one segment per program."""
SGMV_TILE = _SG_BLOCK_M
"""Tokens per SGMV token tile (``sgmv_tiles``): the metadata builders' share of the launch."""
_SG_BLOCK_R = 16
"""SGMV: rank rows per tile (the tile granularity of the rank loop)."""
_SG_BLOCK_K = 64
"""SGMV shrink: input columns per step of the reduction."""
_SG_BLOCK_N = 64
"""SGMV expand: output columns per program."""
_MB_FINISH_BLOCK_R = 16
"""MBGMV finish (``lora_shrink`` at decode): rank columns per program. The shrink and expand
launches are chosen per step size (``MB_SHRINK_LAUNCH``, ``MB_EXPAND_LAUNCH``)."""


# ----------------------------------------------------------------------------- metadata / weights


@dataclass(frozen=True)
class LoraMeta:
    """Which tokens use which adapter in one step; built once per step (``sgmv`` / ``mbgmv``)."""

    seg_start: torch.Tensor
    """[S + 1] int32 on the device: segment s covers tokens seg_start[s] .. seg_start[s + 1]."""
    seg_adapter: torch.Tensor
    """[S] int32 on the device: adapter slot of each segment, -1 for none (MBGMV: row_adapter)."""
    seg_start_host: tuple[int, ...]
    """``seg_start`` on the host: the reference and the launch grid read it without a device sync."""
    seg_adapter_host: tuple[int, ...]
    """``seg_adapter`` on the host, for the same reason."""
    num_tokens: int
    """T: rows of x / out the step has."""
    max_adapter: int
    """Largest adapter slot used (-1 if none): checked against each weight set's num_adapters."""
    decode: bool
    """True: one token per row (MBGMV kernels); False: segments (SGMV kernels)."""
    tiles: torch.Tensor | None = None
    """SGMV: [num_tiles, 2] int32 on the device, (segment, first token) of every token tile of
    ``SGMV_TILE`` tokens that has an adapter (``sgmv_tiles``): the SGMV grid runs over these, so a
    step of many short segments (a decode row per adapter) next to one long prefill launches a
    program per real tile, not segments x the longest segment's tiles. None for MBGMV."""
    num_tiles: int = 0
    """Rows of ``tiles``."""

    @classmethod
    def sgmv(cls, seg_lens: Sequence[int], seg_adapter: Sequence[int], device: torch.device | str) -> "LoraMeta":
        """Prefill metadata: segment s has ``seg_lens[s]`` consecutive tokens of ``seg_adapter[s]``."""
        lens, adapters = [int(n) for n in seg_lens], [int(a) for a in seg_adapter]
        if len(lens) != len(adapters):
            raise ValueError(f"lora: {len(lens)} segment lengths but {len(adapters)} segment adapters")
        if any(n < 0 for n in lens):
            raise ValueError(f"lora: negative segment length in {lens}")
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return cls._build(starts, adapters, False, device)

    @classmethod
    def mbgmv(cls, row_adapter: Sequence[int], device: torch.device | str) -> "LoraMeta":
        """Decode metadata: token t uses adapter ``row_adapter[t]`` (-1: none), in any order."""
        adapters = [int(a) for a in row_adapter]
        return cls._build(list(range(len(adapters) + 1)), adapters, True, device)

    @classmethod
    def _build(cls, starts: list[int], adapters: list[int], decode: bool, device: torch.device | str) -> "LoraMeta":
        bad = [a for a in adapters if a < -1]
        if bad:
            raise ValueError(f"lora: adapter id {bad[0]} out of range (slots are >= 0, -1 = no adapter)")
        if starts[-1] >= 2**31:
            raise ValueError(f"lora: {starts[-1]} tokens overflow int32 segment offsets")
        tiles = None if decode else sgmv_tiles(starts, adapters)
        return cls(
            seg_start=torch.tensor(starts, dtype=torch.int32, device=device),
            seg_adapter=torch.tensor(adapters, dtype=torch.int32, device=device),
            seg_start_host=tuple(starts), seg_adapter_host=tuple(adapters), num_tokens=starts[-1],
            max_adapter=max(adapters, default=-1), decode=decode,
            tiles=None if tiles is None else torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 2),
            num_tiles=0 if tiles is None else len(tiles) // 2,
        )  # fmt: skip


def sgmv_tiles(seg_start: Sequence[int], seg_adapter: Sequence[int]) -> list[int]:
    """The SGMV launch's token tiles, flattened ``[seg, first token, seg, first token, ...]``: every
    ``SGMV_TILE`` tokens of every segment with an adapter (segments of base tokens, adapter -1, get
    none). ``LoraMeta.tiles`` holds them on the device."""
    tiles: list[int] = []
    for seg, adapter in enumerate(seg_adapter):
        if adapter >= 0:
            for m0 in range(seg_start[seg], seg_start[seg + 1], SGMV_TILE):
                tiles += (seg, m0)
    return tiles


@dataclass(frozen=True)
class LoraWeights:
    """One projection's adapters as rank rows at element offsets in flat pools (module docstring).

    Built once; the tables (``a_offsets``, ``b_offsets``, ``rank``, ``scale``) and the pools may be
    refilled in place between calls (the kernels read them on the device at every call, and the
    decode launch grid depends only on shapes, so CUDA graphs that captured the pointers stay right).
    """

    a_pool: torch.Tensor
    """1-D flat buffer holding A rows: ``A_a[j, :]`` is ``a_pool[a_offsets[a, j] : ... + in_dim]``."""
    b_pool: torch.Tensor
    """1-D flat buffer holding B^T rows: ``B_a[:, j]`` is ``b_pool[b_offsets[a, j] : ... + out_dim]``
    (may be the same tensor as ``a_pool``: the unified pool keeps both in KV-cache pages)."""
    a_offsets: torch.Tensor
    """[num_adapters, r_max] int64: element offset in a_pool of each A row; entries j >= rank[a] unread."""
    b_offsets: torch.Tensor
    """[num_adapters, r_max] int64: element offset in b_pool of each B^T row; entries j >= rank[a] unread."""
    rank: torch.Tensor
    """[num_adapters] int32: each slot's rank (0 = slot unused, or projection not adapted in this layer)."""
    scale: torch.Tensor
    """[num_adapters] float32: each slot's LoRA scaling (alpha / r)."""
    in_dim: int
    """Width of an A row (the projection's input features)."""
    out_dim: int
    """Width of a B^T row (the slice's output features)."""
    check: bool = True
    """Validate the table contents at construction (one host sync). False: shapes, dtypes, devices
    and strides only, no device sync (static tables the worker refills every step)."""
    offset_align: int = 1
    """Promise: every offset the tables hold (now and after refills) is a multiple of this many
    elements (a power of two). The kernels then use vector loads of up to 16 bytes; 1 (the default)
    allows any offset. Checked against the contents when ``check`` is true."""

    def __post_init__(self) -> None:
        a, b, ao, bo, rank, scale = self.a_pool, self.b_pool, self.a_offsets, self.b_offsets, self.rank, self.scale
        if a.dim() != 1 or b.dim() != 1 or a.stride(0) != 1 or b.stride(0) != 1:
            raise ValueError(f"lora: a_pool {list(a.shape)} and b_pool {list(b.shape)} must be 1-D contiguous "
                             "flat buffers")
        if a.dtype not in DTYPES or b.dtype != a.dtype:
            raise ValueError(f"lora: pool dtypes {a.dtype} / {b.dtype}: want one of float32, float16, bfloat16")
        if isinstance(self.in_dim, bool) or not isinstance(self.in_dim, int) or self.in_dim < 1:
            raise ValueError(f"lora: in_dim {self.in_dim!r}: want a positive int")
        if isinstance(self.out_dim, bool) or not isinstance(self.out_dim, int) or self.out_dim < 1:
            raise ValueError(f"lora: out_dim {self.out_dim!r}: want a positive int")
        if ao.dim() != 2 or ao.dtype != torch.int64 or ao.shape[1] < 1 or ao.stride(1) != 1:
            raise ValueError(f"lora: a_offsets {list(ao.shape)} {ao.dtype}: want [num_adapters, r_max >= 1] "
                             "int64 with a contiguous last dim")
        if bo.shape != ao.shape or bo.dtype != torch.int64 or bo.stride(1) != 1:
            raise ValueError(f"lora: b_offsets {list(bo.shape)} {bo.dtype}: want {list(ao.shape)} int64 "
                             "(like a_offsets) with a contiguous last dim")
        n = ao.shape[0]
        if rank.shape != (n,) or rank.dtype != torch.int32 or rank.stride(0) != 1:
            raise ValueError(f"lora: rank {list(rank.shape)} {rank.dtype}: want [{n}] int32, contiguous")
        if scale.shape != (n,) or scale.dtype != torch.float32 or scale.stride(0) != 1:
            raise ValueError(f"lora: scale {list(scale.shape)} {scale.dtype}: want [{n}] float32, contiguous")
        if len({t.device for t in (a, b, ao, bo, rank, scale)}) != 1:
            raise ValueError("lora: pools, offsets, rank and scale must be on one device")
        al = self.offset_align
        if isinstance(al, bool) or not isinstance(al, int) or al < 1 or al & (al - 1):
            raise ValueError(f"lora: offset_align {al!r}: want a power of two >= 1")
        for name, pool in (("a_pool", a), ("b_pool", b)):
            if pool.data_ptr() % (al * pool.element_size()):
                raise ValueError(f"lora: {name} starts at an address that is not a multiple of "
                                 f"offset_align = {al} elements")
        if self.check:
            self._check_contents()

    def _check_contents(self) -> None:
        """Ranks in 0 .. r_max; every used row ``[off, off + dim)`` inside its pool (one host sync)."""
        ranks = self.rank.tolist()
        for slot, r in enumerate(ranks):
            if not 0 <= r <= self.r_max:
                raise ValueError(f"lora: adapter {slot} has rank {r}, outside 0 .. r_max = {self.r_max}")
        used = torch.arange(self.r_max, device=self.rank.device)[None, :] < self.rank[:, None]
        for name, offs, dim, pool in (("a_offsets", self.a_offsets, self.in_dim, self.a_pool),
                                      ("b_offsets", self.b_offsets, self.out_dim, self.b_pool)):
            o = offs[used].tolist()
            where = used.nonzero().tolist()
            for (slot, j), x in zip(where, o):
                if x < 0 or x + dim > pool.numel():
                    raise ValueError(f"lora: {name}[{slot}, {j}] = {x}: row [{x}, {x + dim}) is outside the pool "
                                     f"of {pool.numel()} elements")
                if x % self.offset_align:
                    raise ValueError(f"lora: {name}[{slot}, {j}] = {x} is not a multiple of offset_align = "
                                     f"{self.offset_align}")

    @property
    def num_adapters(self) -> int:
        return self.a_offsets.shape[0]

    @property
    def r_max(self) -> int:
        return self.a_offsets.shape[1]


@dataclass(frozen=True)
class LoraSlice:
    """One output slice of a (fused) projection: columns ``offset .. offset + size`` of out."""

    offset: int
    """First output column of the slice (qkv: 0, q_size, q_size + kv_size)."""
    size: int
    """Columns of the slice; equals weights.out_dim."""
    weights: LoraWeights | None
    """The slice's adapters, or None: the slice has no LoRA and is left untouched."""


@dataclass(frozen=True)
class LoraStack:
    """The adapted slices of one fused module (qkv: 3, gate_up: 2, o / down: 1) with stacked tables,
    so ``lora_delta_stacked`` adds all their deltas in one shrink and one expand launch.

    Slice ``i`` is exactly ``LoraWeights(a_pool, b_pool, a_offsets[i], b_offsets[i], rank[i],
    scale[i], in_dim, out_dims[i])`` writing columns ``out_offsets[i] .. + out_dims[i]`` of out
    (``slice_weights``). The tables may be views with any uniform stride between slices (the
    adapter pool's ``a_off[s0:s1]``, ``rank[layer, s0:s1]``), refilled in place between calls like a
    ``LoraWeights``' tables. An adapter with rank 0 in a slice adds nothing to that slice.
    """

    a_pool: torch.Tensor
    """1-D flat buffer holding every slice's A rows (the slices share one input, x)."""
    b_pool: torch.Tensor
    """1-D flat buffer holding every slice's B^T rows (may be the same tensor as ``a_pool``)."""
    a_offsets: torch.Tensor
    """[n_slices, num_adapters, r_max] int64: element offset in a_pool of A row j of adapter a in slice i."""
    b_offsets: torch.Tensor
    """[n_slices, num_adapters, r_max] int64: element offset in b_pool of B^T row j (out_dims[i] elements)."""
    rank: torch.Tensor
    """[n_slices, num_adapters] int32: each adapter's rank per slice (0: the slice is not adapted by it)."""
    scale: torch.Tensor
    """[n_slices, num_adapters] float32: each adapter's LoRA scaling per slice."""
    in_dim: int
    """Width of an A row (the module's input features, shared by its slices)."""
    out_dims: tuple[int, ...]
    """Columns of each slice (qkv of a GQA model: q_size, kv_size, kv_size)."""
    out_offsets: tuple[int, ...]
    """First column of each slice in out (increasing; slices may not overlap, gaps stay untouched)."""
    check: bool = True
    """As ``LoraWeights.check``: validate the table contents at construction (a host sync per slice)."""
    offset_align: int = 1
    """As ``LoraWeights.offset_align``: every offset of every slice is a multiple of it."""
    slice_weights: tuple[LoraWeights, ...] = field(init=False, repr=False, compare=False)
    """Slice i as a ``LoraWeights`` (views of the stacked tables): validation and the reference."""
    out_dims_dev: torch.Tensor = field(init=False, repr=False, compare=False)
    """``out_dims`` as [n_slices] int32 on the device: the stacked expand reads each slice's width."""
    out_offsets_dev: torch.Tensor = field(init=False, repr=False, compare=False)
    """``out_offsets`` as [n_slices] int64 on the device: the stacked expand reads each slice's first column."""

    def __post_init__(self) -> None:
        ao, bo, rank, scale = self.a_offsets, self.b_offsets, self.rank, self.scale
        if ao.dim() != 3 or ao.shape[0] < 1:
            raise ValueError(f"lora: stacked a_offsets {list(ao.shape)}: want [n_slices >= 1, num_adapters, r_max]")
        n, slots = ao.shape[0], ao.shape[1]
        if bo.dim() != 3 or bo.shape != ao.shape:
            raise ValueError(f"lora: stacked b_offsets {list(bo.shape)}: want {list(ao.shape)} (like a_offsets)")
        for name, t in (("rank", rank), ("scale", scale)):
            if t.dim() != 2 or t.shape != (n, slots):
                raise ValueError(f"lora: stacked {name} {list(t.shape)}: want [n_slices = {n}, num_adapters = {slots}]")
        dims, offs = tuple(self.out_dims), tuple(self.out_offsets)
        if len(dims) != n or len(offs) != n:
            raise ValueError(f"lora: {n} stacked slices but {len(dims)} out_dims and {len(offs)} out_offsets")
        for i, (d, o) in enumerate(zip(dims, offs)):
            if isinstance(o, bool) or not isinstance(o, int) or o < 0:
                raise ValueError(f"lora: stacked slice {i}: out_offset {o!r}: want an int >= 0")
            if i and o < offs[i - 1] + dims[i - 1]:
                raise ValueError(f"lora: stacked slice {i} starts at column {o}, inside slice {i - 1} "
                                 f"(columns {offs[i - 1]} .. {offs[i - 1] + dims[i - 1]}): want increasing, "
                                 "non-overlapping slices")
        ws = []
        for i in range(n):
            try:  # every per-slice check (pools, dtypes, dims, strides, devices, contents, alignment)
                ws.append(LoraWeights(self.a_pool, self.b_pool, ao[i], bo[i], rank[i], scale[i], self.in_dim,
                                      dims[i], check=self.check, offset_align=self.offset_align))
            except ValueError as e:
                raise ValueError(f"lora: stacked slice {i}: {e}") from None
        object.__setattr__(self, "out_dims", dims)
        object.__setattr__(self, "out_offsets", offs)
        object.__setattr__(self, "slice_weights", tuple(ws))
        dev = self.a_pool.device
        object.__setattr__(self, "out_dims_dev", torch.tensor(dims, dtype=torch.int32, device=dev))
        object.__setattr__(self, "out_offsets_dev", torch.tensor(offs, dtype=torch.int64, device=dev))

    @classmethod
    def from_slices(cls, slices: Sequence[LoraSlice]) -> "LoraStack":
        """The stack of a module's slices (those with weights) whose ``LoraWeights`` share their pools
        and whose tables are views of one tensor each, a uniform stride apart (the adapter pool's
        per-projection weights). No copy: refilling the per-slice tables refills the stack. Raises
        ValueError naming what differs when the slices cannot be stacked that way."""
        used = [(i, s) for i, s in enumerate(slices) if s.weights is not None]
        if not used:
            raise ValueError("lora: LoraStack.from_slices needs at least one slice with weights")
        ws = [s.weights for _, s in used]
        w0 = ws[0]
        for (i, s), w in zip(used, ws):
            if w.a_pool.data_ptr() != w0.a_pool.data_ptr() or w.a_pool.shape != w0.a_pool.shape \
                    or w.b_pool.data_ptr() != w0.b_pool.data_ptr() or w.b_pool.shape != w0.b_pool.shape:
                raise ValueError(f"lora: slice {i} does not share the first slice's a_pool / b_pool")
            if w.in_dim != w0.in_dim:
                raise ValueError(f"lora: slice {i} has in_dim {w.in_dim}, the first slice {w0.in_dim}")
            if w.out_dim != s.size:
                raise ValueError(f"lora: slice {i} has {s.size} columns, its weights out_dim {w.out_dim}")
        stacked = {name: _stack_views(name, [getattr(w, name) for w in ws])
                   for name in ("a_offsets", "b_offsets", "rank", "scale")}
        return cls(w0.a_pool, w0.b_pool, in_dim=w0.in_dim, out_dims=tuple(s.size for _, s in used),
                   out_offsets=tuple(s.offset for _, s in used), check=all(w.check for w in ws),
                   offset_align=min(w.offset_align for w in ws), **stacked)

    def as_slices(self) -> list[LoraSlice]:
        """The stack as ``lora_delta`` slices (the per-slice path the stacked op equals)."""
        return [LoraSlice(o, d, w) for o, d, w in zip(self.out_offsets, self.out_dims, self.slice_weights)]

    @property
    def num_slices(self) -> int:
        return self.a_offsets.shape[0]

    @property
    def num_adapters(self) -> int:
        return self.a_offsets.shape[1]

    @property
    def r_max(self) -> int:
        return self.a_offsets.shape[2]

    @property
    def out_width(self) -> int:
        """Columns out needs at least: the end of the last slice."""
        return self.out_offsets[-1] + self.out_dims[-1]


def _stack_views(name: str, views: Sequence[torch.Tensor]) -> torch.Tensor:
    """``views`` (equal shapes and strides, one storage, a uniform element stride apart) as one
    [len(views), *shape] view of that storage; ValueError naming ``name`` otherwise."""
    v0 = views[0]
    step = views[1].storage_offset() - v0.storage_offset() if len(views) > 1 else v0.numel()
    for i, v in enumerate(views):
        if (v.shape != v0.shape or v.stride() != v0.stride() or v.dtype != v0.dtype or v.device != v0.device
                or v.untyped_storage().data_ptr() != v0.untyped_storage().data_ptr()):
            raise ValueError(f"lora: slice {i}'s {name} is not a view of the first slice's {name} tensor "
                             "with the same shape and strides: build a LoraStack from stacked tables")
        if v.storage_offset() != v0.storage_offset() + i * step:
            raise ValueError(f"lora: the slices' {name} are not a uniform stride apart in their tensor")
    if step <= 0:
        raise ValueError(f"lora: the slices' {name} must lie at increasing addresses in their tensor")
    return v0.as_strided((len(views), *v0.shape), (step, *v0.stride()), v0.storage_offset())


def _check_call(op: str, x: torch.Tensor, w: LoraWeights, meta: LoraMeta, width: int, width_name: str) -> None:
    if x.dim() != 2 or x.shape[0] != meta.num_tokens:
        raise ValueError(f"{op}: input {list(x.shape)} must be [T = {meta.num_tokens}, {width_name}]")
    if x.shape[1] != width:
        raise ValueError(f"{op}: input has {x.shape[1]} columns, the weights want {width_name} = {width}")
    if x.dtype != w.a_pool.dtype:
        raise ValueError(f"{op}: dtype mismatch: input {x.dtype}, adapter weights {w.a_pool.dtype}")
    if x.device != w.a_pool.device or x.device != meta.seg_start.device:
        raise ValueError(f"{op}: input on {x.device}, weights on {w.a_pool.device}, meta on {meta.seg_start.device}")
    if meta.max_adapter >= w.num_adapters:
        raise ValueError(f"{op}: adapter id {meta.max_adapter} out of range (the weights have "
                         f"{w.num_adapters} slots)")


def _check_out(op: str, out: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> None:
    if out.dim() != 2 or out.shape != (meta.num_tokens, w.out_dim):
        raise ValueError(f"{op}: out {list(out.shape)} must be [T = {meta.num_tokens}, out_dim = {w.out_dim}]")
    if out.dtype != w.b_pool.dtype:
        raise ValueError(f"{op}: dtype mismatch: out {out.dtype}, adapter weights {w.b_pool.dtype}")
    if out.stride(-1) != 1:
        raise ValueError(f"{op}: out needs a contiguous last dim (it is updated in place)")


# ----------------------------------------------------------------------------- torch references


def _token_groups(meta: LoraMeta) -> dict[int, torch.Tensor]:
    """Token indices per adapter (-1 left out), from the host copy of the metadata."""
    groups: dict[int, list[int]] = {}
    for s, a in enumerate(meta.seg_adapter_host):
        if a >= 0:
            groups.setdefault(a, []).extend(range(meta.seg_start_host[s], meta.seg_start_host[s + 1]))
    return {a: torch.tensor(t, dtype=torch.long, device=meta.seg_start.device) for a, t in groups.items() if t}


def _gather_rows(pool: torch.Tensor, offsets: torch.Tensor, dim: int) -> torch.Tensor:
    """[r, dim] float32: rows ``pool[offsets[i] : offsets[i] + dim]``."""
    idx = offsets.to(torch.long)[:, None] + torch.arange(dim, device=pool.device)[None, :]
    return pool[idx].float()


def lora_shrink_ref(x: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> torch.Tensor:
    """Torch reference and CPU path of ``lora_shrink`` (module docstring): gather + matmul per adapter."""
    _check_call("lora_shrink", x, w, meta, w.in_dim, "in_dim")
    v = torch.zeros(x.shape[0], w.r_max, dtype=x.dtype, device=x.device)
    ranks = w.rank.tolist()
    for a, tok in _token_groups(meta).items():
        r = ranks[a]
        if r:
            v[tok, :r] = (x[tok].float() @ _gather_rows(w.a_pool, w.a_offsets[a, :r], w.in_dim).T).to(x.dtype)
    return v


def lora_expand_ref(v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> torch.Tensor:
    """Torch reference and CPU path of ``lora_expand``: ``out += scale * v B^T`` per adapter, in place."""
    _check_call("lora_expand", v, w, meta, w.r_max, "r_max")
    _check_out("lora_expand", out, w, meta)
    ranks, scales = w.rank.tolist(), w.scale.tolist()
    for a, tok in _token_groups(meta).items():
        r = ranks[a]
        if r:
            delta = v[tok, :r].float() @ _gather_rows(w.b_pool, w.b_offsets[a, :r], w.out_dim)
            out[tok] = (out[tok].float() + scales[a] * delta).to(out.dtype)
    return out


# ----------------------------------------------------------------------------- Triton kernels
#
# Every kernel reads a rank row at ``pool + offset + k`` with the int64 offset loaded from the
# adapter's row of the offsets table; ``tl.multiple_of(offset, ALIGN)`` (LoraWeights.offset_align)
# lets the compiler use vector loads. Ranks are clamped to r_max, so a bad rank in an unchecked
# table never reads past the offsets row.


@triton.jit
def _row_offsets(off_row_ptr, rs, r_ok, ALIGN: tl.constexpr):
    """int64 element offsets of rank rows ``rs`` (0 where masked), with the alignment promise."""
    off = tl.load(off_row_ptr + rs, mask=r_ok, other=0)
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return off


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, v_ptr, seg_start_ptr, seg_adapter_ptr, tiles_ptr, a_off_ptr, rank_ptr,
                        K, R_MAX, R_TILES, x_stride, v_slice_stride, v_stride, off_slice_stride, off_stride,
                        rank_slice_stride,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RNE: tl.constexpr):
    """Program (token tile, slice * R_TILES + r tile): ``v[slice, rows, r tile] = x[rows] A^T``, the
    tile's (segment, first row) from ``tiles_ptr``."""
    seg = tl.load(tiles_ptr + 2 * tl.program_id(0))
    m0 = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    sl = tl.program_id(1) // R_TILES
    adapter = tl.load(seg_adapter_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    rank = tl.minimum(tl.load(rank_ptr + sl * rank_slice_stride + tl.maximum(adapter, 0)), R_MAX)
    r0 = (tl.program_id(1) % R_TILES) * BLOCK_R
    if (adapter < 0 or m0 >= end) or r0 >= rank:  # pairs: triton 3.6 refuses chained and/or
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rs = r0 + tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    off_row = a_off_ptr + sl.to(tl.int64) * off_slice_stride + adapter.to(tl.int64) * off_stride
    off = _row_offsets(off_row, rs, r_ok, ALIGN)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    a_rows = a_ptr + off[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 tiles everywhere there
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)
    ty = v_ptr.dtype.element_ty
    v_ptrs = v_ptr + sl.to(tl.int64) * v_slice_stride + rows.to(tl.int64)[:, None] * v_stride + rs[None, :]
    tl.store(v_ptrs, round_to(acc, ty, RNE).to(ty), mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _sgmv_expand_kernel(v_ptr, b_ptr, out_ptr, seg_start_ptr, seg_adapter_ptr, tiles_ptr, b_off_ptr, rank_ptr,
                        scale_ptr, dims_ptr, cols_ptr, N, R_MAX, N_TILES, v_slice_stride, v_stride, out_stride,
                        off_slice_stride, off_stride, rank_slice_stride, scale_slice_stride,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RNE: tl.constexpr, STACKED: tl.constexpr):
    """Program (token tile, slice * N_TILES + n tile): ``out[rows, slice's n tile] += scale v B^T``,
    the tile's (segment, first row) from ``tiles_ptr``. STACKED: the slice's width and first column
    of out come from ``dims_ptr`` / ``cols_ptr`` (tiles past a narrower slice's width exit at once);
    else one slice of N columns at column 0."""
    seg = tl.load(tiles_ptr + 2 * tl.program_id(0))
    m0 = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    sl = tl.program_id(1) // N_TILES
    adapter = tl.load(seg_adapter_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    if adapter < 0 or m0 >= end:
        return
    n0 = (tl.program_id(1) % N_TILES) * BLOCK_N
    width = N
    col0 = 0
    if STACKED:
        width = tl.load(dims_ptr + sl)
        col0 = tl.load(cols_ptr + sl)
    rank = tl.minimum(tl.load(rank_ptr + sl * rank_slice_stride + adapter), R_MAX)
    if n0 >= width or rank <= 0:  # past this slice's columns, or the slice not adapted by this adapter
        return
    scale = tl.load(scale_ptr + sl * scale_slice_stride + adapter)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < width
    v_rows = v_ptr + sl.to(tl.int64) * v_slice_stride + rows.to(tl.int64)[:, None] * v_stride
    off_row = b_off_ptr + sl.to(tl.int64) * off_slice_stride + adapter.to(tl.int64) * off_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # the segment's own rank, in tiles of BLOCK_R
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        off = _row_offsets(off_row, rs, r_ok, ALIGN)
        vt = tl.load(v_rows + rs[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + off[:, None] + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            vt = vt.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(vt, bt, acc, input_precision=DOT_PREC)
    ty = out_ptr.dtype.element_ty
    o_ptrs = out_ptr + col0 + rows.to(tl.int64)[:, None] * out_stride + ns[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + scale * acc, ty, RNE).to(ty), mask=mask)


@triton.jit
def _block_row_offsets(off_rows, rs, r_ok, ALIGN: tl.constexpr):
    """``_row_offsets`` for a row block: [BLOCK_T, BLOCK_R] offsets of rank rows ``rs`` of each
    row's adapter, ``off_rows`` [BLOCK_T] pointing at the adapters' rows of the offsets table."""
    off = tl.load(off_rows[:, None] + rs[None, :], mask=r_ok, other=0)
    if ALIGN > 1:
        off = tl.multiple_of(off, [ALIGN, ALIGN])
    return off


@triton.jit
def _block_rows(row_adapter_ptr, T, BLOCK_T: tl.constexpr):
    """This program's row block (axis 0): its rows ``ts`` (int64), which exist (``t_ok``), which
    have an adapter (``has``) and their adapter slots (0 where none). One dependent load."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = ts < T
    ts = ts.to(tl.int64)
    adapter = tl.load(row_adapter_ptr + ts, mask=t_ok, other=-1)
    return ts, t_ok, adapter >= 0, tl.maximum(adapter, 0).to(tl.int64)


@triton.jit
def _block_ranks(slot, has, rank_ptr, R_MAX):
    """Each row's rank in the slice whose rank table starts at ``rank_ptr`` (0: no adapter, or the
    slice not adapted by it)."""
    return tl.where(has, tl.minimum(tl.load(rank_ptr + slot, mask=has, other=0), R_MAX), 0)


@triton.jit
def _shrink_rank_tile(a_ptr, off, xk, ks, k_ok, rs, r_ok, p_rows):
    """One rank tile of a row block's shrink: the A rows [BLOCK_T, BLOCK_R, BLOCK_K] at ``off``
    times the rows' x columns ``xk``, summed over the columns into the partials at ``p_rows``."""
    at = tl.load(a_ptr + off[:, :, None] + ks[None, None, :], mask=r_ok[:, :, None] & k_ok[None, None, :], other=0.0)
    tl.store(p_rows[:, None] + rs[None, :], tl.sum(at.to(tl.float32) * xk[:, None, :], axis=2), mask=r_ok)


@triton.jit
def _mbgmv_shrink_kernel(x_ptr, a_ptr, part_ptr, row_adapter_ptr, a_off_ptr, rank_ptr,
                         T, K, R_MAX, x_stride, part_slice_stride, part_split_stride, part_stride,
                         off_slice_stride, off_stride, rank_slice_stride,
                         BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr):
    """Program (row block, s, slice): for each of the block's BLOCK_T rows, its partial dot products
    over input columns s*BLOCK_K .. +BLOCK_K for every rank row up to the row's own rank in that
    slice, into ``part[slice, s, t, :rank]`` (float32, no atomics). One slice: slice strides 0,
    grid (row blocks, SPLIT, 1).

    Latency, not bytes, bounds these small programs, so the dependent loads are kept to three
    rounds: the rows' adapters and x; then their ranks and the first rank tile's offsets (loaded
    before the rank is known: the offsets table is r_max wide); then the A rows, as one
    [BLOCK_T, BLOCK_R, BLOCK_K] gather. Rank tiles past the first (ranks above BLOCK_R) loop after."""
    s = tl.program_id(1)
    sl = tl.program_id(2).to(tl.int64)
    ts, t_ok, has, slot = _block_rows(row_adapter_ptr, T, BLOCK_T)
    ks = s * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    xk = tl.load(x_ptr + ts[:, None] * x_stride + ks[None, :], mask=t_ok[:, None] & k_ok[None, :],
                 other=0.0).to(tl.float32)
    off_rows = a_off_ptr + sl * off_slice_stride + slot * off_stride
    rs = tl.arange(0, BLOCK_R)
    off = _block_row_offsets(off_rows, rs, has[:, None] & (rs < R_MAX)[None, :], ALIGN)
    rank = _block_ranks(slot, has, rank_ptr + sl * rank_slice_stride, R_MAX)
    top = tl.max(rank, axis=0)
    if top <= 0:
        return
    p_rows = part_ptr + sl * part_slice_stride + s.to(tl.int64) * part_split_stride + ts * part_stride
    _shrink_rank_tile(a_ptr, off, xk, ks, k_ok, rs, rs[None, :] < rank[:, None], p_rows)
    for r0 in range(BLOCK_R, top, BLOCK_R):  # the block's largest rank; each row masked to its own
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs[None, :] < rank[:, None]
        _shrink_rank_tile(a_ptr, _block_row_offsets(off_rows, rs, r_ok, ALIGN), xk, ks, k_ok, rs, r_ok, p_rows)


@triton.jit
def _expand_rank_tile(b_ptr, off, parts, r_ok, ns, o_mask, ty: tl.constexpr, RNE: tl.constexpr):
    """One rank tile's share of a row block's expand: v = round(sum of the tile's partials) (as
    ``lora_shrink`` rounds it; partials past a row's rank are ignored, they were never written),
    times the B rows [BLOCK_T, BLOCK_R, BLOCK_N], summed over the tile's rank rows."""
    vr = round_to(tl.sum(tl.where(r_ok[None, :, :], parts.to(tl.float32), 0.0), axis=0), ty, RNE)
    bt = tl.load(b_ptr + off[:, :, None] + ns[None, None, :], mask=r_ok[:, :, None] & o_mask[:, None, :], other=0.0)
    return tl.sum(vr[:, :, None] * bt.to(tl.float32), axis=1)


@triton.jit
def _mbgmv_expand_kernel(v_ptr, b_ptr, out_ptr, row_adapter_ptr, b_off_ptr, rank_ptr, scale_ptr, dims_ptr, cols_ptr,
                         T, N, R_MAX, SPLIT, v_slice_stride, v_split_stride, v_stride, out_stride,
                         off_slice_stride, off_stride, rank_slice_stride, scale_slice_stride,
                         BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_S: tl.constexpr, ALIGN: tl.constexpr, RNE: tl.constexpr, STACKED: tl.constexpr):
    """Program (row block, n, slice): for each of the block's BLOCK_T rows t,
    ``out[t, n tile] += scale * round(sum_s v[s, t, :rank]) B^T[:rank, n tile]``.

    STACKED: the slice's width and first column of out come from ``dims_ptr`` / ``cols_ptr`` and the
    grid covers the widest slice (tiles past a narrower slice's width exit at once); else one slice
    of N columns at column 0 (slice strides 0, grid (row blocks, tiles, 1)).

    ``v`` is either the shrink's float32 partials (SPLIT of them, summed in a fixed order: the result
    is deterministic) or a finished v in the out dtype (SPLIT = 1; the rounding is then exact).
    Three rounds of dependent loads, as in the shrink: the rows' adapters, out tile and first rank
    tile's partials; their ranks, scales and first rank tile's offsets; the B rows, one
    [BLOCK_T, BLOCK_R, BLOCK_N] gather. Rank tiles past the first loop after."""
    sl = tl.program_id(2).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    width = N
    col0 = 0
    if STACKED:
        width = tl.load(dims_ptr + sl)
        col0 = tl.load(cols_ptr + sl)
    if n0 >= width:
        return
    ts, t_ok, has, slot = _block_rows(row_adapter_ptr, T, BLOCK_T)
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < width
    o_ptrs = out_ptr + col0 + ts[:, None] * out_stride + ns[None, :]
    o = tl.load(o_ptrs, mask=t_ok[:, None] & n_ok[None, :], other=0.0)
    ss = tl.arange(0, BLOCK_S)
    s_ok = ss < SPLIT
    v_rows = v_ptr + sl * v_slice_stride + ss.to(tl.int64)[:, None] * v_split_stride + ts[None, :] * v_stride
    rs = tl.arange(0, BLOCK_R)
    parts = tl.load(v_rows[:, :, None] + rs[None, None, :],
                    mask=s_ok[:, None, None] & t_ok[None, :, None] & (rs < R_MAX)[None, None, :], other=0.0)
    off_rows = b_off_ptr + sl * off_slice_stride + slot * off_stride
    off = _block_row_offsets(off_rows, rs, has[:, None] & (rs < R_MAX)[None, :], ALIGN)
    rank = _block_ranks(slot, has, rank_ptr + sl * rank_slice_stride, R_MAX)
    scale = tl.load(scale_ptr + sl * scale_slice_stride + slot, mask=has, other=0.0)
    top = tl.max(rank, axis=0)
    if top <= 0:  # no row of the block is adapted in this slice: out stays as it is
        return
    ty = out_ptr.dtype.element_ty
    o_mask = (rank > 0)[:, None] & n_ok[None, :]
    acc = _expand_rank_tile(b_ptr, off, parts, rs[None, :] < rank[:, None], ns, o_mask, ty, RNE)
    for r0 in range(BLOCK_R, top, BLOCK_R):  # the block's largest rank; each row masked to its own
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs[None, :] < rank[:, None]
        parts = tl.load(v_rows[:, :, None] + rs[None, None, :], mask=s_ok[:, None, None] & r_ok[None, :, :],
                        other=0.0)
        off = _block_row_offsets(off_rows, rs, r_ok, ALIGN)
        acc += _expand_rank_tile(b_ptr, off, parts, r_ok, ns, o_mask, ty, RNE)
    tl.store(o_ptrs, round_to(o.to(tl.float32) + scale[:, None] * acc, ty, RNE).to(ty), mask=o_mask)


@triton.jit
def _mbgmv_finish_kernel(part_ptr, v_ptr, row_adapter_ptr, rank_ptr, R_MAX, SPLIT, part_split_stride, part_stride,
                         v_stride, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, RNE: tl.constexpr):
    """``v[t, r tile] = round(sum_s part[s, t, r tile])``, 0 past the row's rank and for rows of -1."""
    t = tl.program_id(0).to(tl.int64)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    adapter = tl.load(row_adapter_ptr + t)
    rank = tl.where(adapter >= 0, tl.minimum(tl.load(rank_ptr + tl.maximum(adapter, 0)), R_MAX), 0)
    ss = tl.arange(0, BLOCK_S)
    parts = tl.load(part_ptr + ss.to(tl.int64)[:, None] * part_split_stride + t * part_stride + rs[None, :],
                    mask=(ss < SPLIT)[:, None] & (rs < rank)[None, :], other=0.0)
    acc = tl.sum(parts, axis=0)
    ty = v_ptr.dtype.element_ty
    tl.store(v_ptr + t * v_stride + rs, round_to(acc, ty, RNE).to(ty), mask=rs < R_MAX)


def _dot_flags(t: torch.Tensor) -> tuple[bool, str]:
    """(UPCAST, DOT_PREC): fp32 tiles under the interpreter; fp32 dots in IEEE precision, not TF32."""
    upcast = not t.is_cuda
    return upcast, "ieee" if upcast or t.dtype == torch.float32 else "tf32"


MB_SHRINK_LAUNCH: tuple[tuple[int, tuple[int, int, int, int]], ...] = (
    (4, (1, 16, 128, 4)),
    (32, (1, 16, 128, 1)),
    (1 << 30, (1, 16, 256, 1)),
)
"""MBGMV shrink launch by step size: ``(up to T tokens, (BLOCK_T, BLOCK_R, BLOCK_K, num_warps))``,
the first entry whose bound holds. Shape-only (CUDA-graph safe). Tuned on an H200 inside CUDA
graphs over the four modules of a Llama-2-7B layer (rank 16, r_max 128; ``bench/README.md``):
these small programs are latency-bound, so many narrow one-warp programs (more of them resident
per SM) beat wide ones once there are 16+ rows; a step of one or two requests still spreads its
adapter rows over many 4-warp programs."""

MB_EXPAND_LAUNCH: tuple[tuple[int, tuple[int, int, int, int]], ...] = (
    (4, (1, 16, 64, 1)),
    (1 << 30, (1, 16, 128, 1)),
)
"""MBGMV expand launch by step size: ``(up to T tokens, (BLOCK_T, BLOCK_R, BLOCK_N, num_warps))``,
tuned as ``MB_SHRINK_LAUNCH`` (one warp per program and 128 columns won from 1 to 256 rows; row
blocks, BLOCK_T > 1, won only with 4-warp programs)."""


def _mb_launch(table: tuple[tuple[int, tuple[int, int, int, int]], ...], tokens: int) -> tuple[int, int, int, int]:
    """The launch of ``MB_SHRINK_LAUNCH`` / ``MB_EXPAND_LAUNCH`` for a step of ``tokens`` rows."""
    return next(cfg for bound, cfg in table if tokens <= bound)


@dataclass(frozen=True)
class _Tables:
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

    @staticmethod
    def of(w: "LoraWeights | LoraStack") -> "_Tables":
        if isinstance(w, LoraStack):
            return _Tables(w.num_slices, w.a_offsets, w.b_offsets, w.rank, w.scale, w.a_offsets.stride(0),
                           w.a_offsets.stride(1), w.b_offsets.stride(0), w.b_offsets.stride(1), w.rank.stride(0),
                           w.scale.stride(0), w.out_dims_dev, w.out_offsets_dev, max(w.out_dims), True)
        # One slice: slice strides 0; dims / cols are never read (STACKED false), any pointer will do.
        return _Tables(1, w.a_offsets, w.b_offsets, w.rank, w.scale, 0, w.a_offsets.stride(0), 0,
                       w.b_offsets.stride(0), 0, 0, w.rank, w.rank, w.out_dim, False)


def _mbgmv_shrink_partials(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta) -> torch.Tensor:
    """Launches the MBGMV shrink, grid (row blocks, SPLIT, n_slices); returns its float32 partials
    [n_slices, SPLIT, T, r_max] (only the entries of rows with an adapter and columns below their
    rank in that slice are written). A ``LoraWeights`` is one slice."""
    t = x.shape[0]
    bt, br, bk, warps = _mb_launch(MB_SHRINK_LAUNCH, t)
    split = triton.cdiv(w.in_dim, bk)
    tab = _Tables.of(w)
    part = torch.empty(tab.n, split, t, w.r_max, dtype=torch.float32, device=x.device)
    _mbgmv_shrink_kernel[(triton.cdiv(t, bt), split, tab.n)](
        x, w.a_pool, part, meta.seg_adapter, tab.a_off, tab.rank, t, w.in_dim, w.r_max, x.stride(0),
        part.stride(0), part.stride(1), part.stride(2), tab.a_off_slice, tab.a_off_row, tab.rank_slice,
        BLOCK_T=bt, BLOCK_R=br, BLOCK_K=bk, ALIGN=_align(w, w.a_pool), num_warps=warps)
    return part


def _mbgmv_expand(v: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, out: torch.Tensor) -> None:
    """Launches the MBGMV expand, grid (row blocks, column tiles of the widest slice, n_slices), over
    ``v`` = partials [n_slices, SPLIT, T, r_max] float32 or a finished [T, r_max] (one slice).
    ``out`` is the slice's columns (``LoraWeights``) or the whole output (``LoraStack``: columns
    from out_offsets)."""
    part = v if v.dim() == 4 else v[None, None]
    tab = _Tables.of(w)
    t = out.shape[0]
    bt, br, bn, warps = _mb_launch(MB_EXPAND_LAUNCH, t)
    _mbgmv_expand_kernel[(triton.cdiv(t, bt), triton.cdiv(tab.max_width, bn), tab.n)](
        part, w.b_pool, out, meta.seg_adapter, tab.b_off, tab.rank, tab.scale, tab.dims, tab.cols,
        t, tab.max_width, w.r_max, part.shape[1], part.stride(0), part.stride(1), part.stride(2), out.stride(0),
        tab.b_off_slice, tab.b_off_row, tab.rank_slice, tab.scale_slice,
        BLOCK_T=bt, BLOCK_R=br, BLOCK_N=bn, BLOCK_S=triton.next_power_of_2(part.shape[1]),
        ALIGN=_align(w, w.b_pool), RNE=needs_rne_by_hand(out), STACKED=tab.stacked, num_warps=warps)


def _sgmv_shrink(x: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, v: torch.Tensor) -> None:
    """Launches the SGMV shrink into ``v`` ([T, r_max] for one slice, [n_slices, T, r_max] stacked),
    grid (token tiles with an adapter, n_slices * rank tiles)."""
    if not meta.num_tiles:
        return
    tab = _Tables.of(w)
    upcast, prec = _dot_flags(x)
    r_tiles = triton.cdiv(w.r_max, _SG_BLOCK_R)
    vs = v if v.dim() == 3 else v[None]
    grid = (meta.num_tiles, tab.n * r_tiles)
    _sgmv_shrink_kernel[grid](x, w.a_pool, vs, meta.seg_start, meta.seg_adapter, meta.tiles, tab.a_off, tab.rank,
                              w.in_dim, w.r_max, r_tiles, x.stride(0), vs.stride(0), vs.stride(1),
                              tab.a_off_slice, tab.a_off_row, tab.rank_slice,
                              BLOCK_M=_SG_BLOCK_M, BLOCK_R=_SG_BLOCK_R, BLOCK_K=_SG_BLOCK_K, ALIGN=_align(w, w.a_pool),
                              UPCAST=upcast, DOT_PREC=prec, RNE=needs_rne_by_hand(v), num_warps=4)


def _sgmv_expand(v: torch.Tensor, w: LoraWeights | LoraStack, meta: LoraMeta, out: torch.Tensor) -> None:
    """Launches the SGMV expand from ``v`` (as ``_sgmv_shrink`` writes it) into ``out`` (the slice's
    columns, or the whole output for a stack), grid (token tiles with an adapter, n_slices * column
    tiles of the widest slice)."""
    if not meta.num_tiles:
        return
    tab = _Tables.of(w)
    upcast, prec = _dot_flags(v)
    n_tiles = triton.cdiv(tab.max_width, _SG_BLOCK_N)
    vs = v if v.dim() == 3 else v[None]
    grid = (meta.num_tiles, tab.n * n_tiles)
    _sgmv_expand_kernel[grid](vs, w.b_pool, out, meta.seg_start, meta.seg_adapter, meta.tiles, tab.b_off, tab.rank,
                              tab.scale, tab.dims, tab.cols, tab.max_width, w.r_max, n_tiles, vs.stride(0), vs.stride(1),
                              out.stride(0), tab.b_off_slice, tab.b_off_row, tab.rank_slice, tab.scale_slice,
                              BLOCK_M=_SG_BLOCK_M, BLOCK_R=_SG_BLOCK_R, BLOCK_N=_SG_BLOCK_N, ALIGN=_align(w, w.b_pool),
                              UPCAST=upcast, DOT_PREC=prec, RNE=needs_rne_by_hand(out), STACKED=tab.stacked,
                              num_warps=4)


def _align(w: LoraWeights, pool: torch.Tensor) -> int:
    """ALIGN for the kernels: the offsets' promised alignment, capped at one 16-byte vector."""
    return min(w.offset_align, 16 // pool.element_size())


def lora_shrink_triton(x: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> torch.Tensor:
    """Triton kernel for ``lora_shrink`` (no dispatch): MBGMV if ``meta.decode`` else SGMV."""
    _check_call("lora_shrink", x, w, meta, w.in_dim, "in_dim")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = x.shape[0]
    if meta.decode:  # launched whatever the rows' adapters: the grid depends on shapes only
        v = torch.empty(t, w.r_max, dtype=x.dtype, device=x.device)
        if t:
            part = _mbgmv_shrink_partials(x, w, meta)[0]
            _mbgmv_finish_kernel[(t, triton.cdiv(w.r_max, _MB_FINISH_BLOCK_R))](
                part, v, meta.seg_adapter, w.rank, w.r_max, part.shape[0], part.stride(0), part.stride(1),
                v.stride(0), BLOCK_R=_MB_FINISH_BLOCK_R, BLOCK_S=triton.next_power_of_2(part.shape[0]),
                RNE=needs_rne_by_hand(v), num_warps=1)
        return v
    v = torch.zeros(t, w.r_max, dtype=x.dtype, device=x.device)
    if meta.max_adapter < 0 or t == 0:
        return v
    _sgmv_shrink(x, w, meta, v)
    return v


def lora_expand_triton(v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> torch.Tensor:
    """Triton kernel for ``lora_expand`` (no dispatch), in place on ``out``: MBGMV if ``meta.decode`` else SGMV."""
    _check_call("lora_expand", v, w, meta, w.r_max, "r_max")
    _check_out("lora_expand", out, w, meta)
    if v.stride(-1) != 1:
        v = v.contiguous()
    if out.shape[0] == 0:
        return out
    if meta.decode:
        _mbgmv_expand(v, w, meta, out)
        return out
    if meta.max_adapter < 0:
        return out
    _sgmv_expand(v, w, meta, out)
    return out


def _lora_delta_triton(x: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> None:
    """One slice on the Triton path. Decode: the expand reads the shrink's float32 partials directly
    (two launches, no zero fill, no finished v); prefill: SGMV shrink then expand."""
    if not meta.decode:
        lora_expand_triton(lora_shrink_triton(x, w, meta), w, meta, out)
        return
    _check_call("lora_shrink", x, w, meta, w.in_dim, "in_dim")
    _check_out("lora_expand", out, w, meta)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0]:
        _mbgmv_expand(_mbgmv_shrink_partials(x, w, meta), w, meta, out)


# ----------------------------------------------------------------------------- entry points


def lora_shrink(x: torch.Tensor, w: LoraWeights, meta: LoraMeta, *, use_triton: bool | None = None) -> torch.Tensor:
    """``v[t, :rank_a] = x[t] A_a^T`` (module docstring); Triton on CUDA, the reference elsewhere."""
    if want_triton("lora_shrink", x, use_triton):
        return lora_shrink_triton(x, w, meta)
    return lora_shrink_ref(x, w, meta)


def lora_expand(v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor, *,
                use_triton: bool | None = None) -> torch.Tensor:
    """``out[t] += scale_a * v[t, :rank_a] B_a^T`` in place (module docstring); returns ``out``."""
    if want_triton("lora_expand", v, use_triton):
        return lora_expand_triton(v, w, meta, out)
    return lora_expand_ref(v, w, meta, out)


def lora_delta(x: torch.Tensor, out: torch.Tensor, slices: Sequence[LoraSlice], meta: LoraMeta, *,
               use_triton: bool | None = None) -> torch.Tensor:
    """Adds every slice's LoRA delta of ``x`` into its columns of ``out`` (in place); returns ``out``.

    A plain projection is one slice ``LoraSlice(0, out_dim, w)``; qkv is three, gate_up two. The
    adapted linear computes ``out = base(x)`` and then ``lora_delta(x, out, slices, meta)``.
    """
    if out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"lora_delta: out {list(out.shape)} must be [T = {x.shape[0]}, out_width]")
    for i, s in enumerate(slices):
        if s.offset < 0 or s.size < 0 or s.offset + s.size > out.shape[1]:
            raise ValueError(f"lora_delta: slice {i} (columns {s.offset} .. {s.offset + s.size}) is outside "
                             f"out's {out.shape[1]} columns")
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


def lora_delta_stacked(x: torch.Tensor, out: torch.Tensor, stack: LoraStack, meta: LoraMeta, *,
                       use_triton: bool | None = None) -> torch.Tensor:
    """``lora_delta(x, out, stack.as_slices(), meta)`` in two launches for all the stack's slices
    (one shrink, one expand), in place on ``out``; returns ``out``. The adapted linear of a fused
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
    _check_call("lora_delta_stacked", x, stack.slice_weights[0], meta, stack.in_dim, "in_dim")
    if out.dim() != 2 or out.shape[0] != meta.num_tokens or out.shape[1] < stack.out_width:
        raise ValueError(f"lora_delta_stacked: out {list(out.shape)} must be [T = {meta.num_tokens}, "
                         f">= {stack.out_width}] (the last slice ends at column {stack.out_width})")
    if out.dtype != stack.b_pool.dtype:
        raise ValueError(f"lora_delta_stacked: dtype mismatch: out {out.dtype}, adapter weights {stack.b_pool.dtype}")
    if out.stride(-1) != 1:
        raise ValueError("lora_delta_stacked: out needs a contiguous last dim (it is updated in place)")


def _lora_delta_stacked_triton(x: torch.Tensor, out: torch.Tensor, stack: LoraStack, meta: LoraMeta) -> None:
    """All slices on the Triton path, two launches. Decode: MBGMV shrink over (T, SPLIT, n_slices)
    into float32 partials, MBGMV expand over (T, column tiles, n_slices); prefill: SGMV shrink into
    v [n_slices, T, r_max], SGMV expand. Each program computes what the per-slice path's does."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = x.shape[0]
    if t == 0:
        return
    if meta.decode:  # launched whatever the rows' adapters: the grid depends on shapes only
        _mbgmv_expand(_mbgmv_shrink_partials(x, stack, meta), stack, meta, out)
        return
    if meta.max_adapter < 0:
        return
    v = torch.zeros(stack.num_slices, t, stack.r_max, dtype=x.dtype, device=x.device)
    _sgmv_shrink(x, stack, meta, v)
    _sgmv_expand(v, stack, meta, out)


def make_weights(adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None], r_max: int,
                 total_rows: int | None = None, *, perm: torch.Tensor | None = None) -> LoraWeights:
    """Packs per-adapter ``(A [r, in], B [out, r], scale)`` (None: empty slot) into flat pools.

    The pools hold ``total_rows`` rows each (A rows of ``in_dim`` elements in ``a_pool``, B^T rows
    of ``out_dim`` in ``b_pool``); rank row i overall goes to pool row i, or to ``perm[i]`` when
    ``perm`` (a permutation of ``range(total_rows)``) is given, which scatters them as a paged
    allocator would. Offsets are ``row * in_dim`` / ``row * out_dim``; ``offset_align`` is the
    largest power of two (up to 16) dividing both dims. For tests, benchmarks and loaders that have
    the adapters at hand.
    """
    if all(x is None for x in adapters):
        raise ValueError("lora: make_weights needs at least one adapter")
    first = next(x for x in adapters if x is not None)
    in_dim, out_dim, dtype, device = first[0].shape[1], first[1].shape[0], first[0].dtype, first[0].device
    used = sum(x[0].shape[0] for x in adapters if x is not None)
    total_rows = used if total_rows is None else total_rows
    if total_rows < used:
        raise ValueError(f"lora: {used} rank rows do not fit a pool of {total_rows}")
    if perm is not None and sorted(perm.tolist()) != list(range(total_rows)):
        raise ValueError(f"lora: perm is not a permutation of range({total_rows})")
    order = torch.arange(total_rows) if perm is None else perm.cpu().long()
    a_pool = torch.zeros(total_rows, in_dim, dtype=dtype, device=device)
    b_pool = torch.zeros(total_rows, out_dim, dtype=dtype, device=device)
    rows_of = torch.zeros(len(adapters), r_max, dtype=torch.long)
    ranks, scales, nxt = [], [], 0
    for slot, item in enumerate(adapters):
        if item is None:
            ranks.append(0)
            scales.append(0.0)
            continue
        a, b, scale = item
        r = a.shape[0]
        if a.shape != (r, in_dim) or b.shape != (out_dim, r):
            raise ValueError(f"lora: adapter {slot} A {list(a.shape)} B {list(b.shape)}: "
                             f"want [r, {in_dim}], [{out_dim}, r]")
        if r > r_max:
            raise ValueError(f"lora: adapter {slot} has rank {r} > r_max = {r_max}")
        rows = order[nxt : nxt + r]
        nxt += r
        a_pool[rows.to(device)] = a.to(dtype)
        b_pool[rows.to(device)] = b.T.to(dtype)
        rows_of[slot, :r] = rows
        ranks.append(r)
        scales.append(float(scale))
    align = min(16, in_dim & -in_dim, out_dim & -out_dim)
    return LoraWeights(a_pool.view(-1), b_pool.view(-1), (rows_of * in_dim).to(device), (rows_of * out_dim).to(device),
                       torch.tensor(ranks, dtype=torch.int32, device=device),
                       torch.tensor(scales, dtype=torch.float32, device=device), in_dim, out_dim,
                       offset_align=align)  # fmt: skip
