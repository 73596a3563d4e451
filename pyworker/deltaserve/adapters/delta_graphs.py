"""The static device buffers a captured delta decode step reads (``DeltaPool.graph_state``), and the
writes of a step's rows into them before a replay (``DeltaPool.fill_graph_rows``).

Per packed config, one SBMM metadata per piece (``delta_blocks``: ``2 * layer + part``), since the
block slot a row uses may differ by piece (deltas sharing a block use its one slot). So that a replay
costs three host-to-device copies per config whatever the layer count, each config's buffers are flat
and every piece's metadata of a bucket of ``b`` rows (``grid`` work tiles) is a slice of them::

    order   int32 [P * max_batch]       piece p: [p * b, (p + 1) * b)
    tiles   int32 [P * max_batch * 3]   piece p: [p * grid * 3, (p + 1) * grid * 3) viewed [grid, 3]
    count   int32 [P]                   piece p: [p, p + 1)

A graph captured for bucket ``b`` holds views at its own offsets; a replay of that bucket rewrites the
first ``P * b`` / ``P * grid * 3`` / ``P`` entries. The row index (slot + 1 of each row, for the dense
tables), the embedding block slot + 1 of each row and the lm_head delta's tiles (by its block slot)
are one buffer each.

A captured mixed step (``worker/mixed_graphs.py``) reads a second set, made with ``max_logits``: its
"rows" are the bucket's tokens (each token its own row of the SBMM metadata, as a decode row is, so a
prompt's tokens share their delta's work tiles of ``GRAPH_TILE`` tokens), and its logits rows (fewer:
one per sequence that samples) have their own index and lm_head tiles. It may also have a *dense
lane* (``delta_layers.DenseLane``): the delta with the most tokens of a long prompt runs dense, each
linear's delta dequantised once from offsets the replay wrote (``lane_offsets``: per config, one
``[3]`` int64 row per linear, in ``DeltaPool``'s linear order) and one masked matmul over the bucket
(``lane_others``: the rows it zeroes), instead of a work tile per ``GRAPH_TILE`` tokens that each read the delta again.

When a delta takes the lane (``dense_lane_tokens``; Llama-2-7B shape, 4-bit 2:4, fp16, H200,
``bench/README.md``): a work tile costs ~1 ms (~0.061 ms a token: the tile reads the whole delta), the
lane ~3.5 ms (the dequantisations) plus ~0.021 ms a token of the *bucket* (its matmuls run over every
row, masked), so the lane wins from ~57 + 0.34 x bucket tokens of its delta.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ..kernels.sbmm import DeltaMeta
from ..model.batch import copy_from_host
from .delta_layers import ConfigKey, DenseLane

Tiles = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(order, tiles, tile count) int32: a ``DeltaMeta``'s device tensors."""


DENSE_LANE_BASE_TOKENS = 64
"""``dense_lane_tokens``' constant term (module docstring: the lane's fixed cost in a tile's tokens)."""


def dense_lane_tokens(bucket: int, base: int | None = None) -> int:
    """Fewest tokens of one delta that run in the dense lane of a captured step of ``bucket`` tokens
    (module docstring): its fixed cost ``base`` (None: ``DENSE_LANE_BASE_TOKENS``; the simulator
    passes a latency model's), plus a third of the bucket its masked matmuls run over."""
    return (DENSE_LANE_BASE_TOKENS if base is None else base) + bucket // 3


