"""Speculative execution with surrogate blocks (BlockLLM §5.2) for a cold delta's prefill, exact.

A cold variant today (router and worker as they are): the router sends ``to_host``, ``to_gpu`` and
the request's prefill in one plan when nothing else runs (else it holds the request until the
worker reports the host read, ``StepOutput.host_ready``); the worker's ``to_gpu`` waits for the read
and copies every piece before the forward starts. So the prefill waits for the whole load.

With speculation on, the executor defers such a ``to_gpu`` (one delta per step: the first whose
prefill is in the plan) and runs the step's forward through a ``ColdPrefill`` gate
(``DecoderLM.layer_gate``). The delta's rows start as base rows (the delta is not placed yet):

- layers before the delta's first *own* layer ``k`` (any layer its payload touches) are the
  variant's exactly, and run while the host read goes on (on CUDA the host only queues them);
- at ``k``, if the read has not finished (or in mode ``always``), the base block is the surrogate
  of block ``k`` and the layers after it run on its output, speculatively, up to the next own layer
  or the last layer (rules: never two consecutive speculated blocks, never the last block; a
  speculation whose window would be empty is not started);
- at the window's end the delta *lands* (``DeltaPool.to_gpu``: the read waited for, the pieces
  placed, the step's delta rows made again), block ``k`` runs for real on its saved input, its
  output is compared with the surrogate's on the delta's rows (mean cosine over tokens; BlockLLM's
  acceptance criterion, cosine >= 0.95, is counted), and unless the two are bit-for-bit equal the
  layers after ``k`` in the window run again from the real output, rewriting their KV. So the
  variant's tokens are exactly those of the normal path in every case: speculation only moves work
  earlier (the layers before ``k``, and the window when the real block would have equalled it).

The whole batch is rerun in the window (other rows get the same KV and outputs again: deterministic
kernels on the same inputs); the gate only runs in eager forwards (the executor takes no graph for
that step). A read that fails at landing leaves the delta's rows on the surrogate: the executor
quarantines the delta and drops its requests from the step, as for a failed ``to_gpu``.

Mode (env ``DELTASERVE_BLOCK_SPECULATION``): ``off`` (default), ``on`` (only while the delta's host
read is still running), ``always`` (speculate whatever the read's state: tests and benchmarks).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

from .. import wire
from ..compress.delta_dir import read_manifest
from ..model.decoder import Stream
from .delta_pool import DeltaPool
from .host_tier import AdapterLoadError

log = logging.getLogger("deltaserve.worker")

MODES = ("off", "on", "always")
ENV = "DELTASERVE_BLOCK_SPECULATION"
ACCEPT_COSINE = 0.95
"""BlockLLM's verification: a surrogate's output with cosine >= 0.95 to the real one is accurate."""
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class SpeculationStats:
    """What the gates did since the last ``take_stats``."""

    speculated: int = 0
    """Cold prefills whose forward ran a surrogate block (one per delta per step)."""
    accepted: int = 0
    """Of those, the ones whose real block's output had cosine >= 0.95 with the surrogate's."""
    exact: int = 0
    """Of those, the ones whose real output equalled the surrogate's bit for bit (nothing rerun)."""
    recomputed_layers: int = 0
    """Layers rerun after a speculated block (summed over prefills)."""
    waited: int = 0
    """Landings that waited for a host read still running (the load overlapped the layers before)."""
    cosines: list[float] = field(default_factory=list)
    """The measured cosine of each speculated prefill, in order."""

    def add(self, other: SpeculationStats) -> None:
        """Adds ``other``'s counts (and cosines, after these) to these."""
        self.speculated += other.speculated
        self.accepted += other.accepted
        self.exact += other.exact
        self.recomputed_layers += other.recomputed_layers
        self.waited += other.waited
        self.cosines.extend(other.cosines)


@dataclass(frozen=True)
class GatePlan:
    """Where a delta's gate lands: ``first_own`` (k) and ``land_at`` (the layer before which the delta
    must be placed; ``num_layers`` is the final norm and lm_head)."""

    first_own: int
    land_at: int

    @property
    def speculates(self) -> bool:
        return self.land_at > self.first_own


