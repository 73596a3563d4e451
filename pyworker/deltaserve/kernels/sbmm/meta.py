"""Batch metadata of SBMM (``DeltaMeta``): which tokens use which delta slot in one step, as work tiles.

Built once per step on the host and reused by every layer and linear, on the step's segments
(``kernels.segments``: the shape of ``LoraMeta.sgmv``)::

    seg_start [S + 1] int32   token range of segment s is seg_start[s] .. seg_start[s + 1]
    seg_delta [S] int32       delta slot of segment s, or -1
    decode: one token per row (``DeltaMeta.rows``): seg_start = 0, 1, ..., T

The launch does not follow segments one to one: the host lists the step's tokens grouped by slot
(``order``: every token of slot d, in step order, then the next slot's; base-only tokens left out)
and cuts each slot's run into *work tiles* of at most ``block_m`` tokens, so all tokens of one delta
share tiles and read the delta once per tile, wherever they sit in the batch. One program computes
one tile x ``BLOCK_N`` output columns over the whole reduction, reading x rows and writing out rows
through ``order``. ``block_m`` follows the longest run of one slot: 1, 2 or 4 (FMA tiles, up to
``FMA_MAX_M``), else 16 or 64 (tl.dot tiles), capped by ``max_block_m`` where a caller asks for
shorter tiles.

Prefill segments of at least ``dense_min_m`` tokens of one delta go to ``dense`` instead (its delta
dequantised once, one matmul: ``dequant.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..segments import Segments, SlotNames

SLOT_NAMES = SlotNames(op="sbmm", slot="delta slot", variant="delta")
"""How SBMM's segment errors name its slots."""

FMA_MAX_M = 4
"""Work tiles of at most this many tokens (decode: a delta's rows in the step) multiply with plain FMAs:
BLOCK_M is the run's length rounded up to a power of two (1, 2, 4), no tensor-core tile padded to 16
(the FMA against tl.dot sweep: bench/README.md)."""
_DOT_MIN_M = 16
"""Tokens per work tile when some run of one slot is longer than ``FMA_MAX_M`` (tl.dot's minimum)."""
_BLOCK_M_LARGE = 64
"""Tokens per work tile when some run of one slot is longer than ``_DOT_MIN_M``: fewer tiles, so the
delta is dequantised fewer times per run."""


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
    def segments(
        cls,
        seg_lens: Sequence[int],
        seg_delta: Sequence[int],
        device: torch.device | str,
        max_block_m: int | None = None,
        dense_min_m: int | None = None,
    ) -> DeltaMeta:
        """Prefill metadata: segment s has ``seg_lens[s]`` consecutive tokens of slot ``seg_delta[s]``;
        ``max_block_m`` as in ``rows``. A segment of a delta with at least ``dense_min_m`` tokens goes
        to ``dense`` (its delta dequantised once, one matmul) instead of work tiles."""
        return cls._build(Segments.from_lengths(seg_lens, seg_delta, SLOT_NAMES), device, max_block_m, dense_min_m)

    @classmethod
    def rows(cls, row_delta: Sequence[int], device: torch.device | str, max_block_m: int | None = None) -> DeltaMeta:
        """Decode metadata: token t uses slot ``row_delta[t]`` (-1: none), in any order (the rows of one
        slot share work tiles wherever they are). ``max_block_m`` caps the tokens per work tile
        (``cuda_tile_cap``: the CUDA op's 16), cutting a longer run of one slot into several tiles. A cap
        that is not one of the Triton kernels' tile sizes (1, 2, 4, 16, 64; e.g. 8, one CUDA MMA fragment)
        makes metadata only the CUDA op takes."""
        return cls._build(Segments.from_rows(row_delta, SLOT_NAMES), device, max_block_m)

    @classmethod
    def _build(
        cls, seg: Segments, device: torch.device | str, max_block_m: int | None = None, dense_min_m: int | None = None
    ) -> DeltaMeta:
        if dense_min_m is not None and dense_min_m < 1:
            raise ValueError(f"sbmm: dense_min_m {dense_min_m} must be >= 1")
        starts, slots, decode, num_tokens = seg.start, seg.slot, seg.decode, seg.num_tokens
        # Tokens per slot in step order (slots in order of first use); base-only tokens dropped. Long
        # segments go to ``dense``; the rest to work tiles (``by_slot``).
        slot_tokens = tuple((d, tuple(toks)) for d, toks in seg.tokens_by_slot().items())
        by_slot: dict[int, list[int]] = {}
        dense = []
        for s, d in enumerate(slots):
            lo, hi = starts[s], starts[s + 1]
            if d >= 0 and hi > lo:
                if dense_min_m is not None and hi - lo >= dense_min_m:
                    dense.append((lo, hi, d))
                else:
                    by_slot.setdefault(d, []).extend(range(lo, hi))
        dense.sort(key=lambda span: span[2])  # one slot's segments next to each other: one dequantisation
        order = [t for toks in by_slot.values() for t in toks]
        runs, lo = [], 0
        for d, toks in by_slot.items():
            runs.append((lo, lo + len(toks), d))
            lo += len(toks)
        longest = max((len(toks) for toks in by_slot.values()), default=0)
        if longest <= FMA_MAX_M:
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
        seg_start, seg_delta = seg.on_device(device)
        return cls(
            seg_start=seg_start, seg_delta=seg_delta,
            seg_start_host=starts, seg_delta_host=slots, num_tokens=num_tokens,
            slot_tokens=slot_tokens, decode=decode,
            order=torch.tensor(order, dtype=torch.int32, device=device),
            tiles=flat[: 3 * grid_tiles].view(grid_tiles, 3), tile_count=flat[3 * grid_tiles :],
            num_tiles=len(tiles), grid_tiles=grid_tiles, block_m=block_m,
            tile_tokens=max((e - s for s, e, _ in tiles), default=0), dense=tuple(dense),
        )  # fmt: skip
