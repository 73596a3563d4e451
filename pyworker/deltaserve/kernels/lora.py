"""Multi-LoRA delta kernels (Triton): SGMV for prefill segments, MBGMV for decode rows, multi-slice expand.

A batch mixes tokens of many adapters (and of none). The base projection ``y = x W^T`` runs once
over the whole batch; these ops add each token's LoRA delta ``scale_a * (x A_a^T) B_a^T`` in two
launches per slice, *shrink* (hidden -> rank) then *expand* (rank -> hidden), as in Punica.

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
``LoraWeights`` per slice, or ``None`` for a slice without LoRA (``LoraSlice``).

Batch metadata (``LoraMeta``, built once per step and reused by every layer and projection):

    SGMV (prefill): tokens grouped into contiguous segments, one adapter per segment
        seg_start [S + 1] int32   token range of segment s is seg_start[s] .. seg_start[s + 1]
        seg_adapter [S] int32     adapter of segment s, or -1
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
(program (t, s) writes float32 partial sums of columns s*BLOCK_K.. for all of row t's rank rows; no
atomics, so results are deterministic) and the expand, tiled over output columns, sums a row's
partials in a fixed order, rounds v to the activation dtype and applies it (``lora_delta``: two
launches, no zero fill). ``lora_shrink`` at decode finishes v with a third small kernel summing the
same partials, so the fused path and shrink-then-expand agree up to the order of that float32 sum.

Entry points ``lora_delta`` / ``lora_shrink`` / ``lora_expand`` run the Triton kernels on CUDA
tensors (or when ``use_triton=True``: CPU tensors then need ``TRITON_INTERPRET=1``) and the torch
references ``*_ref`` (a loop per adapter over gathered rows; the CPU path) otherwise. Metadata is
validated on the host when it is built (no device sync per call); weights when they are built.
"""

from __future__ import annotations