def gate_plan(own: set[int], num_layers: int) -> GatePlan:
    """The paper's rules over a variant's own layers ``own``: speculate on the first own layer ``k``
    only when it is not the last layer, the layer after it is not own (no two consecutive) and at
    least one layer runs on the surrogate's output before the delta must land (at the next own layer,
    at the last layer at the latest)."""
    k = min(own, default=num_layers)
    if k >= num_layers - 1 or k + 1 in own:
        return GatePlan(k, k)
    land = min([j for j in own if j > k] + [num_layers - 1])
    return GatePlan(k, land if land > k + 1 else k)


def own_layers(manifest: dict, num_layers: int) -> tuple[set[int], bool]:
    """(layers the delta's tensors touch, whether it has an embedding delta) from its manifest; an
    own final norm / lm_head counts as layer ``num_layers``."""
    own: set[int] = set()
    embed = False
    for name in manifest.get("tensors", {}):
        m = _LAYER_RE.match(name)
        if m is not None:
            own.add(int(m.group(1)))
        elif name.startswith("model.embed_tokens."):
            embed = True
        else:
            own.add(num_layers)
    return own, embed


class ColdPrefill:
    """One step's gate for delta ``delta_id`` (module docstring): a ``model.decoder.LayerGate``."""

    def __init__(
        self, pool: DeltaPool, op: wire.VariantOp, plan: GatePlan, always: bool, stats: SpeculationStats
    ) -> None:
        assert op.slot is not None  # the plan check refused a delta's to_gpu without a slot
        self.pool, self.op, self.plan, self.always, self.stats = pool, op, plan, always, stats
        self.delta_id, self.slot = op.adapter_id, op.slot
        self.consulted = False
        """Whether a forward asked the gate (the executor checks that one did)."""
        self.landed = False
        self.failure: AdapterLoadError | None = None
        """Why the delta could not be placed (its rows stayed on the surrogate)."""
        self.end_step = False
        """Whether the pool's step was begun here (the runner began none): ``close`` ends it."""
        self.saved: Stream | None = None
        """Block ``k``'s input while speculating."""
        self.surrogate_out: Stream | None = None
        """Block ``k``'s output computed by its surrogate."""

    def defers(self, op: wire.VariantOp) -> bool:
        """Whether ``op`` is the ``to_gpu`` this gate places itself (the executor skips it)."""
        return op is self.op

    def before(self, layer: int, stream: Stream, run_layer: Callable[[int, Stream], Stream]) -> Stream:
        self.consulted = True
        k, land = self.plan.first_own, self.plan.land_at
        if self.landed or layer < k:
            return stream
        if layer == k and self.saved is None:
            if not self.plan.speculates or (not self.always and self.pool.host.ready(self.delta_id) is not None):
                self._land()
                return stream
            self.saved = stream
            self.stats.speculated += 1
            return stream
        if layer == k + 1:
            self.surrogate_out = stream
        if layer < land:
            return stream
        assert self.saved is not None and self.surrogate_out is not None
        if not self._land():
            return stream  # the surrogate's rows are dropped by the executor
        real = run_layer(k, self.saved)
        rows = self._rows()
        got, spec = (s[0][rows].float() + s[1][rows].float() for s in (real, self.surrogate_out))  # type: ignore[index]
        cosine = float(F.cosine_similarity(got, spec, dim=-1).mean()) if rows.numel() else 1.0
        self.stats.cosines.append(cosine)
        self.stats.accepted += cosine >= ACCEPT_COSINE
        exact = all(torch.equal(a[rows], b[rows]) for a, b in zip(real, self.surrogate_out))  # type: ignore[index]
        log.info(
            "delta %d: speculated on block %d (surrogate: the base's), cosine %.4f to the real output (%s); %s",
            self.delta_id, k, cosine, "accepted" if cosine >= ACCEPT_COSINE else "rejected",
            "bit-equal, nothing rerun" if exact else f"layers {k + 1}-{layer - 1} rerun",
        )  # fmt: skip
        if exact:
            self.stats.exact += 1
            return stream
        for j in range(k + 1, layer):
            real = run_layer(j, real)
        self.stats.recomputed_layers += layer - k - 1
        return real

    def _rows(self) -> torch.Tensor:
        """Token rows of the delta in the step's batch (``ForwardBatch`` order = the runs' order)."""
        rows: list[int] = []
        at = 0
        step_rows = self.pool.step.rows
        for v, n in step_rows.runs if step_rows is not None else []:
            if v == self.delta_id:
                rows.extend(range(at, at + n))
            at += n
        return torch.tensor(rows, dtype=torch.long, device=self.pool.device)

    def _land(self) -> bool:
        """Places the delta (waiting for its read) and begins the step's delta rows again; False when the
        read failed (``failure``)."""
        self.landed = True
        self.stats.waited += self.pool.host.ready(self.delta_id) is None
        was_active = self.pool.step.active
        try:
            self.pool.to_gpu(self.delta_id, self.slot)
        except AdapterLoadError as e:
            self.failure = e
            return False
        if self.pool.step.rows is not None:
            self.pool.begin_step(self.pool.step.rows)
            self.end_step = not was_active
        return True

    def close(self) -> AdapterLoadError | None:
        """After the forward: the pool's step ended if begun here; the failure, if any. A forward that
        never asked the gate is a bug (the delta's rows would have run as base rows)."""
        if self.end_step:
            self.pool.end_step()
        if not self.consulted:
            raise RuntimeError(f"delta {self.delta_id}: the step's forward skipped its speculation gate")
        return self.failure


