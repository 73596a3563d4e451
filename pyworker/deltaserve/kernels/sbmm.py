"""SBMM (Triton): the compressed full-fine-tune deltas of one linear for every token of a step, in one launch.

DeltaZip's decoupled forward (§5.1-5.2): an adapted linear computes ``y = x W_base^T`` once for the
whole batch, then adds each token's delta ``x Δ̃_d^T``, where ``Δ̃_d`` is the packed 2/4-bit,
optionally 2:4-sparse delta of the token's variant ``d`` (``deltaserve.compress.pack``: THE format
and THE reference value ``dequantize``). ``W_base + Δ̃`` is never materialised: the kernel streams
the packed words, dequantises and expands 2:4 in registers, and multiplies on tensor cores.

Delta pool (``DeltaWeights``), one per linear and per (bits, sparse, group size) config: every
GPU-resident delta of that linear lives in one of ``num_slots`` slots; each tensor kind of the
packed format has one flat buffer, and a slot's tensor is a row-major block at an element offset::

    qvalues  [*] int32     slot s: qvalues_offsets[s] .. + out * kept*bits/32     (rows of packed codes)
    qindices [*] int32     slot s: qindices_offsets[s] .. + out * kept/16         (2:4 only; else empty)
    scales   [*] float16   slot s: group_offsets[s] .. + out * in/G               (rows of groups)
    zeros    [*] float16   slot s: group_offsets[s] .. + out * in/G               (same offsets as scales)
    qvalues_offsets, qindices_offsets, group_offsets   [num_slots] int64

    e.g. 3 slots, slot 1 empty (make_delta_weights reserves a region for every slot):
    qvalues | slot 0 codes | slot 1 (zeros) | slot 2 codes |     offsets 0, R, 2R (R = out*kept*bits/32)

bits, sparse, group size and the linear's [out, in] are fixed per pool (the kernel specialises on
them); a model whose deltas mix configs holds one pool per config. Slot ids are shared by all linears
of a model; ``-1`` means "no delta" (base-only tokens, LoRA tokens).

Batch metadata (``DeltaMeta``, built once per step on the host and reused by every layer and linear),
the shape of ``LoraMeta.sgmv``::

    seg_start [S + 1] int32   token range of segment s is seg_start[s] .. seg_start[s + 1]
    seg_delta [S] int32       delta slot of segment s, or -1
    decode: one token per row (``DeltaMeta.rows``): seg_start = 0, 1, ..., T

The launch does not follow segments one to one: the host lists the step's tokens grouped by slot
(``order``: every token of slot d, in step order, then the next slot's; base-only tokens left out)
and cuts each slot's run into *work tiles* of at most ``block_m`` tokens, so all tokens of one delta
share tiles and read the delta once per tile, wherever they sit in the batch. One program computes
one tile x ``BLOCK_N`` output columns over the whole reduction, reading x rows and writing out rows
through ``order``.

Semantics::

    for each token t of a segment with slot d >= 0:
        D = dequantize(packed(d), dtype=x.dtype)           # [out, in]; pack.py, rounded to x's dtype
        out[t, :] = dtype(out[t, :] + sum_k x[t, k] * D[:, k])   # fp32 accumulation, one rounding
    tokens with slot -1 keep out unchanged

Shape:
    x:        [T, in]          float32 / float16 / bfloat16, last dim contiguous (copied otherwise)
    out:      [T, out_width]   dtype of x, last dim contiguous, updated in place; out_width = out
    seg_start: [S + 1] int32;  seg_delta: [S] int32 (decode: S = T)
    pool tensors: 1-D as drawn above; offsets [num_slots] int64

Two kernels, by work-tile size (``DeltaMeta.block_m``):

- **FMA tiles** (runs of at most ``_FMA_MAX_M`` = 4 tokens: decode with few rows per delta). Per K
  tile, load ``[BN, W]`` qvalues words (and for 2:4 the position words, 8 groups each). Plane i is
  the i-th code (dense) or i-th group of 4 columns (2:4) of every word. For 2:4, shift out the
  group's two codes v0, v1 and positions p0 < p1; each of its 4 columns takes v0, v1 or 0, and is
  multiplied with the x column of the same index by plain FMAs into ``[BM, BN, W]``, summed over W
  at the end. There are no reshapes, and no 16-row tensor-core tile is padded for one token.
  Scales come one per row when ``G % BLOCK_K == 0``, one per (row, word) when a word's columns
  share a group, else gathered per plane. When one or two deltas would leave SMs idle, K is split
  over programs: float32 partials go to a workspace, and ``_splitk_reduce_kernel`` adds them in a
  fixed order with one rounding.
- **tl.dot tiles** (16 or 64 tokens). Per K tile, load the qvalues words of ``BLOCK_N`` rows and
  shift/mask every code out (``[BN, words, 32/b] -> [BN, kept]``). For 2:4 also load the qindices
  words, pair the two kept codes of each group of 4 and place them at their positions
  (``[BN, BK/4, 4] -> [BN, BK]``, zeros elsewhere). Dequantise with the tile's scales / zeros (one
  per row when ``G % BLOCK_K == 0``, whole groups broadcast when G is a power of two dividing
  BLOCK_K, else gathered per column), round to x's dtype, and ``tl.dot`` with the x tile. Under
  the interpreter the tiles are fp32, because its low-precision dot is wrong; fp32 inputs use IEEE
  precision, not TF32.

A third implementation, ``sbmm_cuda``, is the CUDA C++ op of ``csrc/sbmm.cu`` (tensor cores, packed
words copied ahead with cp.async, coalesced; drawn in its header): work tiles of at most 16 tokens,
float16 / bfloat16, in_features % 256 == 0, group size 32 / 64 / 128 (``cuda_supports`` says why a call
does not fit). On the H200 it takes about half the Triton kernels' time (bench/README.md). It also takes
up to three pools at once (``sbmm_stacked``: q, k, v of a fused qkv module, gate and up), one launch
for the module. When too few blocks would fill the SMs it splits K, and the split that finishes last adds
the partials (in split order: deterministic). It reads its per-slot half2 flags (``DeltaWeights.half2_ok``)
and, inside a CUDA-graph capture, the step's tile count (``DeltaMeta.tile_count``) on the device, so one
captured launch serves any later step as an eager launch of that step would.

**Dense segments** (``DeltaMeta.dense``, prefill only: ``segments(dense_min_m=)``; the worker sets it
on CUDA, ``dense_min_m``). A segment of at least that many tokens of one delta is in no work tile:
``dequantize_slot`` writes the delta once as a dense ``[out, in]`` tensor (``_dequant_kernel``, the
same tile dequantisation ``_dequant_tile`` the tl.dot kernel uses), and one cuBLAS matmul adds
``x[a:b] Δ̃^T`` to ``out[a:b]`` (fp32 accumulation, one rounding). A long prompt then pays one
dequantisation of its delta instead of one per work tile. Both ``sbmm_triton`` and ``sbmm_cuda`` run
the dense segments, then their work tiles.

Entry point ``sbmm`` runs, on CUDA tensors, the CUDA op where it is built and fits the call, else the
Triton kernels (``use_triton=True`` forces Triton; CPU tensors then need ``TRITON_INTERPRET=1``), and
``sbmm_ref`` (a loop over the step's deltas: dequantize with pack.py, then one matmul per delta over its
tokens; the CPU path) otherwise. ``sbmm_stacked`` is ``sbmm`` over a fused module's slices (columns of
one ``out``), in one CUDA launch where the op takes them all. Metadata is validated
when built, weights when built; a call checks shapes and that every slot it uses holds a delta.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..compress.pack import PackedLinear, _check_layout, dequantize
from . import cuda_ext
from .common import needs_rne_by_hand, round_to, use_triton_for, want_triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Activation dtypes the op accepts (the pool's scales / zeros are always float16, per the format)."""

