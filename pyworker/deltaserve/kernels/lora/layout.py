"""Host-side weight layout of the multi-LoRA kernels: ``LoraWeights``, ``LoraSlice``, ``LoraStack``.

S-LoRA unified paging: adapter rows live inside KV-cache pages. Every adapter's weights for one
projection are *rank rows* at arbitrary element offsets in flat 1-D pools. Row ``j`` of adapter ``a``
is ``A_a[j, :]`` (``in_dim`` contiguous elements at ``a_offsets[a, j]`` in ``a_pool``) and column ``j``
of ``B_a``, i.e. ``B_a[:, j]`` (``out_dim`` contiguous elements at ``b_offsets[a, j]`` in ``b_pool``).
The two pools may be one tensor (a layer's whole KV pool viewed flat), rows of different adapters
interleave with KV data, and rows need not be ordered::

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Activation / weight dtypes the ops accept."""


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
            raise ValueError(
                f"lora: a_pool {list(a.shape)} and b_pool {list(b.shape)} must be 1-D contiguous flat buffers"
            )
        if a.dtype not in DTYPES or b.dtype != a.dtype:
            raise ValueError(f"lora: pool dtypes {a.dtype} / {b.dtype}: want one of float32, float16, bfloat16")
        if isinstance(self.in_dim, bool) or not isinstance(self.in_dim, int) or self.in_dim < 1:
            raise ValueError(f"lora: in_dim {self.in_dim!r}: want a positive int")
        if isinstance(self.out_dim, bool) or not isinstance(self.out_dim, int) or self.out_dim < 1:
            raise ValueError(f"lora: out_dim {self.out_dim!r}: want a positive int")
        if ao.dim() != 2 or ao.dtype != torch.int64 or ao.shape[1] < 1 or ao.stride(1) != 1:
            raise ValueError(
                f"lora: a_offsets {list(ao.shape)} {ao.dtype}: want [num_adapters, r_max >= 1] "
                "int64 with a contiguous last dim"
            )
        if bo.shape != ao.shape or bo.dtype != torch.int64 or bo.stride(1) != 1:
            raise ValueError(
                f"lora: b_offsets {list(bo.shape)} {bo.dtype}: want {list(ao.shape)} int64 "
                "(like a_offsets) with a contiguous last dim"
            )
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
                raise ValueError(
                    f"lora: {name} starts at an address that is not a multiple of offset_align = {al} elements"
                )
        if self.check:
            self._check_contents()

    def _check_contents(self) -> None:
        """Ranks in 0 .. r_max; every used row ``[off, off + dim)`` inside its pool (one host sync)."""
        ranks = self.rank.tolist()
        for slot, r in enumerate(ranks):
            if not 0 <= r <= self.r_max:
                raise ValueError(f"lora: adapter {slot} has rank {r}, outside 0 .. r_max = {self.r_max}")
        used = torch.arange(self.r_max, device=self.rank.device)[None, :] < self.rank[:, None]
        for name, offs, dim, pool in (
            ("a_offsets", self.a_offsets, self.in_dim, self.a_pool),
            ("b_offsets", self.b_offsets, self.out_dim, self.b_pool),
        ):
            o = offs[used].tolist()
            where = used.nonzero().tolist()
            for (slot, j), x in zip(where, o):
                if x < 0 or x + dim > pool.numel():
                    raise ValueError(
                        f"lora: {name}[{slot}, {j}] = {x}: row [{x}, {x + dim}) is outside the pool "
                        f"of {pool.numel()} elements"
                    )
                if x % self.offset_align:
                    raise ValueError(
                        f"lora: {name}[{slot}, {j}] = {x} is not a multiple of offset_align = {self.offset_align}"
                    )

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
        for i, o in enumerate(offs):
            if isinstance(o, bool) or not isinstance(o, int) or o < 0:
                raise ValueError(f"lora: stacked slice {i}: out_offset {o!r}: want an int >= 0")
            if i and o < offs[i - 1] + dims[i - 1]:
                raise ValueError(
                    f"lora: stacked slice {i} starts at column {o}, inside slice {i - 1} "
                    f"(columns {offs[i - 1]} .. {offs[i - 1] + dims[i - 1]}): want increasing, "
                    "non-overlapping slices"
                )
        ws = []
        for i in range(n):
            try:  # every per-slice check (pools, dtypes, dims, strides, devices, contents, alignment)
                ws.append(
                    LoraWeights(
                        self.a_pool,
                        self.b_pool,
                        ao[i],
                        bo[i],
                        rank[i],
                        scale[i],
                        self.in_dim,
                        dims[i],
                        check=self.check,
                        offset_align=self.offset_align,
                    )
                )
            except ValueError as e:
                raise ValueError(f"lora: stacked slice {i}: {e}") from None
        object.__setattr__(self, "out_dims", dims)
        object.__setattr__(self, "out_offsets", offs)
        object.__setattr__(self, "slice_weights", tuple(ws))
        dev = self.a_pool.device
        object.__setattr__(self, "out_dims_dev", torch.tensor(dims, dtype=torch.int32, device=dev))
        object.__setattr__(self, "out_offsets_dev", torch.tensor(offs, dtype=torch.int64, device=dev))

    @classmethod
    def from_slices(cls, slices: Sequence[LoraSlice]) -> LoraStack:
        """The stack of a module's slices (those with weights) whose ``LoraWeights`` share their pools
        and whose tables are views of one tensor each, a uniform stride apart (the adapter pool's
        per-projection weights). No copy: refilling the per-slice tables refills the stack. Raises
        ValueError naming what differs when the slices cannot be stacked that way."""
        used = [(i, s, s.weights) for i, s in enumerate(slices) if s.weights is not None]
        if not used:
            raise ValueError("lora: LoraStack.from_slices needs at least one slice with weights")
        ws = [w for _, _, w in used]
        w0 = ws[0]
        for i, s, w in used:
            if (
                w.a_pool.data_ptr() != w0.a_pool.data_ptr()
                or w.a_pool.shape != w0.a_pool.shape
                or w.b_pool.data_ptr() != w0.b_pool.data_ptr()
                or w.b_pool.shape != w0.b_pool.shape
            ):
                raise ValueError(f"lora: slice {i} does not share the first slice's a_pool / b_pool")
            if w.in_dim != w0.in_dim:
                raise ValueError(f"lora: slice {i} has in_dim {w.in_dim}, the first slice {w0.in_dim}")
            if w.out_dim != s.size:
                raise ValueError(f"lora: slice {i} has {s.size} columns, its weights out_dim {w.out_dim}")
        stacked = {
            name: _stack_views(name, [getattr(w, name) for w in ws])
            for name in ("a_offsets", "b_offsets", "rank", "scale")
        }
        return cls(
            w0.a_pool,
            w0.b_pool,
            in_dim=w0.in_dim,
            out_dims=tuple(s.size for _, s, _ in used),
            out_offsets=tuple(s.offset for _, s, _ in used),
            check=all(w.check for w in ws),
            offset_align=min(w.offset_align for w in ws),
            **stacked,
        )

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
        if (
            v.shape != v0.shape
            or v.stride() != v0.stride()
            or v.dtype != v0.dtype
            or v.device != v0.device
            or v.untyped_storage().data_ptr() != v0.untyped_storage().data_ptr()
        ):
            raise ValueError(
                f"lora: slice {i}'s {name} is not a view of the first slice's {name} tensor "
                "with the same shape and strides: build a LoraStack from stacked tables"
            )
        if v.storage_offset() != v0.storage_offset() + i * step:
            raise ValueError(f"lora: the slices' {name} are not a uniform stride apart in their tensor")
    if step <= 0:
        raise ValueError(f"lora: the slices' {name} must lie at increasing addresses in their tensor")
    return v0.as_strided((len(views), *v0.shape), (step, *v0.stride()), v0.storage_offset())


def make_weights(
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None],
    r_max: int,
    total_rows: int | None = None,
    *,
    perm: torch.Tensor | None = None,
) -> LoraWeights:
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
            raise ValueError(
                f"lora: adapter {slot} A {list(a.shape)} B {list(b.shape)}: want [r, {in_dim}], [{out_dim}, r]"
            )
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