class BlockSpeculation:
    """The worker's speculation policy (mode, per-delta gate plans) and its counters."""

    def __init__(self, pool: DeltaPool, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"{ENV}={mode!r}: want one of {', '.join(MODES)}")
        self.pool, self.mode = pool, mode
        self.num_layers = pool.config.num_layers
        self.stats = SpeculationStats()
        """What the gates of this step count into (each gate lives within one launch); ``take_stats``
        hands it out and starts a fresh one."""
        self.totals = SpeculationStats()
        """Everything taken so far (benchmarks read it; the wire gets ``take_stats``')."""

    @classmethod
    def from_env(cls, pool: DeltaPool) -> BlockSpeculation | None:
        mode = os.environ.get(ENV, "off")
        speculation = cls(pool, mode)  # validates the mode
        return None if mode == "off" else speculation

    def gate_for(self, plan: wire.StepPlan) -> ColdPrefill | None:
        """The gate of this step: the first delta ``to_gpu`` whose variant's prefill the plan schedules,
        whose host read is still running (mode ``on``) and whose layers allow a gate; None otherwise."""
        prefilling = {n.adapter_id for n in plan.new_requests if n.num_scheduled_tokens > 0}
        reads = {op.adapter_id: Path(op.path) for op in plan.adapter_ops if op.op == wire.TierOp.TO_HOST}
        for op in plan.adapter_ops:
            if op.kind != wire.VariantKind.DELTA or op.op != wire.TierOp.TO_GPU or op.adapter_id not in prefilling:
                continue
            entry = self.pool.host.get(op.adapter_id)
            path = reads.get(op.adapter_id, entry.path if entry is not None else None)  # read in this plan or before
            if path is None or (
                self.mode == "on" and op.adapter_id not in reads and self.pool.host.ready(op.adapter_id)
            ):
                continue
            gate = self._plan(path)
            if gate is not None:
                return ColdPrefill(self.pool, op, gate, self.mode == "always", self.stats)
        return None

    def _plan(self, path: Path) -> GatePlan | None:
        """The gate plan of the delta at ``path`` (its manifest read again: a zoo entry may be replaced);
        None for no gate (an embedding delta: its first block is the embedding; a manifest that cannot
        be read: the load reports what is wrong)."""
        try:
            own, embed = own_layers(read_manifest(path), self.num_layers)
        except (OSError, ValueError, KeyError):
            return None
        return None if embed or not own else gate_plan(own, self.num_layers)

    def take_stats(self) -> SpeculationStats:
        """The counts since the last call (later gates count into a fresh ``stats``)."""
        taken, self.stats = self.stats, SpeculationStats()
        self.totals.add(taken)
        return taken


__all__ = ["ACCEPT_COSINE", "ENV", "MODES", "BlockSpeculation", "ColdPrefill", "GatePlan", "SpeculationStats",
           "gate_plan", "own_layers"]  # fmt: skip