# One launch config per work-tile size (no autotune: the interpreter cannot run multi-config
# autotune; tuned configs go to data files, STYLE #23).
_FMA_MAX_M = 4
"""Work tiles of at most this many tokens (decode: a delta's rows in the step) multiply with plain FMAs:
BLOCK_M is the run's length rounded up to a power of two (1, 2, 4), no tensor-core tile padded to 16. On
the H200 one token per delta took 69 us instead of 255 us (11008x4096, 4-bit 2:4), but 8 tokens per
delta took 742 us instead of the tl.dot kernel's 638 us (8 deltas)."""
_DOT_MIN_M = 16
"""Tokens per work tile when some run of one slot is longer than ``_FMA_MAX_M`` (tl.dot's minimum)."""
_BLOCK_M_LARGE = 64
"""Tokens per work tile when some run of one slot is longer than ``_DOT_MIN_M``: fewer tiles, so the
delta is dequantised fewer times per run."""
_FMA = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 1, "num_stages": 2, "SPLIT_K": 0}
_DOT = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
LAUNCH = {1: dict(_FMA), 2: dict(_FMA), 4: dict(_FMA), _DOT_MIN_M: dict(_DOT), _BLOCK_M_LARGE: dict(_DOT)}
"""Launch config per BLOCK_M (``bench_sbmm.py --tune`` sweeps them). FMA tiles: the fastest of a sweep on
the H200 (BLOCK_N 16..128, BLOCK_K 128/256, 1/2/4 warps, split-K on/off) at 1 token of 1 and of 8 deltas;
tl.dot tiles: the fastest of an H100 sweep at most multi-token points. BLOCK_K is in input columns, a power of
two: >= 32 for tl.dot tiles (a 2:4 index word covers 32 columns); FMA tiles raise it to one qvalues word
and take SPLIT_K (0: ``launch_config`` picks). Module-level so a tuning run can swap it."""
_MIN_WAVES = 2
"""A launch splits K (FMA tiles) or narrows BLOCK_N (tl.dot tiles) until it has this many programs per SM."""


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class DeltaMeta:
    """Which tokens use which delta slot in one step (built once per step: ``segments`` / ``rows``)."""

    seg_start: torch.Tensor
    """[S + 1] int32 on the device: segment s covers tokens seg_start[s] .. seg_start[s + 1]."""
    seg_delta: torch.Tensor
    """[S] int32 on the device: delta slot of each segment, -1 for none."""
    seg_start_host: tuple[int, ...]
    """``seg_start`` on the host: the reference and the checks read it without a device sync."""
    seg_delta_host: tuple[int, ...]
    """``seg_delta`` on the host, for the same reason."""
    num_tokens: int
    """T: rows of x / out the step has."""
    slot_tokens: tuple[tuple[int, tuple[int, ...]], ...]
    """(slot, its token indices in step order) per slot the step uses (no -1), slots in order of first
    use: ``order`` on the host, and the reference's token groups."""
    decode: bool
    """True: one token per row (``rows``); the launch grid then depends on T only (CUDA graphs)."""
    order: torch.Tensor
    """[max(T, 1)] int32 on the device: the step's delta tokens grouped by slot (token indices; entries
    past the delta tokens are 0 and no tile reaches them)."""
    tiles: torch.Tensor
    """[grid_tiles, 3] int32 on the device: (first, end, slot) of each work tile, a range of ``order``;
    rows past the real tiles have slot -1 (decode pads to T tiles, the most T rows can need)."""
    num_tiles: int
    """Real work tiles (rows of ``tiles`` with a slot >= 0)."""
    grid_tiles: int
    """Rows of ``tiles`` = the launch grid's first dimension (decode: T; prefill: ``num_tiles``)."""
    block_m: int
    """Tokens per work tile; the kernel's BLOCK_M."""
    tile_tokens: int
    """The most tokens any work tile holds (<= ``block_m``; 0 without tiles): the CUDA op sizes its
    token fragments by it (8 tokens of each of 8 deltas take one 8-token fragment, not two)."""
    dense: tuple[tuple[int, int, int], ...] = ()
    """(first token, end, slot) of each prefill segment computed with its delta dequantised once and
    one dense matmul (``segments``' ``dense_min_m``); its tokens are in no work tile."""
    tile_count: torch.Tensor | None = None
    """[1] int32 on the device: ``num_tiles`` (the element after ``tiles`` in one allocation). A launch
    captured in a CUDA graph reads it to split K as an eager launch of the step would."""

    @property
    def slots(self) -> frozenset[int]:
        """Delta slots the step uses: checked against the pool's loaded slots at every call."""
        return frozenset(d for d, _ in self.slot_tokens)

    @property
    def num_delta_tokens(self) -> int:
        """Tokens in work tiles (tokens with a delta, less the dense segments'): the used length of ``order``."""
        return sum(len(toks) for _, toks in self.slot_tokens) - sum(e - s for s, e, _ in self.dense)

    @property
    def max_slot(self) -> int:
        """Largest slot used, -1 if none."""
        return max(self.slots, default=-1)

    @classmethod
    def segments(cls, seg_lens: Sequence[int], seg_delta: Sequence[int], device: torch.device | str,
                 max_block_m: int | None = None, dense_min_m: int | None = None) -> "DeltaMeta":
        """Prefill metadata: segment s has ``seg_lens[s]`` consecutive tokens of slot ``seg_delta[s]``;
        ``max_block_m`` as in ``rows``. A segment of a delta with at least ``dense_min_m`` tokens goes
        to ``dense`` (its delta dequantised once, one matmul) instead of work tiles."""
        lens, slots = [int(n) for n in seg_lens], [int(d) for d in seg_delta]
        if len(lens) != len(slots):
            raise ValueError(f"sbmm: {len(lens)} segment lengths but {len(slots)} segment deltas")
        if any(n < 0 for n in lens):
            raise ValueError(f"sbmm: negative segment length in {lens}")
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return cls._build(starts, slots, False, device, max_block_m, dense_min_m)

    @classmethod
    def rows(cls, row_delta: Sequence[int], device: torch.device | str, max_block_m: int | None = None) -> "DeltaMeta":
        """Decode metadata: token t uses slot ``row_delta[t]`` (-1: none), in any order (the rows of one
        slot share work tiles wherever they are). ``max_block_m`` caps the tokens per work tile
        (``cuda_tile_cap``: the CUDA op's 16), cutting a longer run of one slot into several tiles. A cap
        that is not one of the Triton kernels' tile sizes (1, 2, 4, 16, 64; e.g. 8, one CUDA MMA fragment,
        as captured decode steps use) makes metadata only the CUDA op takes."""
        slots = [int(d) for d in row_delta]
        return cls._build(list(range(len(slots) + 1)), slots, True, device, max_block_m)

    @classmethod
    def _build(cls, starts: list[int], slots: list[int], decode: bool, device: torch.device | str,
               max_block_m: int | None = None, dense_min_m: int | None = None) -> "DeltaMeta":
        bad = [d for d in slots if d < -1]
        if bad:
            raise ValueError(f"sbmm: delta slot {bad[0]} out of range (slots are >= 0, -1 = no delta)")
        if dense_min_m is not None and dense_min_m < 1:
            raise ValueError(f"sbmm: dense_min_m {dense_min_m} must be >= 1")
        num_tokens = starts[-1]
        if num_tokens >= 2**31:
            raise ValueError(f"sbmm: {num_tokens} tokens overflow int32 segment offsets")
        # Tokens per slot in step order (slots in order of first use); base-only tokens dropped. Long
        # segments go to ``dense``; the rest to work tiles (``by_slot``).
        all_by_slot: dict[int, list[int]] = {}
        by_slot: dict[int, list[int]] = {}
        dense = []
        for s, d in enumerate(slots):
            lo, hi = starts[s], starts[s + 1]
            if d >= 0 and hi > lo:
                all_by_slot.setdefault(d, []).extend(range(lo, hi))
                if dense_min_m is not None and hi - lo >= dense_min_m:
                    dense.append((lo, hi, d))
                else:
                    by_slot.setdefault(d, []).extend(range(lo, hi))
        slot_tokens = tuple((d, tuple(toks)) for d, toks in all_by_slot.items())
        dense.sort(key=lambda seg: seg[2])  # one slot's segments next to each other: one dequantisation
        order = [t for toks in by_slot.values() for t in toks]
        runs, lo = [], 0
        for d, toks in by_slot.items():
            runs.append((lo, lo + len(toks), d))
            lo += len(toks)
        longest = max((len(toks) for toks in by_slot.values()), default=0)
        if longest <= _FMA_MAX_M:
            block_m = 1 << max(longest - 1, 0).bit_length()  # 1, 2, 4
        else:
            block_m = _DOT_MIN_M if longest <= _DOT_MIN_M else _BLOCK_M_LARGE
            if max_block_m is not None:
                if max_block_m < 1:
                    raise ValueError(f"sbmm: max_block_m {max_block_m} must be >= 1")
                block_m = min(block_m, max_block_m)
        tiles = [(m0, min(m0 + block_m, hi), d) for lo, hi, d in runs for m0 in range(lo, hi, block_m)]
        grid_tiles = num_tokens if decode else len(tiles)  # each tile holds >= 1 token: <= T tiles
        table = tiles + [(0, 0, -1)] * (grid_tiles - len(tiles))
        order += [0] * (max(num_tokens, 1) - len(order))
        flat = torch.tensor([v for row in table for v in row] + [len(tiles)], dtype=torch.int32, device=device)
        return cls(
            seg_start=torch.tensor(starts, dtype=torch.int32, device=device),
            seg_delta=torch.tensor(slots, dtype=torch.int32, device=device),
            seg_start_host=tuple(starts), seg_delta_host=tuple(slots), num_tokens=num_tokens,
            slot_tokens=slot_tokens, decode=decode,
            order=torch.tensor(order, dtype=torch.int32, device=device),
            tiles=flat[: 3 * grid_tiles].view(grid_tiles, 3), tile_count=flat[3 * grid_tiles :],
            num_tiles=len(tiles), grid_tiles=grid_tiles, block_m=block_m,
            tile_tokens=max((e - s for s, e, _ in tiles), default=0), dense=tuple(dense),
        )  # fmt: skip


