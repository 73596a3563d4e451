"""Multi-LoRA delta kernels (Triton): SGMV for prefill segments, MBGMV for decode rows, multi-slice expand.

A batch mixes tokens of many adapters (and of none). The base projection ``y = x W^T`` runs once
over the whole batch; these ops add each token's LoRA delta ``scale_a * (x A_a^T) B_a^T`` in two
launches per slice, *shrink* (hidden -> rank) then *expand* (rank -> hidden), as in Punica.

Weight layout (what the S-LoRA unified paging allocates): every adapter's weights for one
projection are *rank rows*. Row ``j`` of adapter ``a`` is ``A_a[j, :]`` (``in_dim`` wide) in
``a_pool`` and column ``j`` of ``B_a``, i.e. ``B_a[:, j]`` (``out_dim`` wide) in ``b_pool``, both
at the same pool row ``row_index[a, j]``. Rows need not be contiguous nor ordered; an allocator
hands out free pool rows one by one (a page of ``page_rows`` rows is a run of row ids)::

    a_pool [total_rows, in_dim]           b_pool [total_rows, out_dim]
    row 0  | A_1[2, :]           |        row 0  | B_1[:, 2]             |
    row 1  | A_0[0, :]           |        row 1  | B_0[:, 0]             |
    row 2  | (free)              |        row 2  | (free)                |
    row 3  | A_1[0, :]           |        row 3  | B_1[:, 0]             |
    ...                                   ...
    row_index [num_adapters, r_max] int32  row_index[a, j] = pool row of rank row j of adapter a
              adapter 0: [1, 7, ...]       (entries j >= rank[a] are never read)
              adapter 1: [3, 9, 0, ...]
    rank      [num_adapters] int32         rank[a] <= r_max; 0 = slot unused
    scale     [num_adapters] float32       lora_alpha / r (or alpha / sqrt(r) for rsLoRA)

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
    v[t, :r] = dtype(sum_k x[t, k] * a_pool[row_index[a, :r], k])          # fp32 accumulation
    # lora_expand (in place, one slice at columns off .. off + size):
    out[t, off:off + size] = dtype(out[t, off:off + size]
                                   + scale[a] * sum_j v[t, j] * b_pool[row_index[a, j], :])   # j < r
    # lora_delta: for each slice with weights: v = lora_shrink(x, w); lora_expand(v, w, out[:, off:off+size])
    # tokens with adapter -1 keep out unchanged; a slice with weights None is untouched

Shape:
    x:         [T, in_dim]          float32 / float16 / bfloat16, last dim contiguous
    v:         [T, r_max]           dtype of x (shrink output; rows of adapter -1 and columns >= rank are 0)
    out:       [T, out_width]       dtype of x, last dim contiguous, updated in place
    a_pool:    [total_rows, in_dim] dtype of x
    b_pool:    [total_rows, out_dim] dtype of x (out_dim = the slice's size)
    row_index: [num_adapters, r_max] int32;  rank: [num_adapters] int32;  scale: [num_adapters] float32
    seg_start: [S + 1] int32;  seg_adapter: [S] int32 (MBGMV: S = T)

Compute is never padded to the largest rank in the batch: every program loops to (SGMV: tiles of
16 up to) its own adapter's rank, and programs whose rank tile lies past the rank exit at once,
so decode cost follows the sum of the rows' ranks (S-LoRA's MBGMV), not batch x max rank (BGMV).
The SGMV kernels use ``tl.dot`` on [16+, 16+] tiles (Tensor Cores on the GPU); the MBGMV kernels
are bandwidth kernels (one token per program row, no ``tl.dot``).

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
_MB_BLOCK_R = 8
"""MBGMV shrink: rank rows per program (small, so rank-4 rows waste little and T=1 still spreads)."""
_MB_BLOCK_K = 256
"""MBGMV shrink: input columns per step."""
_MB_BLOCK_RE = 16
"""MBGMV expand: rank rows per step of the rank loop."""
_MB_BLOCK_N = 256
"""MBGMV expand: output columns per program."""


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
    """One projection's adapters in the rank-row pool layout (module docstring); validated once."""

    a_pool: torch.Tensor
    """[total_rows, in_dim]: row row_index[a, j] is A_a[j, :]."""
    b_pool: torch.Tensor
    """[total_rows, out_dim]: row row_index[a, j] is B_a[:, j] (B_a is [out_dim, r])."""
    row_index: torch.Tensor
    """[num_adapters, r_max] int32: pool row of each rank row; entries past rank[a] are ignored."""
    rank: torch.Tensor
    """[num_adapters] int32: each slot's rank (0 = empty slot)."""
    scale: torch.Tensor
    """[num_adapters] float32: each slot's LoRA scaling (alpha / r)."""

    def __post_init__(self) -> None:
        a, b, ri, rank, scale = self.a_pool, self.b_pool, self.row_index, self.rank, self.scale
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
            raise ValueError(f"lora: a_pool {list(a.shape)} and b_pool {list(b.shape)} must be [rows, dim] "
                             "with the same number of rows")
        if a.dtype not in DTYPES or b.dtype != a.dtype:
            raise ValueError(f"lora: pool dtypes {a.dtype} / {b.dtype}: want one of float32, float16, bfloat16")
        if a.stride(-1) != 1 or b.stride(-1) != 1:
            raise ValueError("lora: a_pool and b_pool need a contiguous last dim")
        if ri.dim() != 2 or ri.dtype != torch.int32 or ri.shape[1] < 1:
            raise ValueError(f"lora: row_index {list(ri.shape)} {ri.dtype}: want [num_adapters, r_max >= 1] int32")
        if rank.shape != (ri.shape[0],) or rank.dtype != torch.int32:
            raise ValueError(f"lora: rank {list(rank.shape)} {rank.dtype}: want [{ri.shape[0]}] int32")
        if scale.shape != (ri.shape[0],) or scale.dtype != torch.float32:
            raise ValueError(f"lora: scale {list(scale.shape)} {scale.dtype}: want [{ri.shape[0]}] float32")
        if len({t.device for t in (a, b, ri, rank, scale)}) != 1:
            raise ValueError("lora: pools, row_index, rank and scale must be on one device")
        ri = ri.contiguous()
        object.__setattr__(self, "row_index", ri)
        # Data checks (one host sync, at load time, never per call).
        ranks = rank.tolist()
        for slot, r in enumerate(ranks):
            if not 0 <= r <= ri.shape[1]:
                raise ValueError(f"lora: adapter {slot} has rank {r}, outside 0 .. r_max = {ri.shape[1]}")
        used = torch.arange(ri.shape[1], device=ri.device)[None, :] < rank[:, None]
        rows = ri[used]
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= a.shape[0]):
            raise ValueError(f"lora: row_index points outside the pool of {a.shape[0]} rows")

    @property
    def num_adapters(self) -> int:
        return self.row_index.shape[0]

    @property
    def r_max(self) -> int:
        return self.row_index.shape[1]

    @property
    def in_dim(self) -> int:
        return self.a_pool.shape[1]

    @property
    def out_dim(self) -> int:
        return self.b_pool.shape[1]


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


