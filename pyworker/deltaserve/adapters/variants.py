"""The variant seam: the interface every kind of variant pool implements, keyed by kind.

A *variant* is whatever a request runs with besides the base model: a LoRA adapter (``lora_pool.py``)
or a compressed full fine-tune, a *delta* (``delta_pool.py``). Every kind shares the router's adapter
id space and its tier ops (``wire.VariantOp``: ``wire.TierOp`` to_host / to_gpu / drop_gpu / drop_host,
one state machine per id, drawn once in ``router/crates/sched/src/adapters.rs``). The kinds are the
wire's (``wire.VariantKind``, generated from the Rust schema): the router says the kind of every op
and inspection, so the worker never tells a kind from the files. What differs per kind is how a
directory is validated and read, where a GPU copy lives (pages of the KV pool, a delta slot) and what a
step's forward reads. The executor holds one ``VariantPool`` per kind that is on
(``dict[VariantKind, VariantPool]``) and never asks which kind it talks to::

    InspectVariant(path, kind) ──> pools[kind].inspect(path)           (or "kind is off" when absent)
    StepPlan.adapter_ops       ──> plan check: the tier replay over every pool's ``placements()``
                               ──> pools[op.kind].apply(op), in order
    scheduled requests         ──> pool.wait_gpu(their variant ids): copies still running beside the steps
    forward                    ──> pool.begin_step(StepRows) for every pool ... pool.end_step()
    StepOutput                 ──> sum of pool.host_bytes, concat of pool.take_finished() (host_ready)
                                   and of pool.take_gpu_ready() (gpu_ready)

A third kind is one more implementation of ``VariantPool`` plus one entry where the executor builds
its pools, not a branch in each of these places.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .. import wire

VariantKind = wire.VariantKind
"""The kinds of variant (``LORA``, ``DELTA``), as on the wire."""

NOUN = {VariantKind.LORA: "LoRA adapter", VariantKind.DELTA: "delta"}
"""How messages name a variant of each kind."""
WITH_ARTICLE = {VariantKind.LORA: "a LoRA adapter", VariantKind.DELTA: "a delta"}
"""The same with its article ("the id is a delta on this worker")."""
OFF_REASON = {
    VariantKind.LORA: "LoRA is off on this worker (--max-lora-rank 0)",
    VariantKind.DELTA: "delta serving is off on this worker (--max-deltas 0)",
}
"""Why a worker without a pool of that kind refuses its variants (the flag that turned it off)."""


def refused_as_off(kind: VariantKind, path: str | Path) -> wire.VariantInfo:
    """The inspection answer of a worker whose pool of ``kind`` is off."""
    return wire.VariantInfo(error=f"{NOUN[kind]} {path}: {OFF_REASON[kind]}", kind=kind)


@dataclass(frozen=True)
class StepRows:
    """Which variant every row of a forward uses, in ``ForwardBatch`` order (0: the base model).

    Ids of every kind are mixed; each pool picks out the ones it holds on the GPU (the plan check
    made sure each non-zero id is GPU-resident in exactly one pool).
    """

    runs: Sequence[tuple[int, int]]
    """(variant id, tokens) of each scheduled request: scheduled new requests, then running ones."""
    logit_ids: Sequence[int]
    """The variant id of each logits row (the requests that sample, in order)."""
    decode: bool
    """Every run is one token that wants logits (MBGMV / per-row metadata; a CUDA graph may replay)."""

    @property
    def variant_ids(self) -> set[int]:
        """The distinct non-zero variant ids of the step."""
        return {v for v, _ in self.runs if v != 0}


@dataclass(frozen=True)
class VariantCost:
    """What a step whose rows use one GPU-resident variant reads and computes for it
    (``worker/step_floor.py``)."""

    read_bytes: int
    """Device bytes of the variant a step reads once, whatever its rows (LoRA A/B; packed delta linears
    and a dense lm_head delta), less its ``shared`` ones."""
    flops_per_token: int
    """Extra FLOPs per token of its rows (2 × the elements of the low-rank or packed matrices)."""
    shared: Mapping[Hashable, int] = field(default_factory=dict)
    """Bytes the variant reads from blocks other variants may share, by block identity (a delta's
    pieces, ``delta_blocks``): a step reads each block once, whichever of its variants' rows use it."""


class Placements(Protocol):
    """A copy of one pool's GPU placements that a plan's ops are replayed on before anything is
    applied (``worker/plan_check.py``); changing it changes nothing in the pool."""

    def ids(self) -> Collection[int]:
        """Variant ids on the GPU."""
        ...

    def pages(self) -> Mapping[int, int]:
        """KV-pool page -> the variant whose weights it holds (empty for kinds that hold no pages)."""
        ...

    def problem(self, op: wire.VariantOp) -> str | None:
        """Why the ``to_gpu`` ``op`` cannot be placed now (its host copy is known to exist), or None."""
        ...

    def place(self, op: wire.VariantOp) -> None:
        """Records the ``to_gpu`` ``op`` (``problem`` was None)."""
        ...

    def remove(self, variant_id: int) -> None:
        """Records a ``drop_gpu`` of a resident variant."""
        ...


class VariantPool(Protocol):
    """One kind's variants on the worker: host copies, GPU copies, and what a step's forward reads."""

    kind: VariantKind
    """The kind of every variant this pool holds."""

    def inspect(self, path: str | Path) -> wire.VariantInfo:
        """Validates the directory as a variant of this kind for this model and reports its footprint;
        changes nothing and never raises for a bad variant (``error`` says what and where)."""
        ...

    def host_ids(self) -> Collection[int]:
        """Variant ids with a host copy (loaded or loading)."""
        ...

    def placements(self) -> Placements:
        """A copy of the GPU placements, for the plan check's replay."""
        ...

    def step_problem(self, variant_ids: Collection[int]) -> str | None:
        """Why one step cannot use these (GPU-resident) variants of this pool together, or None."""
        ...

    def step_cost(self, variant_id: int) -> VariantCost | None:
        """What a step using the variant reads and computes for it; None when it is not on the GPU."""
        ...

    def apply(self, op: wire.VariantOp) -> None:
        """Executes one tier op the plan check accepted (a failed host read surfaces here, at the
        ``to_gpu`` that needs it, as ``AdapterLoadError``)."""
        ...

    def begin_step(self, rows: StepRows) -> bool:
        """Sets what the forward reads for the rows of this pool's variants; returns whether the step
        has any (False: nothing was set, the modules compute their base alone)."""
        ...

    def end_step(self) -> None:
        """Back to inactive after the forward."""
        ...

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies held (finished reads measured, running ones as expected)."""
        ...

    def take_finished(self) -> list[int]:
        """Ids whose host reads finished since the last call (``StepOutput.host_ready``)."""
        ...

    def wait_gpu(self, variant_ids: Collection[int]) -> None:
        """Makes the step wait for the ``to_gpu`` copies of those of ``variant_ids`` that still run beside
        the steps (a pool whose ``to_gpu`` copies in the step itself has none)."""
        ...

    def take_gpu_ready(self) -> list[int]:
        """Ids whose ``to_gpu`` copies, run beside the steps, finished since the last call
        (``StepOutput.gpu_ready``); a pool that copies in the step itself reports none."""
        ...

    def close(self) -> None:
        """Stops the background readers."""
        ...