# ----------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class DeltaWeights:
    """One linear's delta pool: flat buffers per tensor kind plus per-slot offsets (module docstring).

    Validated once at construction (one host sync for the offset tables). ``store`` / ``clear``
    refill a slot in place, so the buffers' addresses (and CUDA graphs that captured them) stay.
    """

    qvalues: torch.Tensor
    """1-D int32: every slot's packed codes, slot s's ``[out, kept*bits/32]`` block at qvalues_offsets[s]."""
    qindices: torch.Tensor
    """1-D int32: every slot's 2:4 position words ``[out, kept/16]`` at qindices_offsets[s]; empty when dense."""
    scales: torch.Tensor
    """1-D float16: every slot's ``[out, in/G]`` scales at group_offsets[s]."""
    zeros: torch.Tensor
    """1-D float16: every slot's ``[out, in/G]`` zero points at group_offsets[s]."""
    qvalues_offsets: torch.Tensor
    """[num_slots] int64: element offset of each slot's qvalues block."""
    qindices_offsets: torch.Tensor
    """[num_slots] int64: element offset of each slot's qindices block (unread when dense)."""
    group_offsets: torch.Tensor
    """[num_slots] int64: element offset of each slot's scales block and of its zeros block."""
    bits: int
    """Bits per code of every slot (2 or 4)."""
    sparse: bool
    """Whether every slot is 2:4-sparse along the input dimension."""
    group_size: int
    """Input columns per (scale, zero) of every slot."""
    out_features: int
    """Rows of the linear's weight (the op's output width)."""
    in_features: int
    """Columns of the linear's weight (the op's input width)."""
    loaded: list[bool] = field(default_factory=list)
    """Host flags, one per slot: the slot holds a delta (``store``d); left empty at construction, every
    slot counts as loaded. A step that uses an empty slot is refused (its zero-filled region would
    silently add nothing)."""
    half2_ok: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """[num_slots] uint8 on the pool's device, one flag per slot: every zero point of the slot is an
    integer in (-1024, 1024), as the compressor writes them (set by ``store``; 0 where unknown, zeros at
    construction). The CUDA op reads it per block and takes its half2 dequantisation, exact only then
    (csrc/sbmm.cu RowScale), for float16 slots so flagged: no host check per call, no sync per ``store``,
    and a captured launch stays right whatever deltas come later."""
    offset_alignment: tuple[int, int, int] = field(default=(0, 0, 0), init=False, repr=False, compare=False)
    """(qvalues, qindices, scales / zeros): the largest power of two up to 4 dividing every slot block's
    start address, in elements (buffer address plus slot offset; set by the offset check, the buffers
    never move); the CUDA op copies 16- and 4-byte pieces."""
    ref_cache: dict[tuple[int, torch.dtype], torch.Tensor] | None = field(default=None, repr=False, compare=False)
    """(slot, dtype) -> ``dequantize`` of that slot for ``sbmm_ref``, when enabled (``cache_reference``:
    the CPU serving path, which would otherwise dequantise every delta at every call); None: off.
    ``store`` / ``clear`` drop the slot's entries; writing the buffers directly would not."""

    def __post_init__(self) -> None:
        n = self.qvalues_offsets.shape[0] if self.qvalues_offsets.dim() == 1 else -1
        if not self.loaded:
            self.loaded.extend([True] * max(n, 0))
        # The layout rules of the format (bits, group size, shape) are pack.py's; check them there.
        _check_layout(self.bits, self.sparse, self.group_size, self.out_features, self.in_features)
        bufs = {"qvalues": (self.qvalues, torch.int32), "qindices": (self.qindices, torch.int32),
                "scales": (self.scales, torch.float16), "zeros": (self.zeros, torch.float16)}  # fmt: skip
        for name, (t, dtype) in bufs.items():
            if t.dim() != 1 or t.dtype != dtype or (t.numel() and t.stride(0) != 1):
                raise ValueError(f"sbmm: pool {name} {list(t.shape)} {t.dtype}: want a 1-D contiguous {dtype} buffer")
        tables = {"qvalues_offsets": self.qvalues_offsets, "qindices_offsets": self.qindices_offsets,
                  "group_offsets": self.group_offsets}  # fmt: skip
        for name, t in tables.items():
            if t.dim() != 1 or t.shape[0] != n or n < 1 or t.dtype != torch.int64 or t.stride(0) != 1:
                raise ValueError(f"sbmm: {name} {list(t.shape)} {t.dtype}: want [num_slots >= 1] int64, contiguous, "
                                 f"like qvalues_offsets {list(self.qvalues_offsets.shape)}")
        if len(self.loaded) != n:
            raise ValueError(f"sbmm: {len(self.loaded)} loaded flags for {n} slots")
        devices = {t.device for t in (*[b for b, _ in bufs.values()], *tables.values())}
        if len(devices) != 1:
            raise ValueError("sbmm: pool buffers and offset tables must be on one device, got "
                             f"{sorted(map(str, devices))}")
        if self.half2_ok is None:
            object.__setattr__(self, "half2_ok", torch.zeros(max(n, 0), dtype=torch.uint8, device=self.qvalues.device))
        elif self.half2_ok.shape != (n,) or self.half2_ok.dtype != torch.uint8 or self.half2_ok.device not in devices:
            raise ValueError(f"sbmm: half2_ok {list(self.half2_ok.shape)} {self.half2_ok.dtype}: want [{n}] uint8 "
                             "on the pool's device")
        self._check_offsets()

    def slot_shapes(self) -> tuple[tuple[int, int], tuple[int, int] | None, tuple[int, int]]:
        """Shapes of one slot's qvalues, qindices (None when dense) and scales / zeros blocks."""
        out, inf, b = self.out_features, self.in_features, self.bits
        kept = inf // 2 if self.sparse else inf
        qi = (out, kept // 16) if self.sparse else None
        return (out, kept * b // 32), qi, (out, inf // self.group_size)

    def _check_offsets(self) -> None:
        """Every slot's blocks lie inside their buffers (one host sync)."""
        qv, qi, g = self.slot_shapes()
        checks = [("qvalues", self.qvalues_offsets, qv, self.qvalues), ("scales", self.group_offsets, g, self.scales),
                  ("zeros", self.group_offsets, g, self.zeros)]  # fmt: skip
        if qi is not None:
            checks.append(("qindices", self.qindices_offsets, qi, self.qindices))
        align = {"qvalues": 4, "qindices": 4, "scales": 4, "zeros": 4}
        for name, offs, shape, buf in checks:
            size = shape[0] * shape[1]
            for slot, o in enumerate(offs.tolist()):
                if o < 0 or o + size > buf.numel():
                    raise ValueError(f"sbmm: slot {slot}'s {name} block [{o}, {o + size}) is outside the "
                                     f"{buf.numel()}-element {name} buffer")
                at = buf.data_ptr() // buf.element_size() + o
                while at % align[name]:
                    align[name] //= 2
        object.__setattr__(self, "offset_alignment", (align["qvalues"], align["qindices"], align["scales"]))

    @property
    def num_slots(self) -> int:
        return self.qvalues_offsets.shape[0]

    @property
    def device(self) -> torch.device:
        return self.qvalues.device

    def check_loaded(self, slot: int) -> None:
        """Raises unless slot ``slot`` holds a delta (host state only: no device read)."""
        if not 0 <= slot < self.num_slots or not self.loaded[slot]:
            raise ValueError(f"sbmm: delta slot {slot} holds no delta (the pool has {self.num_slots} slots, "
                             f"loaded: {[s for s, ok in enumerate(self.loaded) if ok]})")

    def packed(self, slot: int) -> PackedLinear:
        """Slot ``slot``'s delta as a ``PackedLinear`` of views into the pool (for ``dequantize``)."""
        self.check_loaded(slot)
        return self._views(slot)

    def _views(self, slot: int) -> PackedLinear:
        """Slot ``slot``'s region as a ``PackedLinear`` of views, loaded or not."""
        qv, qi, g = self.slot_shapes()

        def view(buf: torch.Tensor, offs: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
            o = int(offs[slot])
            return buf[o : o + shape[0] * shape[1]].view(shape)

        return PackedLinear(self.bits, self.sparse, self.group_size, self.out_features, self.in_features,
                            view(self.qvalues, self.qvalues_offsets, qv),
                            None if qi is None else view(self.qindices, self.qindices_offsets, qi),
                            view(self.scales, self.group_offsets, g),
                            view(self.zeros, self.group_offsets, g))  # fmt: skip

    def cache_reference(self) -> None:
        """Lets ``sbmm_ref`` keep each slot's dequantised delta (more memory, no repeated unpacking)."""
        if self.ref_cache is None:
            object.__setattr__(self, "ref_cache", {})

    def reference_delta(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """``dequantize(packed(slot), dtype)`` as float32 ``[out, in]``: what ``sbmm_ref`` multiplies by."""
        key = (slot, dtype)
        if self.ref_cache is not None and key in self.ref_cache:
            return self.ref_cache[key]
        delta = dequantize(self.packed(slot), dtype).float()
        if self.ref_cache is not None:
            self.ref_cache[key] = delta
        return delta

    def _forget(self, slot: int) -> None:
        if self.ref_cache:
            for key in [k for k in self.ref_cache if k[0] == slot]:
                del self.ref_cache[key]

    def store(self, slot: int, p: PackedLinear) -> None:
        """Copies ``p`` into slot ``slot`` (in place) and marks it loaded."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"sbmm: delta slot {slot} out of range (the pool has {self.num_slots} slots)")
        _check_same_config(f"slot {slot}", p, self)
        dst = self._views(slot)
        for name, t in p.tensors().items():
            getattr(dst, name).copy_(t)
        self._forget(slot)
        self.loaded[slot] = True
        z = dst.zeros
        self.half2_ok[slot] = ((z == z.round()) & (z.abs() < 1024)).all()  # on the device: no sync

    def clear(self, slot: int) -> None:
        """Marks slot ``slot`` empty; a step that uses it is refused until the next ``store``."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"sbmm: delta slot {slot} out of range (the pool has {self.num_slots} slots)")
        self._forget(slot)
        self.loaded[slot] = False


def _check_same_config(what: str, p: PackedLinear, ref: PackedLinear | DeltaWeights) -> None:
    for name in ("bits", "sparse", "group_size", "out_features", "in_features"):
        if getattr(p, name) != getattr(ref, name):
            raise ValueError(f"sbmm: {what} has {name} = {getattr(p, name)}, the pool has {getattr(ref, name)} "
                             "(one pool holds one linear's deltas of one bits / sparsity / group-size config)")


def make_delta_weights(packed: Sequence[PackedLinear | None], device: torch.device | str | None = None) -> DeltaWeights:
    """A pool with one slot per entry (None: an empty slot, its region reserved and zero-filled).

    Every delta must share bits, sparsity, group size and shape; the pool goes to ``device`` (default:
    the first delta's). Slot s's blocks sit at s times the slot size in each buffer.
    """
    if not packed:
        raise ValueError("sbmm: make_delta_weights needs at least one slot")
    present = [(s, p) for s, p in enumerate(packed) if p is not None]
    if not present:
        raise ValueError("sbmm: make_delta_weights needs at least one delta (all slots are None)")
    first = present[0][1]
    for s, p in present[1:]:
        _check_same_config(f"slot {s}", p, first)
    dev = torch.device(device) if device is not None else first.qvalues.device
    n = len(packed)
    sizes = {name: t.numel() for name, t in first.tensors().items()}
    qi_size = sizes.get("qindices", 0)
    w = DeltaWeights(
        qvalues=torch.zeros(n * sizes["qvalues"], dtype=torch.int32, device=dev),
        qindices=torch.zeros(n * qi_size, dtype=torch.int32, device=dev),
        scales=torch.zeros(n * sizes["scales"], dtype=torch.float16, device=dev),
        zeros=torch.zeros(n * sizes["zeros"], dtype=torch.float16, device=dev),
        qvalues_offsets=torch.arange(n, dtype=torch.int64, device=dev) * sizes["qvalues"],
        qindices_offsets=torch.arange(n, dtype=torch.int64, device=dev) * qi_size,
        group_offsets=torch.arange(n, dtype=torch.int64, device=dev) * sizes["scales"],
        bits=first.bits, sparse=first.sparse, group_size=first.group_size,
        out_features=first.out_features, in_features=first.in_features, loaded=[False] * n,
    )  # fmt: skip
    for s, p in present:
        w.store(s, p)
    return w


# ----------------------------------------------------------------------------- checks + reference


def _check_call(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> None:
    if x.dim() != 2 or x.shape[0] != meta.num_tokens:
        raise ValueError(f"sbmm: x {list(x.shape)} must be [T = {meta.num_tokens}, in_features]")
    if x.shape[1] != w.in_features:
        raise ValueError(f"sbmm: x has {x.shape[1]} columns, the deltas want in_features = {w.in_features}")
    if x.dtype not in DTYPES:
        raise ValueError(f"sbmm: x dtype {x.dtype}: want one of float32, float16, bfloat16")
    if out.dim() != 2 or tuple(out.shape) != (meta.num_tokens, w.out_features):
        raise ValueError(f"sbmm: out {list(out.shape)} must be [T = {meta.num_tokens}, "
                         f"out_features = {w.out_features}]")
    if out.dtype != x.dtype:
        raise ValueError(f"sbmm: dtype mismatch: x {x.dtype}, out {out.dtype}")
    if out.stride(-1) != 1:
        raise ValueError("sbmm: out needs a contiguous last dim (it is updated in place)")
    if not (x.device == out.device == w.device == meta.seg_start.device):
        raise ValueError(f"sbmm: x on {x.device}, out on {out.device}, deltas on {w.device}, "
                         f"meta on {meta.seg_start.device}")
    if meta.max_slot >= w.num_slots:
        raise ValueError(f"sbmm: delta slot {meta.max_slot} out of range (the pool has {w.num_slots} slots)")
    empty = sorted(s for s in meta.slots if not w.loaded[s])
    if empty:
        raise ValueError(f"sbmm: delta slot {empty[0]} holds no delta (tokens of the step use it)")


def sbmm_ref(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> torch.Tensor:
    """Torch reference and CPU path of ``sbmm``: per delta, ``dequantize`` (pack.py) then one matmul."""
    _check_call(x, out, w, meta)
    for d, toks in meta.slot_tokens:
        tok = torch.tensor(toks, dtype=torch.long, device=meta.seg_start.device)
        delta = w.reference_delta(d, x.dtype)  # [out, in], at x's precision like the kernel
        out[tok] = (out[tok].float() + x[tok].float() @ delta.T).to(out.dtype)
    return out


# ----------------------------------------------------------------------------- Triton kernel


@triton.jit
def _work_tile(tiles_ptr):
    """This program's work tile (axis 0): its delta slot (int64, -1 for padding) and its range of ``order``."""
    tile = tl.program_id(0).to(tl.int64)
    slot = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    return slot, tl.load(tiles_ptr + tile * 3), tl.load(tiles_ptr + tile * 3 + 1)


@triton.jit
def _slot_rows(qv_ptr, qi_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, ns, QV_ROW, QI_ROW, NGROUPS):
    """Where rows ``ns`` of delta ``slot`` start: qvalues and qindices row pointers [BN, 1], group offsets [BN]."""
    n64 = ns.to(tl.int64)
    qv_rows = qv_ptr + tl.load(qv_off_ptr + slot) + n64[:, None] * QV_ROW
    qi_rows = qi_ptr + tl.load(qi_off_ptr + slot) + n64[:, None] * QI_ROW
    g_off = tl.load(g_off_ptr + slot) + n64 * NGROUPS
    return qv_rows, qi_rows, g_off


@triton.jit
def _tile_tokens(order_ptr, start, end, BLOCK_M: tl.constexpr):
    """A work tile's positions in ``order`` [BM], which are real, and their token indices (int64)."""
    at = start + tl.arange(0, BLOCK_M)
    row_ok = at < end
    rows = tl.load(order_ptr + at, mask=row_ok, other=0).to(tl.int64)
    return at, row_ok, rows


@triton.jit
def _add_to_out(o_ptrs, total, mask, RNE: tl.constexpr):
    """out = dtype(out + total) where ``mask``: the op's one rounding of the float32 sum."""
    oty = o_ptrs.dtype.element_ty
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, round_to(o + total, oty, RNE).to(oty), mask=mask)


@triton.jit
def _fma_plane(acc, x_rows, row_ok, cols, K, w):
    """acc [BM, BN, W] += x[:, cols] * w for one weight plane ``w`` [BN, W] (float32 holding x-dtype
    values); summed over W once at the end."""
    xt = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    return acc + xt.to(tl.float32)[:, None, :] * w[None, :, :]


@triton.jit
def _sbmm_fma_kernel(x_ptr, out_ptr, ws_ptr, order_ptr, tiles_ptr, qv_ptr, qi_ptr, sc_ptr, zr_ptr, qv_off_ptr, qi_off_ptr,
                     g_off_ptr, N, K, K_SPLIT, WS_ROWS, x_stride, out_stride, QV_ROW, QI_ROW, NGROUPS,
                     BITS: tl.constexpr, SPARSE: tl.constexpr, G: tl.constexpr, W: tl.constexpr, SCALES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, RNE: tl.constexpr):
    slot, start, end = _work_tile(tiles_ptr)
    if slot < 0:  # a padding row of the tile table
        return

    # PER codes per qvalues word; a word's codes cover STEP input columns (2:4: PER / 2 groups of 4).
    # Plane i of a K tile = the i-th code (dense) or group (2:4) of each of its W words.
    PER: tl.constexpr = 32 // BITS
    CMASK: tl.constexpr = (1 << BITS) - 1
    PLANES: tl.constexpr = PER // 2 if SPARSE else PER
    STEP: tl.constexpr = 4 * PLANES if SPARSE else PER
    BLOCK_K: tl.constexpr = STEP * W

    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    qv_rows, qi_rows, g_off = _slot_rows(qv_ptr, qi_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, ns, QV_ROW, QI_ROW,
                                         NGROUPS)
    at, row_ok, rows = _tile_tokens(order_ptr, start, end, BLOCK_M)
    x_rows = x_ptr + rows[:, None] * x_stride
    ty = x_ptr.dtype.element_ty
    ws = tl.arange(0, W)

    acc = tl.zeros((BLOCK_M, BLOCK_N, W), dtype=tl.float32)
    k_lo = tl.program_id(2) * K_SPLIT  # this program's share of the reduction (split-K)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
        widx = k0 // STEP + ws
        words = tl.load(qv_rows + widx[None, :], mask=n_ok[:, None] & (widx < QV_ROW)[None, :], other=0)  # [BN, W]
        base = k0 + STEP * ws  # [W] first input column of each word
        if SCALES == 0:  # the whole K tile is in one quantisation group: one scale / zero per row
            sc = tl.load(sc_ptr + g_off + k0 // G, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            zr = tl.load(zr_ptr + g_off + k0 // G, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        elif SCALES == 1:  # a word's columns are in one group: one scale / zero per (row, word)
            gmask = n_ok[:, None] & (base < K)[None, :]
            sc = tl.load(sc_ptr + g_off[:, None] + (base // G)[None, :], mask=gmask, other=0.0).to(tl.float32)
            zr = tl.load(zr_ptr + g_off[:, None] + (base // G)[None, :], mask=gmask, other=0.0).to(tl.float32)
        if SPARSE:
            # The 2:4 position words: 8 groups per word, so the PLANES groups of a code word share one.
            gidx = k0 // 4 + PLANES * ws  # [W] first group of each word
            iw = tl.load(qi_rows + (gidx // 8)[None, :], mask=n_ok[:, None] & (gidx // 8 < QI_ROW)[None, :], other=0)
        for i in tl.static_range(PLANES):
            if SPARSE:
                cols = base + 4 * i  # group i of each word: columns cols .. cols + 3
            else:
                cols = base + i
            if SCALES == 2:  # gathered per plane
                gmask = n_ok[:, None] & (cols < K)[None, :]
                sc = tl.load(sc_ptr + g_off[:, None] + (cols // G)[None, :], mask=gmask, other=0.0).to(tl.float32)
                zr = tl.load(zr_ptr + g_off[:, None] + (cols // G)[None, :], mask=gmask, other=0.0).to(tl.float32)
            if SPARSE:
                # The group's two kept codes and their positions p0 < p1; each of its 4 columns takes
                # v0, v1 or 0.
                v0 = round_to((((words >> (2 * i * BITS)) & CMASK).to(tl.float32) - zr) * sc, ty, RNE)
                v1 = round_to((((words >> ((2 * i + 1) * BITS)) & CMASK).to(tl.float32) - zr) * sc, ty, RNE)
                sh = (((gidx + i) % 8) * 4)[None, :]
                p0 = (iw >> sh) & 3
                p1 = (iw >> (sh + 2)) & 3
                acc = _fma_plane(acc, x_rows, row_ok, cols, K, tl.where(p0 == 0, v0, 0.0))
                acc = _fma_plane(acc, x_rows, row_ok, cols + 1, K, tl.where(p0 == 1, v0, tl.where(p1 == 1, v1, 0.0)))
                acc = _fma_plane(acc, x_rows, row_ok, cols + 2, K, tl.where(p1 == 2, v1, tl.where(p0 == 2, v0, 0.0)))
                acc = _fma_plane(acc, x_rows, row_ok, cols + 3, K, tl.where(p1 == 3, v1, 0.0))
            else:
                v = round_to((((words >> (i * BITS)) & CMASK).to(tl.float32) - zr) * sc, ty, RNE)
                acc = _fma_plane(acc, x_rows, row_ok, cols, K, v)
    total = tl.sum(acc, axis=2)  # [BM, BN]
    mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        _add_to_out(out_ptr + rows[:, None] * out_stride + ns[None, :], total, mask, RNE)
    else:  # float32 partial sums, [split, position in order, column]; _splitk_reduce adds them to out
        w_ptrs = ws_ptr + (tl.program_id(2) * WS_ROWS + at.to(tl.int64))[:, None] * N + ns[None, :]
        tl.store(w_ptrs, total, mask=mask)


@triton.jit
def _splitk_reduce_kernel(out_ptr, ws_ptr, order_ptr, N, WS_ROWS, out_stride, SPLIT_K: tl.constexpr,
                          BLOCK_N: tl.constexpr, RNE: tl.constexpr):
    """out[order[p]] = round(out[order[p]] + sum over splits of the partials of position p): one rounding,
    summed in a fixed order."""
    at = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(ws_ptr + (s * WS_ROWS + at) * N + ns, mask=n_ok, other=0.0)
    row = tl.load(order_ptr + at).to(tl.int64)
    _add_to_out(out_ptr + row * out_stride + ns, total, n_ok, RNE)


@triton.jit
def _dequant_tile(qv_rows, qi_rows, g_off, sc_ptr, zr_ptr, n_ok, k0, K, QV_ROW, QI_ROW, NGROUPS,
                  BITS: tl.constexpr, SPARSE: tl.constexpr, G: tl.constexpr, KEPT: tl.constexpr, WORDS: tl.constexpr,
                  IWORDS: tl.constexpr, GROUPS_PER_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """THE dequantised delta tile of the Triton kernels: rows ``ns`` (``n_ok``: real; row pointers from
    ``_slot_rows``), columns k0 .. k0 + BLOCK_K, as float32 ``(code - zero) * scale`` where kept, else
    0 (past K too). KEPT: kept values per row in the tile (BLOCK_K, or half of it with 2:4); WORDS /
    IWORDS: the qvalues / qindices words that hold them (32 / BITS codes, 16 positions per word)."""
    PER: tl.constexpr = 32 // BITS
    CMASK: tl.constexpr = (1 << BITS) - 1
    shifts = tl.arange(0, PER) * BITS
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    # Codes of the tile's kept values: [BN, WORDS] words -> [BN, WORDS, PER] -> [BN, KEPT].
    widx = (k0 * KEPT // BLOCK_K) // PER + tl.arange(0, WORDS)
    words = tl.load(qv_rows + widx[None, :], mask=n_ok[:, None] & (widx < QV_ROW)[None, :], other=0)
    codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & CMASK, (BLOCK_N, KEPT))
    if SPARSE:
        iidx = k0 // 32 + tl.arange(0, IWORDS)
        iw = tl.load(qi_rows + iidx[None, :], mask=n_ok[:, None] & (iidx < QI_ROW)[None, :], other=0)
        pos = tl.reshape((iw[:, :, None] >> (tl.arange(0, 16) * 2)[None, None, :]) & 3, (BLOCK_N, KEPT))
        # The two kept values of each group of 4 columns, then each dense position's code / keep.
        c0, c1 = tl.split(tl.reshape(codes, (BLOCK_N, BLOCK_K // 4, 2)))
        p0, p1 = tl.split(tl.reshape(pos, (BLOCK_N, BLOCK_K // 4, 2)))
        q = tl.arange(0, 4)[None, None, :]
        at0 = p0[:, :, None] == q
        at1 = p1[:, :, None] == q
        code = tl.reshape(tl.where(at0, c0[:, :, None], c1[:, :, None]), (BLOCK_N, BLOCK_K))
        keep = tl.reshape((at0 | at1).to(tl.int32), (BLOCK_N, BLOCK_K)) != 0
        keep = keep & k_ok[None, :]
    else:
        code = codes
        keep = tl.broadcast_to(k_ok[None, :], (BLOCK_N, BLOCK_K))
    if G % BLOCK_K == 0:  # the whole tile is in one quantisation group: one scale / zero per row
        gi = g_off + k0 // G
        sc = tl.load(sc_ptr + gi, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        zr = tl.load(zr_ptr + gi, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    elif GROUPS_PER_TILE > 0:  # whole groups (G a power of two): load [BN, groups], broadcast to columns
        gs = k0 // G + tl.arange(0, GROUPS_PER_TILE)
        gi = g_off[:, None] + gs[None, :]
        gmask = n_ok[:, None] & (gs < NGROUPS)[None, :]
        sc = tl.load(sc_ptr + gi, mask=gmask, other=0.0).to(tl.float32)
        zr = tl.load(zr_ptr + gi, mask=gmask, other=0.0).to(tl.float32)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, GROUPS_PER_TILE, G)), (BLOCK_N, BLOCK_K))
        zr = tl.reshape(tl.broadcast_to(zr[:, :, None], (BLOCK_N, GROUPS_PER_TILE, G)), (BLOCK_N, BLOCK_K))
    else:  # any other G: gather one scale / zero per column
        gi = g_off[:, None] + (ks // G)[None, :]
        gmask = n_ok[:, None] & k_ok[None, :]
        sc = tl.load(sc_ptr + gi, mask=gmask, other=0.0).to(tl.float32)
        zr = tl.load(zr_ptr + gi, mask=gmask, other=0.0).to(tl.float32)
    return tl.where(keep, (code.to(tl.float32) - zr) * sc, 0.0)


@triton.jit
def _sbmm_dot_kernel(x_ptr, out_ptr, order_ptr, tiles_ptr, qv_ptr, qi_ptr, sc_ptr, zr_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr,
                 N, K, x_stride, out_stride, QV_ROW, QI_ROW, NGROUPS,
                 BITS: tl.constexpr, SPARSE: tl.constexpr, G: tl.constexpr,
                 KEPT: tl.constexpr, WORDS: tl.constexpr, IWORDS: tl.constexpr, GROUPS_PER_TILE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RNE: tl.constexpr):
    slot, start, end = _work_tile(tiles_ptr)
    if slot < 0:  # a padding row of the tile table
        return

    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    qv_rows, qi_rows, g_off = _slot_rows(qv_ptr, qi_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, ns, QV_ROW, QI_ROW,
                                         NGROUPS)
    at, row_ok, rows = _tile_tokens(order_ptr, start, end, BLOCK_M)
    x_rows = x_ptr + rows[:, None] * x_stride
    ty = x_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        wt = _dequant_tile(qv_rows, qi_rows, g_off, sc_ptr, zr_ptr, n_ok, k0, K, QV_ROW, QI_ROW, NGROUPS, BITS, SPARSE,
                           G, KEPT, WORDS, IWORDS, GROUPS_PER_TILE, BLOCK_N, BLOCK_K)  # [BN, BK] fp32, Δ̃ rows
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's low-precision dot is wrong: fp32 tiles holding dtype values
            wt = round_to(wt, ty, RNE)
            xt = xt.to(tl.float32)
        else:
            wt = wt.to(ty)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PREC)
    _add_to_out(out_ptr + rows[:, None] * out_stride + ns[None, :], acc, row_ok[:, None] & n_ok[None, :], RNE)


@triton.jit
def _dequant_kernel(dst_ptr, qv_ptr, qi_ptr, sc_ptr, zr_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, N, K, dst_stride,
                    QV_ROW, QI_ROW, NGROUPS,
                    BITS: tl.constexpr, SPARSE: tl.constexpr, G: tl.constexpr, KEPT: tl.constexpr, WORDS: tl.constexpr,
                    IWORDS: tl.constexpr, GROUPS_PER_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    RNE: tl.constexpr):
    """dst[n, k] = Δ̃_slot[n, k] in dst's dtype: one [BLOCK_N, BLOCK_K] tile per program (axis 0: rows,
    axis 1: columns), the tile ``_dequant_tile`` gives the tl.dot kernel."""
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    k0 = tl.program_id(1) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    qv_rows, qi_rows, g_off = _slot_rows(qv_ptr, qi_ptr, qv_off_ptr, qi_off_ptr, g_off_ptr, slot, ns, QV_ROW, QI_ROW,
                                         NGROUPS)
    wt = _dequant_tile(qv_rows, qi_rows, g_off, sc_ptr, zr_ptr, n_ok, k0, K, QV_ROW, QI_ROW, NGROUPS, BITS, SPARSE, G,
                       KEPT, WORDS, IWORDS, GROUPS_PER_TILE, BLOCK_N, BLOCK_K)
    ty = dst_ptr.dtype.element_ty
    dst = dst_ptr + ns.to(tl.int64)[:, None] * dst_stride + ks[None, :]
    tl.store(dst, round_to(wt, ty, RNE).to(ty), mask=n_ok[:, None] & (ks < K)[None, :])


def _step(w: DeltaWeights) -> int:
    """Input columns one qvalues word covers (the FMA kernel's STEP): 32/bits codes, twice that with 2:4."""
    per = 32 // w.bits
    return 2 * per if w.sparse else per


def launch_config(meta: DeltaMeta, w: DeltaWeights) -> dict[str, int]:
    """The launch config of one call: ``LAUNCH[meta.block_m]``, adjusted to the call on CUDA so the launch
    has at least ``_MIN_WAVES`` programs per SM (one or two deltas): FMA tiles split the reduction
    (SPLIT_K 0 = pick: the fewest of 1, 2, 4, 8, 16 splits that fill the SMs, each split >= 2 K tiles),
    tl.dot tiles halve BLOCK_N (down to 16). FMA tiles take BLOCK_K >= one qvalues word."""
    cfg = dict(LAUNCH[meta.block_m])
    cuda = w.device.type == "cuda"
    want = _MIN_WAVES * _sm_count(w.device) if cuda else 0
    if meta.block_m <= _FMA_MAX_M:
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], _step(w))
        if cfg.get("SPLIT_K", 0) == 0:
            programs = meta.num_tiles * triton.cdiv(w.out_features, cfg["BLOCK_N"])
            k_tiles = triton.cdiv(w.in_features, cfg["BLOCK_K"])
            split = 1
            while cuda and split < 16 and programs * split < want and k_tiles >= 4 * split:
                split *= 2
            cfg["SPLIT_K"] = split
        return cfg
    while cuda and cfg["BLOCK_N"] > 16 and meta.num_tiles * triton.cdiv(w.out_features, cfg["BLOCK_N"]) < want:
        cfg["BLOCK_N"] //= 2
    return cfg


def sbmm_triton(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> torch.Tensor:
    """Triton kernels for ``sbmm`` (no dispatch), in place on ``out``: one launch for all deltas (plus a
    reduction launch when FMA tiles split K)."""
    _check_call(x, out, w, meta)
    if meta.block_m not in LAUNCH:
        raise ValueError(f"sbmm_triton: work tiles of {meta.block_m} tokens (the Triton kernels take "
                         f"{', '.join(map(str, sorted(LAUNCH)))}; metadata capped there is the CUDA op's)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if meta.dense:
        _dense_segments(x, out, w, meta)
    if meta.num_tiles == 0:
        return out
    cfg = launch_config(meta, w)
    block_n, block_k, group = cfg["BLOCK_N"], cfg["BLOCK_K"], w.group_size
    qv, qi, g = w.slot_shapes()
    qi_buf, qi_row = (w.qindices, qi[1]) if qi is not None else (w.qvalues, 1)
    rne = needs_rne_by_hand(out)
    n_tiles = triton.cdiv(w.out_features, block_n)
    if meta.block_m <= _FMA_MAX_M:
        step, split = _step(w), cfg["SPLIT_K"]
        # Scales: one per row of a K tile, one per (row, qvalues word), or gathered per plane.
        scales = 0 if group % block_k == 0 else 1 if group % step == 0 else 2
        k_split = triton.cdiv(triton.cdiv(w.in_features, block_k), split) * block_k
        rows = meta.num_delta_tokens
        # Partials workspace; without a split the kernel never touches it (out stands in, no allocation).
        ws = torch.empty((split, rows, w.out_features), dtype=torch.float32, device=x.device) if split > 1 else out
        _sbmm_fma_kernel[(meta.grid_tiles, n_tiles, split)](
            x, out, ws, meta.order, meta.tiles, w.qvalues, qi_buf, w.scales, w.zeros, w.qvalues_offsets,
            w.qindices_offsets, w.group_offsets, w.out_features, w.in_features, k_split, rows, x.stride(0),
            out.stride(0), qv[1], qi_row, g[1], BITS=w.bits, SPARSE=w.sparse, G=group, W=block_k // step,
            SCALES=scales, BLOCK_M=meta.block_m, BLOCK_N=block_n, SPLIT_K=split, RNE=rne,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
        if split > 1:
            _splitk_reduce_kernel[(rows, triton.cdiv(w.out_features, 256))](
                out, ws, meta.order, w.out_features, rows, out.stride(0), SPLIT_K=split, BLOCK_N=256, RNE=rne)
        return out
    upcast = not x.is_cuda
    prec = "ieee" if upcast or x.dtype == torch.float32 else "tf32"
    _sbmm_dot_kernel[(meta.grid_tiles, n_tiles)](
        x, out, meta.order, meta.tiles, w.qvalues, qi_buf, w.scales, w.zeros, w.qvalues_offsets, w.qindices_offsets,
        w.group_offsets, w.out_features, w.in_features, x.stride(0), out.stride(0), qv[1], qi_row, g[1],
        **_tile_constexprs(w, block_k), BLOCK_M=meta.block_m, BLOCK_N=block_n, UPCAST=upcast, DOT_PREC=prec, RNE=rne,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    return out


def _tile_constexprs(w: DeltaWeights, block_k: int) -> dict[str, int | bool]:
    """``_dequant_tile``'s pool and K-tile constexprs for ``w`` and ``BLOCK_K = block_k``: KEPT values per
    row and tile, the WORDS / IWORDS holding them, and GROUPS_PER_TILE (scales per tile: one per row when
    G % BLOCK_K == 0, whole power-of-two groups broadcast, or 0: gathered per column)."""
    group = w.group_size
    kept = block_k // 2 if w.sparse else block_k
    groups_per_tile = block_k // group if block_k % group == 0 and group & (group - 1) == 0 else 0
    return {"BITS": w.bits, "SPARSE": w.sparse, "G": group, "KEPT": kept, "WORDS": kept * w.bits // 32,
            "IWORDS": max(kept // 16, 1) if w.sparse else 1, "GROUPS_PER_TILE": groups_per_tile,
            "BLOCK_K": block_k}  # fmt: skip


_DEQUANT = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4}
"""Launch config of ``_dequant_kernel`` (BLOCK_K a power of two >= 32 and >= G)."""


def dequantize_slot(w: DeltaWeights, slot: int, dtype: torch.dtype, out: torch.Tensor | None = None, *,
                    use_triton: bool | None = None) -> torch.Tensor:
    """Slot ``slot``'s delta as a dense ``[out_features, in_features]`` tensor of ``dtype`` on ``w``'s
    device: ``pack.dequantize(w.packed(slot), dtype)`` bit for bit, the value every SBMM kernel
    multiplies by. ``out``: a contiguous tensor of that shape and dtype to write into (a reused
    scratch). csrc/sbmm.cu's ``deltaserve_dequant`` where it is built (float16 / bfloat16 on CUDA),
    else the Triton ``_dequant_kernel`` (``use_triton=True`` forces it)."""
    w.check_loaded(slot)
    if dtype not in DTYPES:
        raise ValueError(f"sbmm: dequantize_slot dtype {dtype}: want one of float32, float16, bfloat16")
    shape = (w.out_features, w.in_features)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=w.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != w.device or not out.is_contiguous():
        raise ValueError(f"sbmm: dequantize_slot out {list(out.shape)} {out.dtype} on {out.device}: want a contiguous "
                         f"{list(shape)} {dtype} on {w.device}")  # fmt: skip
    lib = cuda_ext.library("sbmm") if use_triton is None and out.is_cuda and dtype in _CUDA_DTYPES else None
    if lib is not None:
        fn = lib.deltaserve_dequant
        if fn.argtypes is None:
            fn.argtypes, fn.restype = _CUDA_DEQUANT_ARGS, ctypes.c_int
        code = fn(out.data_ptr(), w.qvalues.data_ptr(), w.qindices.data_ptr() if w.sparse else None,
                  w.scales.data_ptr(), w.zeros.data_ptr(), w.qvalues_offsets.data_ptr(), w.qindices_offsets.data_ptr(),
                  w.group_offsets.data_ptr(), slot, w.out_features, w.in_features, w.group_size, w.bits, int(w.sparse),
                  _CUDA_DTYPES[dtype], torch.cuda.current_stream(out.device).cuda_stream)  # fmt: skip
        cuda_ext.check(lib, code, "dequantize_slot")
        return out
    cfg = _DEQUANT
    block_n, block_k = cfg["BLOCK_N"], max(cfg["BLOCK_K"], w.group_size)
    qv, qi, g = w.slot_shapes()
    qi_buf, qi_row = (w.qindices, qi[1]) if qi is not None else (w.qvalues, 1)
    _dequant_kernel[(triton.cdiv(w.out_features, block_n), triton.cdiv(w.in_features, block_k))](
        out, w.qvalues, qi_buf, w.scales, w.zeros, w.qvalues_offsets, w.qindices_offsets, w.group_offsets, slot,
        w.out_features, w.in_features, out.stride(0), qv[1], qi_row, g[1], **_tile_constexprs(w, block_k),
        BLOCK_N=block_n, RNE=needs_rne_by_hand(out), num_warps=cfg["num_warps"])  # fmt: skip
    return out


def _dense_segments(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> torch.Tensor:
    """The metadata's dense segments (``DeltaMeta.dense``): per segment, its delta dequantised once
    (``dequantize_slot``) and one matmul ``out[a:b] += x[a:b] Δ̃^T`` (fp32 accumulation, one rounding:
    cuBLAS's ``beta = 1``), instead of one dequantisation per work tile. Consecutive segments of one
    slot share the dequantised delta."""
    scratch, held = None, -1
    for start, end, slot in meta.dense:
        if slot != held:
            scratch = dequantize_slot(w, slot, x.dtype, out=scratch)
            held = slot
        out[start:end].addmm_(x[start:end], scratch.t())
    return out


# ----------------------------------------------------------------------------- CUDA C++ op (csrc/sbmm.cu)

_CUDA_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
_CUDA_ROWS = 128
"""Output rows per block of csrc/sbmm.cu (its ``ROWS``)."""
_CUDA_KS = 256
"""Input columns per pipelined stage of csrc/sbmm.cu (its ``KS``): K must be a multiple."""
_CUDA_GROUPS = (32, 64, 128)
"""Group sizes csrc/sbmm.cu takes (a stage's scales are copied as 4-byte pieces)."""
_CUDA_MAX_M = 16
"""Largest work tile csrc/sbmm.cu takes (two 8-token MMA fragments)."""
_CUDA_BLOCKS_PER_SM = 4
"""Blocks of csrc/sbmm.cu one SM runs at once (its SBMM_MIN_BLOCKS: what its registers and two stages of
shared memory allow): K is split until a launch has this many blocks per SM."""
_CUDA_MAX_SLICES = 3
"""Most linears one CUDA launch takes (csrc/sbmm.cu ``MAX_SLICES``: q, k, v of a fused qkv)."""
_P = ctypes.c_void_p
_CUDA_ARGS = ([_P] * 7 + [ctypes.POINTER(_P)] * 8 + [ctypes.POINTER(ctypes.c_int)] * 2 + [ctypes.c_int] * 3
              + [ctypes.c_int64] * 2 + [ctypes.c_int] * 9 + [_P])
"""``deltaserve_sbmm``'s C signature (csrc/sbmm.cu)."""
_CUDA_SPLIT_ARGS = [ctypes.c_int] * 4
"""``deltaserve_sbmm_split``'s C signature."""
_CUDA_DEQUANT_ARGS = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 7 + [ctypes.c_void_p]
"""``deltaserve_dequant``'s C signature (csrc/sbmm.cu)."""


def cuda_supports(x: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> str | None:
    """None when csrc/sbmm.cu can run this call, else why not (then the Triton kernel runs)."""
    if meta.block_m > _CUDA_MAX_M:
        return f"work tiles of {meta.block_m} tokens (at most {_CUDA_MAX_M})"
    return cuda_shape_problem(x, w)


def cuda_shape_problem(x: torch.Tensor, w: DeltaWeights) -> str | None:
    """``cuda_supports`` for any metadata: why csrc/sbmm.cu cannot take activations like ``x`` (device,
    dtype) with pool ``w``, or None."""
    if not x.is_cuda:
        return "CPU tensors"
    if x.dtype not in _CUDA_DTYPES:
        return f"activations {x.dtype} (float16 / bfloat16 only)"
    if w.in_features % _CUDA_KS or w.group_size not in _CUDA_GROUPS:
        return (f"in_features {w.in_features} (want a multiple of {_CUDA_KS}) / group size {w.group_size} "
                f"(want one of {_CUDA_GROUPS})")
    qv_align, qi_align, group_align = w.offset_alignment
    if qv_align < 4 or qi_align < 4 or group_align < 2:
        return f"slot blocks aligned to {w.offset_alignment} elements (want 4, 4, 2)"
    return None


def cuda_tile_cap(device: torch.device) -> int | None:
    """``DeltaMeta``'s ``max_block_m`` on ``device``, for decode and prefill steps alike: the CUDA op's
    largest tile where that op runs, else None. A run of one delta then takes several CUDA tiles
    instead of Triton tiles of 64 tokens: 64 tokens of each of 8 deltas took 245 µs instead of 640 µs
    on the H200 (11008x4096, bench/README.md), though each 16-token tile reads the delta again."""
    if device.type != "cuda" or not use_triton_for(device) or cuda_ext.library("sbmm") is None:
        return None
    return _CUDA_MAX_M


_DENSE_MIN_M = 64
"""Prefill segments of a delta with at least this many tokens run dense on CUDA (``dense_min_m``)."""


def dense_min_m(device: torch.device) -> int | None:
    """``DeltaMeta.segments``' ``dense_min_m`` on ``device``: ``_DENSE_MIN_M`` on CUDA, where one
    dequantisation plus a cuBLAS matmul beats a work tile per 16 (or 64) tokens that each dequantise
    the delta again; None elsewhere (the CPU reference computes every segment that way already)."""
    return _DENSE_MIN_M if device.type == "cuda" else None


def _cuda_split(lib: ctypes.CDLL, row_blocks: int, tiles: int, in_features: int, device: torch.device) -> int:
    """K splits of a CUDA launch of ``row_blocks`` x ``tiles`` blocks (csrc/sbmm.cu ``split_for``, the one copy
    of the rule: the fewest that fill every SM with ``_CUDA_BLOCKS_PER_SM`` blocks, each split >= 2 stages)."""
    fn = lib.deltaserve_sbmm_split
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _CUDA_SPLIT_ARGS, ctypes.c_int
    return fn(row_blocks, tiles, in_features, _CUDA_BLOCKS_PER_SM * _sm_count(device))


_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """The CUDA op's split-K arrival counters on ``device`` (int32, at least ``n``; zero between launches:
    the last split of each block resets its counter). One buffer kept per device, so captured graphs keep
    its address; grown only outside a capture."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            kept = 0 if buf is None else buf.numel()
            raise RuntimeError(f"sbmm_cuda: split-K counters of {n} entries do not fit the {kept} kept; run the "
                               "launch once before capturing it")
        buf = _counters[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return buf


def sbmm_cuda(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> torch.Tensor:
    """csrc/sbmm.cu for ``sbmm`` (no dispatch), in place on ``out``: one launch for all deltas. Raises when
    the op is unavailable or does not fit the call."""
    return sbmm_stacked_cuda(x, out, [(w, 0)], meta)


def sbmm_stacked_cuda(x: torch.Tensor, out: torch.Tensor, slices: Sequence[tuple[DeltaWeights, int]],
                      meta: DeltaMeta) -> torch.Tensor:
    """csrc/sbmm.cu for ``sbmm_stacked`` (no dispatch): every slice in one launch. Raises when the op is
    unavailable or does not fit the call."""
    _check_stacked(x, out, slices, meta)
    if len(slices) > _CUDA_MAX_SLICES:
        raise ValueError(f"sbmm_cuda: {len(slices)} slices (one launch takes at most {_CUDA_MAX_SLICES})")
    for w, _ in slices:
        why = cuda_supports(x, w, meta)
        if why is not None:
            raise ValueError(f"sbmm_cuda: unsupported call: {why}")
    lib = cuda_ext.library("sbmm")
    if lib is None:
        raise RuntimeError(f"sbmm_cuda: the CUDA op is unavailable: {cuda_ext.unavailable('sbmm')}")
    return _launch_cuda(lib, x, out, slices, meta)


def _launch_cuda(lib: ctypes.CDLL, x: torch.Tensor, out: torch.Tensor, slices: Sequence[tuple[DeltaWeights, int]],
                 meta: DeltaMeta) -> torch.Tensor:
    """The launch of ``sbmm_stacked_cuda``, for callers that checked the call, ``cuda_supports`` and the
    library. Eagerly the grid has the step's split; inside a CUDA-graph capture it has the most splits any
    tile count could want, and the blocks recompute the split from ``meta.tile_count`` at every replay."""
    for w, col in slices:
        if meta.dense:
            _dense_segments(x, out[:, col : col + w.out_features], w, meta)
    w0 = slices[0][0]
    row_blocks = sum(triton.cdiv(w.out_features, _CUDA_ROWS) for w, _ in slices)
    counters = _split_counters(x.device, meta.grid_tiles * row_blocks)  # before any capture: graphs keep it
    capturing = torch.cuda.is_current_stream_capturing()
    if meta.num_tiles == 0 and not capturing:
        return out
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    if capturing:  # the most splits any step takes (one tile); the blocks split as the step wants
        split = _cuda_split(lib, row_blocks, 1, w0.in_features, x.device)
        tile_count = meta.tile_count
    else:
        split = _cuda_split(lib, row_blocks, meta.num_tiles, w0.in_features, x.device)
        tile_count = None  # the grid's split is the step's
    rows = meta.order.shape[0]  # partial sums by position in ``order``: a shape that depends on T only
    cols = max(col + w.out_features for w, col in slices)
    ws = torch.empty((split, rows, cols), dtype=torch.float32, device=x.device) if split > 1 else None
    n = len(slices)

    def ptrs(values: list) -> ctypes.Array:
        return (_P * n)(*values)

    fn = lib.deltaserve_sbmm
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _CUDA_ARGS, ctypes.c_int
    half2 = x.dtype == torch.float16
    code = fn(
        x.data_ptr(), out.data_ptr(), None if ws is None else ws.data_ptr(),
        counters.data_ptr(), meta.order.data_ptr(), meta.tiles.data_ptr(),
        None if tile_count is None else tile_count.data_ptr(),
        *(ptrs([getattr(w, name).data_ptr() if name != "qindices" or w.sparse else None for w, _ in slices])
          for name in ("qvalues", "qindices", "scales", "zeros", "qvalues_offsets", "qindices_offsets",
                       "group_offsets")),
        ptrs([w.half2_ok.data_ptr() if half2 else None for w, _ in slices]),
        (ctypes.c_int * n)(*[w.out_features for w, _ in slices]), (ctypes.c_int * n)(*[col for _, col in slices]), n,
        w0.in_features, w0.group_size, x.stride(0), out.stride(0), w0.bits, int(w0.sparse), _CUDA_DTYPES[x.dtype],
        max(meta.tile_tokens, 1), meta.grid_tiles, split, rows, cols, _CUDA_BLOCKS_PER_SM * _sm_count(x.device),
        torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    cuda_ext.check(lib, code, "sbmm_cuda")
    return out


# ----------------------------------------------------------------------------- entry point


def sbmm(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta, *,
         use_triton: bool | None = None) -> torch.Tensor:
    """``out[t] += x[t] @ Δ̃_{slot(t)}^T`` in place for every token with a slot (module docstring);
    returns ``out``. On CUDA the kernels run: csrc/sbmm.cu where it is built and fits the call, else
    Triton (``use_triton=True`` forces Triton); the reference elsewhere."""
    if want_triton("sbmm", x, use_triton):
        lib = cuda_ext.library("sbmm") if use_triton is None else None
        if lib is not None and cuda_supports(x, w, meta) is None:
            _check_call(x, out, w, meta)
            return _launch_cuda(lib, x, out, [(w, 0)], meta)
        return sbmm_triton(x, out, w, meta)
    return sbmm_ref(x, out, w, meta)


def sbmm_stacked(x: torch.Tensor, out: torch.Tensor, slices: Sequence[tuple[DeltaWeights, int]], meta: DeltaMeta, *,
                 use_triton: bool | None = None) -> torch.Tensor:
    """``sbmm(x, out[:, col : col + w.out_features], w, meta)`` for every ``(w, col)`` of ``slices`` (the
    projections of a fused module: q, k, v or gate, up, each its own pool, same in_features and config),
    in place; returns ``out``. On CUDA, where the op fits every slice, one launch computes them all (up to
    ``_CUDA_MAX_SLICES``); otherwise each slice runs as ``sbmm`` does."""
    _check_stacked(x, out, slices, meta)
    if want_triton("sbmm", x, use_triton):
        lib = cuda_ext.library("sbmm") if use_triton is None else None
        if lib is not None and len(slices) <= _CUDA_MAX_SLICES and all(cuda_supports(x, w, meta) is None
                                                                       for w, _ in slices):
            return _launch_cuda(lib, x, out, slices, meta)
    for w, col in slices:
        sbmm(x, out[:, col : col + w.out_features], w, meta, use_triton=use_triton)
    return out


def _check_stacked(x: torch.Tensor, out: torch.Tensor, slices: Sequence[tuple[DeltaWeights, int]],
                   meta: DeltaMeta) -> None:
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
            raise ValueError(f"sbmm: stacked slice {i} has (bits, sparse, group, in) = "
                             f"{(w.bits, w.sparse, w.group_size, w.in_features)}, the first "
                             f"{(w0.bits, w0.sparse, w0.group_size, w0.in_features)}")
        if col < end or col + w.out_features > out.shape[1]:
            raise ValueError(f"sbmm: stacked slice at columns {col} .. {col + w.out_features} overlaps another or is "
                             f"outside out's {out.shape[1]} columns")
        end = col + w.out_features
        _check_call(x, out[:, col : col + w.out_features], w, meta)
