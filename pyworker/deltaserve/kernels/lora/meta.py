"""Batch metadata of the multi-LoRA kernels (``LoraMeta``): which tokens use which adapter in one step.

Built once per step and reused by every layer and projection, on the step's segments
(``kernels.segments``)::

    SGMV (prefill): tokens grouped into contiguous segments, one adapter per segment
        seg_start [S + 1] int32   token range of segment s is seg_start[s] .. seg_start[s + 1]
        seg_adapter [S] int32     adapter of segment s, or -1
        tiles [n, 2] int32        (segment, first token) of every 16-token tile of a segment with
                                  an adapter: the launch grid (never segments x longest segment)
    MBGMV (decode): one token per row, rows of any adapters in any order
        row_adapter [T] int32     stored as seg_adapter with seg_start = 0, 1, ..., T
    mixed (a prefill chunk next to decodes): the SGMV segments as above, but tiles only for the
        segments of several tokens; the one-token segments with an adapter go to MBGMV as a row list
        rows [R] int32            token row of each MBGMV row
        row_adapter [R] int32     its adapter (-1: a padding entry of a CUDA graph's static list)

A mixed step thus pays the decode step's MBGMV for its decode rows plus SGMV for its chunk, instead
of a whole 16-token SGMV tile per decode row. ``seg_start`` / ``seg_adapter`` still describe every
token (the reference reads them), so a mixed meta and its plain SGMV twin compute the same delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..segments import Segments, SlotNames

SLOT_NAMES = SlotNames(op="lora", slot="adapter id", variant="adapter")
"""How the LoRA ops' segment errors name their slots."""
SGMV_TILE = 16
"""Tokens per SGMV token tile (``sgmv_tiles``): the SGMV kernels' BLOCK_M (tl.dot needs >= 16), and the
metadata builders' share of the launch."""


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
    rows: torch.Tensor | None = None
    """Mixed steps: [R] int32 on the device, the token row of each MBGMV row (the one-token segments
    with an adapter; ``tiles`` then leave them out). None: no MBGMV row list (prefill, decode)."""
    row_adapter: torch.Tensor | None = None
    """Mixed steps: [R] int32 on the device, the adapter slot of each of ``rows`` (-1: padding)."""
    num_rows: int = 0
    """R: entries of ``rows`` (a CUDA graph's static bound; eager steps: exactly the rows)."""

    @property
    def mixed(self) -> bool:
        """Whether one-token segments go to MBGMV over ``rows`` and the rest to SGMV over ``tiles``."""
        return self.rows is not None

    @classmethod
    def sgmv(cls, seg_lens: Sequence[int], seg_adapter: Sequence[int], device: torch.device | str) -> LoraMeta:
        """Prefill metadata: segment s has ``seg_lens[s]`` consecutive tokens of ``seg_adapter[s]``."""
        return cls._build(Segments.from_lengths(seg_lens, seg_adapter, SLOT_NAMES), device)

    @classmethod
    def mbgmv(cls, row_adapter: Sequence[int], device: torch.device | str) -> LoraMeta:
        """Decode metadata: token t uses adapter ``row_adapter[t]`` (-1: none), in any order."""
        return cls._build(Segments.from_rows(row_adapter, SLOT_NAMES), device)

    @classmethod
    def mixed_step(cls, seg_lens: Sequence[int], seg_adapter: Sequence[int], device: torch.device | str) -> LoraMeta:
        """Mixed-step metadata (module docstring): segments as ``sgmv``, the one-token segments with an
        adapter on MBGMV rows, SGMV tiles for the others."""
        seg = Segments.from_lengths(seg_lens, seg_adapter, SLOT_NAMES)
        rows, row_adapter = single_rows(seg.start, seg.slot)
        tiles = sgmv_tiles(seg.start, seg.slot, skip_single=True)
        seg_start, seg_adapter_dev = seg.on_device(device)
        return cls(
            seg_start=seg_start, seg_adapter=seg_adapter_dev,
            seg_start_host=seg.start, seg_adapter_host=seg.slot, num_tokens=seg.num_tokens,
            max_adapter=max(seg.slot, default=-1), decode=False,
            tiles=torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 2), num_tiles=len(tiles) // 2,
            rows=torch.tensor(rows, dtype=torch.int32, device=device),
            row_adapter=torch.tensor(row_adapter, dtype=torch.int32, device=device), num_rows=len(rows),
        )  # fmt: skip

    @classmethod
    def _build(cls, seg: Segments, device: torch.device | str) -> LoraMeta:
        tiles = None if seg.decode else sgmv_tiles(seg.start, seg.slot)
        seg_start, seg_adapter = seg.on_device(device)
        return cls(
            seg_start=seg_start, seg_adapter=seg_adapter,
            seg_start_host=seg.start, seg_adapter_host=seg.slot, num_tokens=seg.num_tokens,
            max_adapter=max(seg.slot, default=-1), decode=seg.decode,
            tiles=None if tiles is None else torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 2),
            num_tiles=0 if tiles is None else len(tiles) // 2,
        )  # fmt: skip


def sgmv_tiles(seg_start: Sequence[int], seg_adapter: Sequence[int], *, skip_single: bool = False) -> list[int]:
    """The SGMV launch's token tiles, flattened ``[seg, first token, seg, first token, ...]``: every
    ``SGMV_TILE`` tokens of every segment with an adapter (segments of base tokens, adapter -1, get
    none; with ``skip_single`` neither do one-token segments, a mixed step's MBGMV rows).
    ``LoraMeta.tiles`` holds them on the device."""
    tiles: list[int] = []
    for seg, adapter in enumerate(seg_adapter):
        if adapter >= 0 and not (skip_single and seg_start[seg + 1] - seg_start[seg] == 1):
            for m0 in range(seg_start[seg], seg_start[seg + 1], SGMV_TILE):
                tiles += (seg, m0)
    return tiles


def single_rows(seg_start: Sequence[int], seg_adapter: Sequence[int]) -> tuple[list[int], list[int]]:
    """A mixed step's MBGMV rows: (token row, adapter) of every one-token segment with an adapter,
    in token order (``LoraMeta.rows`` / ``row_adapter``)."""
    rows: list[int] = []
    adapters: list[int] = []
    for seg, adapter in enumerate(seg_adapter):
        if adapter >= 0 and seg_start[seg + 1] - seg_start[seg] == 1:
            rows.append(seg_start[seg])
            adapters.append(adapter)
    return rows, adapters