def lora_shrink_ref(x: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> torch.Tensor:
    """Torch reference and CPU path of ``lora_shrink`` (module docstring): gather + matmul per adapter."""
    _check_call("lora_shrink", x, w, meta, w.in_dim, "in_dim")
    v = torch.zeros(x.shape[0], w.r_max, dtype=x.dtype, device=x.device)
    ranks, rows = w.rank.tolist(), w.row_index
    for a, tok in _token_groups(meta).items():
        r = ranks[a]
        if r:
            v[tok, :r] = (x[tok].float() @ w.a_pool[rows[a, :r].long()].float().T).to(x.dtype)
    return v


def lora_expand_ref(v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> torch.Tensor:
    """Torch reference and CPU path of ``lora_expand``: ``out += scale * v B^T`` per adapter, in place."""
    _check_call("lora_expand", v, w, meta, w.r_max, "r_max")
    _check_out("lora_expand", out, w, meta)
    ranks, scales, rows = w.rank.tolist(), w.scale.tolist(), w.row_index
    for a, tok in _token_groups(meta).items():
        r = ranks[a]
        if r:
            delta = v[tok, :r].float() @ w.b_pool[rows[a, :r].long()].float()
            out[tok] = (out[tok].float() + scales[a] * delta).to(out.dtype)
    return out


# ----------------------------------------------------------------------------- Triton kernels


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, v_ptr, seg_start_ptr, seg_adapter_ptr, row_index_ptr, rank_ptr,
                        K, x_stride, a_stride, v_stride, ri_stride,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RNE: tl.constexpr):
    seg = tl.program_id(0)
    adapter = tl.load(seg_adapter_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    rank = tl.load(rank_ptr + tl.maximum(adapter, 0))
    m0 = start + tl.program_id(1) * BLOCK_M
    r0 = tl.program_id(2) * BLOCK_R
    if (adapter < 0 or m0 >= end) or r0 >= rank:  # pairs: triton 3.6 refuses chained and/or
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rs = r0 + tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    prow = tl.load(row_index_ptr + adapter.to(tl.int64) * ri_stride + rs, mask=r_ok, other=0).to(tl.int64)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    a_rows = a_ptr + prow[:, None] * a_stride
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
def _sgmv_expand_kernel(v_ptr, b_ptr, out_ptr, seg_start_ptr, seg_adapter_ptr, row_index_ptr, rank_ptr, scale_ptr,
                        N, v_stride, b_stride, out_stride, ri_stride,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RNE: tl.constexpr):
    seg = tl.program_id(0)
    adapter = tl.load(seg_adapter_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if adapter < 0 or m0 >= end:
        return
    rank = tl.load(rank_ptr + adapter)
    scale = tl.load(scale_ptr + adapter)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    v_rows = v_ptr + rows.to(tl.int64)[:, None] * v_stride
    ri_row = row_index_ptr + adapter.to(tl.int64) * ri_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # the segment's own rank, in tiles of BLOCK_R
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        prow = tl.load(ri_row + rs, mask=r_ok, other=0).to(tl.int64)
        vt = tl.load(v_rows + rs[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + prow[:, None] * b_stride + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
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
def _mbgmv_shrink_kernel(x_ptr, a_ptr, v_ptr, row_adapter_ptr, row_index_ptr, rank_ptr,
                         K, x_stride, a_stride, v_stride, ri_stride,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    adapter = tl.load(row_adapter_ptr + t)
    rank = tl.load(rank_ptr + tl.maximum(adapter, 0))
    r0 = tl.program_id(1) * BLOCK_R
    if adapter < 0 or r0 >= rank:  # rank tiles past this row's rank: no work (no padding to r_max)
        return
    rs = r0 + tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    prow = tl.load(row_index_ptr + adapter.to(tl.int64) * ri_stride + rs, mask=r_ok, other=0).to(tl.int64)
    a_rows = a_ptr + prow[:, None] * a_stride
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xk = tl.load(x_ptr + t * x_stride + ks, mask=k_ok, other=0.0).to(tl.float32)
        at = tl.load(a_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += at * xk[None, :]
    ty = v_ptr.dtype.element_ty
    tl.store(v_ptr + t * v_stride + rs, round_to(tl.sum(acc, axis=1), ty, RNE).to(ty), mask=r_ok)


@triton.jit
def _mbgmv_expand_kernel(v_ptr, b_ptr, out_ptr, row_adapter_ptr, row_index_ptr, rank_ptr, scale_ptr,
                         N, v_stride, b_stride, out_stride, ri_stride,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    adapter = tl.load(row_adapter_ptr + t)
    if adapter < 0:
        return
    rank = tl.load(rank_ptr + adapter)
    scale = tl.load(scale_ptr + adapter)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    ri_row = row_index_ptr + adapter.to(tl.int64) * ri_stride
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # this row's own rank
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        prow = tl.load(ri_row + rs, mask=r_ok, other=0).to(tl.int64)
        vr = tl.load(v_ptr + t * v_stride + rs, mask=r_ok, other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + prow[:, None] * b_stride + ns[None, :], mask=r_ok[:, None] & n_ok[None, :],
                     other=0.0).to(tl.float32)
        acc += vr[:, None] * bt
    ty = out_ptr.dtype.element_ty
    o_ptrs = out_ptr + t * out_stride + ns
    o = tl.load(o_ptrs, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + scale * tl.sum(acc, axis=0), ty, RNE).to(ty), mask=n_ok)


def _dot_flags(t: torch.Tensor) -> tuple[bool, str]:
    """(UPCAST, DOT_PREC): fp32 tiles under the interpreter; fp32 dots in IEEE precision, not TF32."""
    upcast = not t.is_cuda
    return upcast, "ieee" if upcast or t.dtype == torch.float32 else "tf32"


def lora_shrink_triton(x: torch.Tensor, w: LoraWeights, meta: LoraMeta) -> torch.Tensor:
    """Triton kernel for ``lora_shrink`` (no dispatch): MBGMV if ``meta.decode`` else SGMV."""
    _check_call("lora_shrink", x, w, meta, w.in_dim, "in_dim")
    if x.stride(-1) != 1:
        x = x.contiguous()
    v = torch.zeros(x.shape[0], w.r_max, dtype=x.dtype, device=x.device)
    if meta.max_adapter < 0 or x.shape[0] == 0:
        return v
    rne = needs_rne_by_hand(v)
    if meta.decode:
        grid = (x.shape[0], triton.cdiv(w.r_max, _MB_BLOCK_R))
        _mbgmv_shrink_kernel[grid](x, w.a_pool, v, meta.seg_adapter, w.row_index, w.rank,
                                   w.in_dim, x.stride(0), w.a_pool.stride(0), v.stride(0), w.row_index.stride(0),
                                   BLOCK_R=_MB_BLOCK_R, BLOCK_K=_MB_BLOCK_K, RNE=rne, num_warps=4)
    else:
        upcast, prec = _dot_flags(x)
        segs, m_tiles = len(meta.seg_adapter_host), triton.cdiv(meta.max_seg_len, _SG_BLOCK_M)
        grid = (segs, m_tiles, triton.cdiv(w.r_max, _SG_BLOCK_R))
        _sgmv_shrink_kernel[grid](x, w.a_pool, v, meta.seg_start, meta.seg_adapter, w.row_index, w.rank,
                                  w.in_dim, x.stride(0), w.a_pool.stride(0), v.stride(0), w.row_index.stride(0),
                                  BLOCK_M=_SG_BLOCK_M, BLOCK_R=_SG_BLOCK_R, BLOCK_K=_SG_BLOCK_K,
                                  UPCAST=upcast, DOT_PREC=prec, RNE=rne, num_warps=4)
    return v


def lora_expand_triton(v: torch.Tensor, w: LoraWeights, meta: LoraMeta, out: torch.Tensor) -> torch.Tensor:
    """Triton kernel for ``lora_expand`` (no dispatch), in place on ``out``: MBGMV if ``meta.decode`` else SGMV."""
    _check_call("lora_expand", v, w, meta, w.r_max, "r_max")
    _check_out("lora_expand", out, w, meta)
    if v.stride(-1) != 1:
        v = v.contiguous()
    if meta.max_adapter < 0 or out.shape[0] == 0:
        return out
    rne = needs_rne_by_hand(out)
    n = w.out_dim
    if meta.decode:
        grid = (out.shape[0], triton.cdiv(n, _MB_BLOCK_N))
        _mbgmv_expand_kernel[grid](v, w.b_pool, out, meta.seg_adapter, w.row_index, w.rank, w.scale,
                                   n, v.stride(0), w.b_pool.stride(0), out.stride(0), w.row_index.stride(0),
                                   BLOCK_R=_MB_BLOCK_RE, BLOCK_N=_MB_BLOCK_N, RNE=rne, num_warps=4)
    else:
        upcast, prec = _dot_flags(v)
        grid = (len(meta.seg_adapter_host), triton.cdiv(meta.max_seg_len, _SG_BLOCK_M), triton.cdiv(n, _SG_BLOCK_N))
        _sgmv_expand_kernel[grid](v, w.b_pool, out, meta.seg_start, meta.seg_adapter, w.row_index, w.rank, w.scale,
                                  n, v.stride(0), w.b_pool.stride(0), out.stride(0), w.row_index.stride(0),
                                  BLOCK_M=_SG_BLOCK_M, BLOCK_R=_SG_BLOCK_R, BLOCK_N=_SG_BLOCK_N,
                                  UPCAST=upcast, DOT_PREC=prec, RNE=rne, num_warps=4)
    return out


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
    for s in slices:
        if s.weights is None:
            continue
        v = lora_shrink(x, s.weights, meta, use_triton=use_triton)
        lora_expand(v, s.weights, meta, out[:, s.offset : s.offset + s.size], use_triton=use_triton)
    return out


def make_weights(adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None], r_max: int,
                 total_rows: int | None = None, *, perm: torch.Tensor | None = None) -> LoraWeights:
    """Packs per-adapter ``(A [r, in], B [out, r], scale)`` (None: empty slot) into the pool layout.

    Rank rows go to consecutive pool rows, or to ``perm[i]`` for the i-th rank row overall when
    ``perm`` (a permutation of ``range(total_rows)``) is given, which scatters them as a paged
    allocator would. For tests, benchmarks and loaders that have the adapters at hand.
    """
    if all(x is None for x in adapters):
        raise ValueError("lora: make_weights needs at least one adapter")
    first = next(x for x in adapters if x is not None)
    in_dim, out_dim, dtype, device = first[0].shape[1], first[1].shape[0], first[0].dtype, first[0].device
    used = sum(x[0].shape[0] for x in adapters if x is not None)
    total_rows = used if total_rows is None else total_rows
    if total_rows < used:
        raise ValueError(f"lora: {used} rank rows do not fit a pool of {total_rows}")
    order = torch.arange(total_rows) if perm is None else perm.cpu()
    a_pool = torch.zeros(total_rows, in_dim, dtype=dtype, device=device)
    b_pool = torch.zeros(total_rows, out_dim, dtype=dtype, device=device)
    row_index = torch.zeros(len(adapters), r_max, dtype=torch.int32)
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
        row_index[slot, :r] = rows.to(torch.int32)
        ranks.append(r)
        scales.append(float(scale))
    return LoraWeights(a_pool, b_pool, row_index.to(device), torch.tensor(ranks, dtype=torch.int32, device=device),
                       torch.tensor(scales, dtype=torch.float32, device=device))
