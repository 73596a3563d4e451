"""The delta pool's slots as the plan check sees them (``variants.Placements``): which delta holds
which of the ``--max-deltas`` slots, and why a ``to_gpu`` cannot take the one it names."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from .. import wire

if TYPE_CHECKING:
    from .delta_pool import DeltaPool


class DeltaPlacements:
    """A copy of the delta pool's slots for the plan check (``variants.Placements``)."""

    def __init__(self, pool: DeltaPool) -> None:
        self.max_deltas = pool.max_deltas
        self.slot_of = dict(pool.slot_of)

    def ids(self) -> Collection[int]:
        return self.slot_of.keys()

    def pages(self) -> Mapping[int, int]:
        return {}

    def problem(self, op: wire.VariantOp) -> str | None:
        """Why ``op.slot`` cannot take the delta: no slot named, pages named, all slots or that one taken."""
        if op.block_ids:
            return "a delta takes a delta slot, not pool pages: block_ids must be empty"
        if len(self.slot_of) >= self.max_deltas:
            return f"all {self.max_deltas} delta slots (--max-deltas) are taken"
        if op.slot is None or not 0 <= op.slot < self.max_deltas:
            return f"slot {op.slot} is not one of the {self.max_deltas} delta slots (--max-deltas)"
        holder = next((d for d, s in self.slot_of.items() if s == op.slot), None)
        if holder is not None:
            return f"delta slot {op.slot} holds delta {holder}"
        return None

    def place(self, op: wire.VariantOp) -> None:
        assert op.slot is not None  # problem() refused a to_gpu without one
        self.slot_of[op.adapter_id] = op.slot

    def remove(self, variant_id: int) -> None:
        del self.slot_of[variant_id]
