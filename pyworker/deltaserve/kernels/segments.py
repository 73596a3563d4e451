"""A step's tokens grouped by variant slot: the segments both ``LoraMeta`` and ``DeltaMeta`` are built on.

A step of T tokens is cut into S segments of consecutive tokens, each of one variant slot (a LoRA
adapter slot, a delta slot) or of none::

    seg_start [S + 1] int32   token range of segment s is seg_start[s] .. seg_start[s + 1]
    seg_slot  [S] int32       variant slot of segment s, or -1 (base-only tokens)
    prefill: one segment per request chunk     (``Segments.from_lengths``)
    decode:  one token per row, rows of any slot in any order: seg_start = 0, 1, ..., T
             (``Segments.from_rows``)

``Segments`` validates them once on the host (lengths, slot ids >= -1, int32 offsets) and keeps the
host copies, so the references and the launch checks never read the device. The metadata types add
their own tiling on top (``kernels.lora.LoraMeta``: SGMV token tiles; ``kernels.sbmm.DeltaMeta``: work
tiles of one slot's tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotNames:
    """How an op names its slots in errors (``lora``: adapter ids; ``sbmm``: delta slots)."""

    op: str
    """Prefix of every message: the op family (``lora``, ``sbmm``)."""
    slot: str
    """What one slot id is called (``adapter id``, ``delta slot``)."""
    variant: str
    """What a slot holds (``adapter``, ``delta``)."""


@dataclass(frozen=True)
class Segments:
    """One step's segments on the host, validated at construction (module docstring)."""

    start: tuple[int, ...]
    """[S + 1]: segment s covers tokens start[s] .. start[s + 1]; start[0] = 0, start[S] = T."""
    slot: tuple[int, ...]
    """[S]: the variant slot of each segment, -1 for none."""
    decode: bool
    """True: one token per segment (``from_rows``)."""
    names: SlotNames
    """How errors name the slots."""

    def __post_init__(self) -> None:
        bad = [d for d in self.slot if d < -1]
        if bad:
            raise ValueError(
                f"{self.names.op}: {self.names.slot} {bad[0]} out of range "
                f"(slots are >= 0, -1 = no {self.names.variant})"
            )
        if self.start[-1] >= 2**31:
            raise ValueError(f"{self.names.op}: {self.start[-1]} tokens overflow int32 segment offsets")

    @classmethod
    def from_lengths(cls, seg_lens: Sequence[int], seg_slot: Sequence[int], names: SlotNames) -> Segments:
        """Prefill: segment s has ``seg_lens[s]`` consecutive tokens of slot ``seg_slot[s]``."""
        lens, slots = [int(n) for n in seg_lens], [int(d) for d in seg_slot]
        if len(lens) != len(slots):
            raise ValueError(f"{names.op}: {len(lens)} segment lengths but {len(slots)} segment {names.variant}s")
        if any(n < 0 for n in lens):
            raise ValueError(f"{names.op}: negative segment length in {lens}")
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return cls(tuple(starts), tuple(slots), False, names)

    @classmethod
    def from_rows(cls, row_slot: Sequence[int], names: SlotNames) -> Segments:
        """Decode: token t uses slot ``row_slot[t]`` (-1: none), in any order."""
        slots = [int(d) for d in row_slot]
        return cls(tuple(range(len(slots) + 1)), tuple(slots), True, names)

    @property
    def num_tokens(self) -> int:
        """T: the tokens of all segments."""
        return self.start[-1]

    def tokens_by_slot(self) -> dict[int, list[int]]:
        """``tokens_by_slot`` of these segments."""
        return tokens_by_slot(self.start, self.slot)

    def on_device(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(seg_start [S + 1], seg_slot [S]) as int32 tensors on ``device``: what the kernels read."""
        return (
            torch.tensor(self.start, dtype=torch.int32, device=device),
            torch.tensor(self.slot, dtype=torch.int32, device=device),
        )


def tokens_by_slot(seg_start: Sequence[int], seg_slot: Sequence[int]) -> dict[int, list[int]]:
    """Token indices per slot, in step order; slots in order of first use; -1 and empty segments left
    out. Reads host copies (``LoraMeta.seg_start_host``, ...), never the device."""
    groups: dict[int, list[int]] = {}
    for s, d in enumerate(seg_slot):
        lo, hi = seg_start[s], seg_start[s + 1]
        if d >= 0 and hi > lo:
            groups.setdefault(d, []).extend(range(lo, hi))
    return groups