class DeltaGraphRows:
    """The static buffers (module docstring), (re)made for ``max_batch`` rows, configs added as seen."""

    def __init__(
        self,
        device: torch.device,
        num_pieces: int,
        max_batch: int,
        grid: Callable[[int, int], int],
        max_logits: int | None = None,
    ) -> None:
        self.device, self.num_pieces, self.max_batch = device, num_pieces, max_batch
        self.max_logits = max_logits
        """Most logits rows (mixed steps); None: every row is one (decode)."""
        self.grid = grid
        """(rows b, tile cap) -> the work tiles a captured step of ``b`` rows launches."""
        self.index = torch.zeros(max_batch, dtype=torch.int64, device=device)
        """[B] int64: slot + 1 of each row (0: none); the logits index too for decode."""
        self.logit_index = (
            self.index if max_logits is None else torch.zeros(max_logits, dtype=torch.int64, device=device)
        )
        """[L] int64: slot + 1 of each logits row (decode: ``index`` itself)."""
        self.embed_index = torch.zeros(max_batch, dtype=torch.int64, device=device)
        """[B] int64: the block slot + 1 of each row's embedding delta (0: none)."""
        self.metas: dict[ConfigKey, Tiles] = {}
        """Config -> the flat per-piece buffers."""
        logits = max_batch if max_logits is None else max_logits
        self.head: Tiles = self._zeros(logits, logits * 3, 1)
        """The lm_head delta's (order [L], tiles [L * 3], count [1])."""
        self.lane_others = torch.ones(max_batch, 1, dtype=torch.bool, device=device)
        """[B, 1] bool: the rows outside the dense lane (mixed steps)."""
        self.lane_offsets: dict[ConfigKey, torch.Tensor] = {}
        """Config -> [linears, 3] int64: the lane delta's offsets in each linear's pool."""

    def _zeros(self, *sizes: int) -> Tiles:
        a, b, c = (torch.zeros(n, dtype=torch.int32, device=self.device) for n in sizes)
        return a, b, c

    def add_keys(self, keys: Sequence[ConfigKey]) -> None:
        for key in keys:
            if key not in self.metas:
                p, m = self.num_pieces, self.max_batch
                self.metas[key] = self._zeros(p * m, p * m * 3, p)

    def static(self, bufs: Tiles, b: int, cap: int, piece: int = 0) -> DeltaMeta:
        """Piece ``piece``'s metadata of a ``b``-row bucket over ``bufs``, with tiles of ``cap`` tokens."""
        order, tiles, count = bufs
        grid = self.grid(b, cap)
        meta = DeltaMeta.rows([-1] * b, self.device, max_block_m=cap)
        return dataclasses.replace(
            meta,
            order=order[piece * b : (piece + 1) * b],
            tiles=tiles[piece * grid * 3 : (piece + 1) * grid * 3].view(grid, 3),
            tile_count=count[piece : piece + 1],
            grid_tiles=grid,
            block_m=cap,
            tile_tokens=cap,
        )

    def write_index(
        self, b: int, slots: Sequence[int], embed_slots: Sequence[int], logit_slots: Sequence[int] | None = None
    ) -> None:
        """Slot + 1 of ``b`` rows and of their embedding deltas; of the logits rows too where they have
        their own index (``max_logits``)."""
        both = torch.tensor([list(slots), list(embed_slots)], dtype=torch.int64) + 1
        copy_from_host(self.index[:b], both[0])
        copy_from_host(self.embed_index[:b], both[1])
        if logit_slots is not None:
            assert self.max_logits is not None, "decode rows are their own logits rows"
            copy_from_host(self.logit_index[: len(logit_slots)], torch.tensor(list(logit_slots), dtype=torch.int64) + 1)

    def lane(self, b: int, key: ConfigKey, linears: Sequence[tuple[int, str]], scratch: torch.Tensor) -> DenseLane:
        """The dense lane of a ``b``-row bucket whose lane delta is of config ``key``, over the static
        buffers (``linears``: the (layer, proj) of each offsets row)."""
        offsets = self.lane_offsets.get(key)
        if offsets is None:
            offsets = self.lane_offsets[key] = torch.zeros(len(linears), 3, dtype=torch.int64, device=self.device)
        return DenseLane.over(key, self.lane_others[:b], linears, offsets, scratch)

    def write_lane(self, b: int, mask: Sequence[bool], key: ConfigKey | None, offsets: torch.Tensor | None) -> None:
        """The lane's rows among ``b`` (``mask``; all False: no lane) and, with a lane, its delta's offsets
        (``[linears, 3]`` int64 on the host) in config ``key``'s buffer."""
        copy_from_host(self.lane_others[:b, 0], ~torch.tensor(list(mask), dtype=torch.bool))
        if key is not None and offsets is not None:
            copy_from_host(self.lane_offsets[key], offsets)

    def host_tiles(self, rows: Sequence[int], b: int, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order [b], tiles [grid, 3], count [1]) of rows ``rows`` (slot per row), built on the host."""
        meta = DeltaMeta.rows(rows, "cpu", max_block_m=cap)
        grid = self.grid(b, cap)
        assert meta.num_tiles <= grid and meta.tile_count is not None  # real tiles first, padding after
        return meta.order, meta.tiles[:grid], meta.tile_count

    def write_head(self, b: int, rows: Sequence[int], cap: int) -> None:
        order, tiles, count = self.host_tiles(rows, b, cap)
        for buf, host in zip(self.head, (order, tiles.reshape(-1), count)):
            copy_from_host(buf[: host.shape[0]], host)

    def write_pieces(
        self, key: ConfigKey, b: int, cap: int, groups: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> None:
        """Config ``key``'s metadata of every piece: ``groups`` are (piece indices, slot per row) of the
        pieces with rows of that config; every other piece gets none (all padding). One copy per buffer."""
        p = self.num_pieces
        none = self.host_tiles([-1] * b, b, cap)
        order = none[0].repeat(p, 1)
        tiles = none[1].repeat(p, 1, 1)
        count = none[2].repeat(p)
        for pieces, rows in groups:
            o, t, c = self.host_tiles(rows, b, cap)
            at = torch.tensor(list(pieces), dtype=torch.int64)
            order[at], tiles[at], count[at] = o, t, c
        bufs = self.metas[key]
        for buf, host in zip(bufs, (order, tiles, count)):
            flat = host.reshape(-1)
            copy_from_host(buf[: flat.shape[0]], flat)
