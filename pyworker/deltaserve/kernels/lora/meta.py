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

    grouped (decode, the ``tiles`` decode path): the decode rows sorted by adapter, as SGMV segments
        over positions of that order (``LoraMeta.groups``, an SGMV meta with ``order``)
        order [T'] int32          token row of each position (rows of adapter -1 left out)
        seg_start / seg_adapter / tiles   as SGMV, over positions: tile rows are order[m0 ..]

A mixed step thus pays the decode step's MBGMV for its decode rows plus SGMV for its chunk, instead
of a whole 16-token SGMV tile per decode row. ``seg_start`` / ``seg_adapter`` still describe every
token (the reference reads them), so a mixed meta and its plain SGMV twin compute the same delta.
"""

from __future__ import annotations

import dataclasses
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
    order: torch.Tensor | None = None
    """SGMV over gathered rows: [T'] int32 on the device, the token row of each position; segments and
    tiles then count positions, and x / out rows are ``order[position]`` (v stays by position). None:
    segments are token rows."""
    groups: LoraMeta | None = None
    """Decode: the same rows grouped by adapter (``adapter_groups``), an SGMV meta with ``order``, run
    by the ``tiles`` decode path (a 16-row tile per adapter group reads the adapter's weights once);
    its ``num_tiles`` may be a CUDA graph's static bound (padding tiles name a group of adapter -1).
    None: MBGMV only."""

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
        """Decode metadata: token t uses adapter ``row_adapter[t]`` (-1: none), in any order; with the
        rows grouped by adapter for the ``tiles`` decode path (``groups``)."""
        meta = cls._build(Segments.from_rows(row_adapter, SLOT_NAMES), device)
        return dataclasses.replace(meta, groups=cls.grouped(row_adapter, device))

    @classmethod
    def grouped(cls, row_adapter: Sequence[int], device: torch.device | str, num_tiles: int | None = None) -> LoraMeta:
        """The ``groups`` meta of decode rows ``row_adapter`` (``adapter_groups``); ``num_tiles``: pad
        the tile list to that many (a CUDA graph's static bound) with tiles of a group of adapter -1."""
        flat = group_buffer(row_adapter, len(row_adapter), num_tiles)
        return grouped_view(torch.tensor(flat, dtype=torch.int32, device=device), row_adapter, num_tiles)

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


def adapter_groups(row_adapter: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Decode rows grouped by adapter (the ``tiles`` decode path): ``(order, starts, adapters)``, the
    rows with an adapter sorted by adapter slot (stable: token order within a group), the first
    position of each group and one past the last (``starts``, G + 1 entries) and each group's slot.
    Rows of adapter -1 are left out."""
    order = sorted((t for t, a in enumerate(row_adapter) if a >= 0), key=lambda t: row_adapter[t])
    starts: list[int] = [0]
    adapters: list[int] = []
    for i, t in enumerate(order):
        if not adapters or row_adapter[t] != adapters[-1]:
            if adapters:
                starts.append(i)
            adapters.append(row_adapter[t])
    if adapters:
        starts.append(len(order))
    return order, starts, adapters


def group_tile_bound(rows: int, slots: int) -> int:
    """Most ``SGMV_TILE``-row tiles ``rows`` decode rows over at most ``slots`` adapters make: a
    partial tile at most per adapter (a CUDA graph's static tile list)."""
    return min(rows, slots + rows // SGMV_TILE)


def group_buffer(row_adapter: Sequence[int], rows: int, num_tiles: int | None) -> list[int]:
    """``adapter_groups`` of ``row_adapter`` as one int32 list laid out for ``grouped_view``, sized for
    ``rows`` rows (``len(row_adapter) <= rows``) and ``num_tiles`` tiles (None: exactly the real ones):

        order [rows] | starts [rows + 2] | adapters [rows + 1] | tiles [num_tiles, 2]

    Past the real groups comes one group of adapter -1 (empty), which padding tiles name; unused
    order entries are 0. Raises ValueError if the real tiles pass ``num_tiles``."""
    order, starts, adapters = adapter_groups(row_adapter)
    tiles = sgmv_tiles(starts, adapters)
    real = len(tiles) // 2
    n = real if num_tiles is None else num_tiles
    if real > n:
        raise ValueError(f"adapter groups: {real} tiles exceed the static bound of {n}")
    g = len(adapters)
    end = starts[-1] if adapters else 0
    starts = starts + [end] * (rows + 2 - len(starts))
    adapters = adapters + [-1] * (rows + 1 - g)
    tiles = tiles + [g, end] * (n - real)
    return order + [0] * (rows - len(order)) + starts + adapters + tiles


def grouped_view(
    buf: torch.Tensor, row_adapter: Sequence[int] | None, num_tiles: int | None, rows: int | None = None
) -> LoraMeta:
    """The ``groups`` meta over ``buf`` (``group_buffer``'s layout, on the device) for ``rows`` rows
    (default ``len(row_adapter)``). Host fields: from ``row_adapter`` where given (eager steps: exact
    tiles); a CUDA graph's capture passes None (its tiles are the static bound, filled before replays)."""
    if rows is None:
        assert row_adapter is not None
        rows = len(row_adapter)
    order, starts, adapters = adapter_groups(row_adapter) if row_adapter is not None else ([], [0], [])
    n = len(sgmv_tiles(starts, adapters)) // 2 if num_tiles is None else num_tiles
    o, s, a = rows, rows + 2, rows + 1
    return LoraMeta(
        seg_start=buf[o : o + s], seg_adapter=buf[o + s : o + s + a],
        seg_start_host=tuple(starts), seg_adapter_host=tuple(adapters), num_tokens=rows,
        max_adapter=max(adapters, default=-1), decode=False,
        tiles=buf[o + s + a : o + s + a + 2 * n].view(n, 2), num_tiles=n, order=buf[:o],
    )  # fmt: skip