from dataclasses import dataclass
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
_SG_BLOCK_R = 16
"""SGMV: rank rows per tile (the tile granularity of the rank loop)."""
_SG_BLOCK_K = 64
"""SGMV shrink: input columns per step of the reduction."""
_SG_BLOCK_N = 64
"""SGMV expand: output columns per program."""
_MB_BLOCK_R = 16
"""MBGMV shrink / finish: rank rows per step of the loop to the row's own rank (the
granularity of the rank loop: a rank-8 row wastes half a tile, a rank-16k row none). The columns per
program are chosen per shape (``_mb_shrink_block_k``, ``_mb_expand_block_n``)."""
_MB_EXPAND_BLOCK_R = 32
"""MBGMV expand: rank rows per step of the rank loop (H100: 32 beat 16 at rank 64+, cost little at 16)."""
_MB_NUM_WARPS = 4
"""MBGMV shrink / expand: warps per program."""


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
    max_seg_len: int
    """Longest segment: the SGMV grid's token-tile count."""
    max_adapter: int
    """Largest adapter slot used (-1 if none): checked against each weight set's num_adapters."""
    decode: bool
    """True: one token per row (MBGMV kernels); False: segments (SGMV kernels)."""

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
        return cls._build(starts, adapters, max(lens, default=0), False, device)

    @classmethod
    def mbgmv(cls, row_adapter: Sequence[int], device: torch.device | str) -> "LoraMeta":
        """Decode metadata: token t uses adapter ``row_adapter[t]`` (-1: none), in any order."""
        adapters = [int(a) for a in row_adapter]
        return cls._build(list(range(len(adapters) + 1)), adapters, 1 if adapters else 0, True, device)

    @classmethod
    def _build(cls, starts: list[int], adapters: list[int], max_len: int, decode: bool,
               device: torch.device | str) -> "LoraMeta":
        bad = [a for a in adapters if a < -1]
        if bad:
            raise ValueError(f"lora: adapter id {bad[0]} out of range (slots are >= 0, -1 = no adapter)")
        if starts[-1] >= 2**31:
            raise ValueError(f"lora: {starts[-1]} tokens overflow int32 segment offsets")
        return cls(
            seg_start=torch.tensor(starts, dtype=torch.int32, device=device),
            seg_adapter=torch.tensor(adapters, dtype=torch.int32, device=device),
            seg_start_host=tuple(starts), seg_adapter_host=tuple(adapters), num_tokens=starts[-1],
            max_seg_len=max_len, max_adapter=max(adapters, default=-1), decode=decode,
        )  # fmt: skip


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
def _sgmv_shrink_kernel(x_ptr, a_ptr, v_ptr, seg_start_ptr, seg_adapter_ptr, a_off_ptr, rank_ptr,
                        K, R_MAX, x_stride, v_stride, off_stride,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RNE: tl.constexpr):
    seg = tl.program_id(0)
    adapter = tl.load(seg_adapter_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    rank = tl.minimum(tl.load(rank_ptr + tl.maximum(adapter, 0)), R_MAX)
    m0 = start + tl.program_id(1) * BLOCK_M
    r0 = tl.program_id(2) * BLOCK_R
    if (adapter < 0 or m0 >= end) or r0 >= rank:  # pairs: triton 3.6 refuses chained and/or
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rs = r0 + tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    off = _row_offsets(a_off_ptr + adapter.to(tl.int64) * off_stride, rs, r_ok, ALIGN)
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
    v_ptrs = v_ptr + rows.to(tl.int64)[:, None] * v_stride + rs[None, :]
    tl.store(v_ptrs, round_to(acc, ty, RNE).to(ty), mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _sgmv_expand_kernel(v_ptr, b_ptr, out_ptr, seg_start_ptr, seg_adapter_ptr, b_off_ptr, rank_ptr, scale_ptr,
                        N, R_MAX, v_stride, out_stride, off_stride,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RNE: tl.constexpr):
    seg = tl.program_id(0)
    adapter = tl.load(seg_adapter_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if adapter < 0 or m0 >= end:
        return
    rank = tl.minimum(tl.load(rank_ptr + adapter), R_MAX)
    scale = tl.load(scale_ptr + adapter)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    v_rows = v_ptr + rows.to(tl.int64)[:, None] * v_stride
    off_row = b_off_ptr + adapter.to(tl.int64) * off_stride
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
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + ns[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + scale * acc, ty, RNE).to(ty), mask=mask)


@triton.jit
def _mbgmv_shrink_kernel(x_ptr, a_ptr, part_ptr, row_adapter_ptr, a_off_ptr, rank_ptr,
                         K, R_MAX, x_stride, part_split_stride, part_stride, off_stride,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr):
    """Program (t, s): row t's partial dot products over input columns s*BLOCK_K .. +BLOCK_K, for
    every rank row up to the row's own rank, into ``part[s, t, :rank]`` (float32, no atomics)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    adapter = tl.load(row_adapter_ptr + t)
    if adapter < 0:
        return
    rank = tl.minimum(tl.load(rank_ptr + adapter), R_MAX)
    ks = s * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    xk = tl.load(x_ptr + t * x_stride + ks, mask=k_ok, other=0.0).to(tl.float32)
    off_row = a_off_ptr + adapter.to(tl.int64) * off_stride
    p_row = part_ptr + s.to(tl.int64) * part_split_stride + t * part_stride
    for r0 in range(0, rank, BLOCK_R):  # this row's own rank, not r_max
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        off = _row_offsets(off_row, rs, r_ok, ALIGN)
        at = tl.load(a_ptr + off[:, None] + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        tl.store(p_row + rs, tl.sum(at.to(tl.float32) * xk[None, :], axis=1), mask=r_ok)


@triton.jit
def _mbgmv_expand_kernel(v_ptr, b_ptr, out_ptr, row_adapter_ptr, b_off_ptr, rank_ptr, scale_ptr,
                         N, R_MAX, SPLIT, v_split_stride, v_stride, out_stride, off_stride,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ALIGN: tl.constexpr,
                         RNE: tl.constexpr, REDUCE_EACH: tl.constexpr):
    """Program (t, n): ``out[t, n tile] += scale * round(sum_s v[s, t, :rank]) B^T[:rank, n tile]``.

    ``v`` is either the shrink's float32 partials (SPLIT of them, summed in a fixed order: the result
    is deterministic) or a finished v in the out dtype (SPLIT = 1; the rounding is then exact). The
    partials of a rank tile come in one [BLOCK_S >= SPLIT, BLOCK_R] load, not SPLIT dependent ones.
    REDUCE_EACH sums each rank tile into a [BLOCK_N] accumulator (wide tiles, whose [BLOCK_R, BLOCK_N]
    accumulator would spill registers); otherwise the 2-D accumulator is summed once at the end."""
    t = tl.program_id(0).to(tl.int64)
    adapter = tl.load(row_adapter_ptr + t)
    if adapter < 0:
        return
    rank = tl.minimum(tl.load(rank_ptr + adapter), R_MAX)
    scale = tl.load(scale_ptr + adapter)
    ty = out_ptr.dtype.element_ty
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    off_row = b_off_ptr + adapter.to(tl.int64) * off_stride
    ss = tl.arange(0, BLOCK_S)
    v_tile = v_ptr + t * v_stride + ss.to(tl.int64)[:, None] * v_split_stride
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    acc_n = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # this row's own rank
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        parts = tl.load(v_tile + rs[None, :], mask=(ss < SPLIT)[:, None] & r_ok[None, :], other=0.0)
        vr = round_to(tl.sum(parts.to(tl.float32), axis=0), ty, RNE)  # v in the activation dtype, as lora_shrink
        off = _row_offsets(off_row, rs, r_ok, ALIGN)
        bt = tl.load(b_ptr + off[:, None] + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if REDUCE_EACH:
            acc_n += tl.sum(vr[:, None] * bt.to(tl.float32), axis=0)
        else:
            acc += vr[:, None] * bt.to(tl.float32)
    if not REDUCE_EACH:
        acc_n = tl.sum(acc, axis=0)
    o_ptrs = out_ptr + t * out_stride + ns
    o = tl.load(o_ptrs, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + scale * acc_n, ty, RNE).to(ty), mask=n_ok)


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


def _mb_shrink_block_k(tokens: int) -> int:
    """MBGMV shrink: input columns per program. Smaller for few rows, so a decode step of one or two
    requests still spreads its adapter rows over many programs; wide (vector loads, long rows per
    program) once the rows alone fill the GPU. Depends on the shape only (CUDA-graph safe)."""
    return 128 if tokens <= 4 else 256 if tokens <= 32 else 512


def _mb_expand_block_n(tokens: int) -> int:
    """MBGMV expand: output columns per program, by the same reasoning as ``_mb_shrink_block_k``
    (H100, fp16, 4096 / 11008 columns: 512 at T > 32 halved the rank-16 expand against 256)."""
    return 64 if tokens <= 4 else 128 if tokens <= 32 else 512


def _mbgmv_shrink_partials(x: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> torch.Tensor:
    """Launches the MBGMV shrink; returns its float32 partials [SPLIT, T, r_max] (only the entries of
    rows with an adapter and columns below their rank are written)."""
    t, bk = x.shape[0], _mb_shrink_block_k(x.shape[0])
    split = triton.cdiv(w.in_dim, bk)
    part = torch.empty(split, t, w.r_max, dtype=torch.float32, device=x.device)
    _mbgmv_shrink_kernel[(t, split)](x, w.a_pool, part, meta.seg_adapter, w.a_offsets, w.rank,
                                     w.in_dim, w.r_max, x.stride(0), part.stride(0), part.stride(1),
                                     w.a_offsets.stride(0), BLOCK_R=_MB_BLOCK_R, BLOCK_K=bk,
                                     ALIGN=_align(w, w.a_pool), num_warps=_MB_NUM_WARPS)
    return part


def _mbgmv_expand(v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> None:
    """Launches the MBGMV expand over ``v`` = partials [SPLIT, T, r_max] float32 or a finished [T, r_max]."""
    part = v if v.dim() == 3 else v[None]
    t, bn = out.shape[0], _mb_expand_block_n(out.shape[0])
    _mbgmv_expand_kernel[(t, triton.cdiv(w.out_dim, bn))](
        part, w.b_pool, out, meta.seg_adapter, w.b_offsets, w.rank, w.scale,
        w.out_dim, w.r_max, part.shape[0], part.stride(0), part.stride(1), out.stride(0), w.b_offsets.stride(0),
        BLOCK_R=_MB_EXPAND_BLOCK_R, BLOCK_N=bn, BLOCK_S=triton.next_power_of_2(part.shape[0]),
        ALIGN=_align(w, w.b_pool), RNE=needs_rne_by_hand(out), REDUCE_EACH=bn >= 512, num_warps=_MB_NUM_WARPS)


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
            part = _mbgmv_shrink_partials(x, w, meta)
            _mbgmv_finish_kernel[(t, triton.cdiv(w.r_max, _MB_BLOCK_R))](
                part, v, meta.seg_adapter, w.rank, w.r_max, part.shape[0], part.stride(0), part.stride(1),
                v.stride(0), BLOCK_R=_MB_BLOCK_R, BLOCK_S=triton.next_power_of_2(part.shape[0]),
                RNE=needs_rne_by_hand(v), num_warps=1)
        return v
    v = torch.zeros(t, w.r_max, dtype=x.dtype, device=x.device)
    if meta.max_adapter < 0 or t == 0:
        return v
    upcast, prec = _dot_flags(x)
    grid = (len(meta.seg_adapter_host), triton.cdiv(meta.max_seg_len, _SG_BLOCK_M), triton.cdiv(w.r_max, _SG_BLOCK_R))
    _sgmv_shrink_kernel[grid](x, w.a_pool, v, meta.seg_start, meta.seg_adapter, w.a_offsets, w.rank,
                              w.in_dim, w.r_max, x.stride(0), v.stride(0), w.a_offsets.stride(0),
                              BLOCK_M=_SG_BLOCK_M, BLOCK_R=_SG_BLOCK_R, BLOCK_K=_SG_BLOCK_K, ALIGN=_align(w, w.a_pool),
                              UPCAST=upcast, DOT_PREC=prec, RNE=needs_rne_by_hand(v), num_warps=4)
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
    upcast, prec = _dot_flags(v)
    n = w.out_dim
    grid = (len(meta.seg_adapter_host), triton.cdiv(meta.max_seg_len, _SG_BLOCK_M), triton.cdiv(n, _SG_BLOCK_N))
    _sgmv_expand_kernel[grid](v, w.b_pool, out, meta.seg_start, meta.seg_adapter, w.b_offsets, w.rank, w.scale,
                              n, w.r_max, v.stride(0), out.stride(0), w.b_offsets.stride(0),
                              BLOCK_M=_SG_BLOCK_M, BLOCK_R=_SG_BLOCK_R, BLOCK_N=_SG_BLOCK_N, ALIGN=_align(w, w.b_pool),
                              UPCAST=upcast, DOT_PREC=prec, RNE=needs_rne_by_hand(out), num_warps=4)
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
