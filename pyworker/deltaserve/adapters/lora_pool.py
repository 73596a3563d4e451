"""The LoRA pool: LoRA adapters' tiers on the worker (host memory, pages of the KV pool) and the
per-step adapter tables the LoRA kernels read. The ``VariantPool`` of kind ``lora`` (``variants.py``).

The router decides where every adapter lives (S-LoRA's unified paging, ``sched`` crate); this
module executes its ``VariantOp``s for LoRA ids and answers ``InspectVariant`` for PEFT directories.
An adapter's rows live in pages of the one GPU pool, the KV cache (``lora_layout.py`` draws where).

Tiers: the state machine is the router's, drawn in ``router/crates/sched/src/adapters.rs``; here a
host copy is first *pending* (read in the background), then ready or failed, and ``to_gpu`` waits
for it. ``drop_gpu`` forgets the placement (the pages are the router's again, maybe KV this very
step); ``drop_host`` frees the host copy (a GPU placement stays valid without it).

``to_host`` packs the host copy in a background thread (the host tier's loaders), so prefetching
overlaps steps. It follows the read plan ``inspect`` made at registration (``ReadPlan``: config,
header, layout, copies), so a load runs almost no Python, and the packing is one native read
(``LoraSpec.read_into``: no GIL, every tensor's name, shape and dtype checked against the plan and
its values checked finite in the pool's dtype); the thread launching steps is not slowed. On
CUDA the copy goes into memory pinned once at start-up (``PinnedArena``, ``--host-arena-bytes``):
pinning memory per read stalled every copy and launch of the steps meanwhile. The
worker reports each finished read with its next ``StepOutput`` (``host_ready``), so the router
admits a request only once its adapter can be placed without waiting. ``to_gpu`` waits for the
read (a step that admitted one into an idle worker). A load that fails (the directory vanished or
changed since ``inspect``) is raised by ``to_gpu`` as ``AdapterLoadError`` before anything is
placed: the executor quarantines that adapter (``worker/quarantine.py``), fails only its requests
and serves on.

Per-step tables (static: allocated once, filled in place, so captured CUDA graphs stay valid)::

    a_off, b_off [n_slices, max_slots, r_max] int64    element offsets of rank rows, shared by all layers
    rank         [L, n_slices, max_slots]     int32    0 = slot unused / slice not adapted in that layer
    scale        [L, n_slices, max_slots]     float32
    one kernels.lora.LoraWeights(check=False) per (layer, slice) over these tables and the layer's flat view;
        the slices of one module (qkv, gate_up) are consecutive rows of the tables (linear_slots order), so
        ``attach_lora`` stacks them into one ``LoraStack`` view per (layer, module): two launches per module
    seg_start [max_tokens + 1], seg_adapter [max_tokens], seg_tiles [max_tokens, 2] int32: the step's LoraMeta
    seg_rows [2, max_tokens] int32: a mixed step's MBGMV row list (token rows, their slots)

``begin_segments(segments, decode)`` maps the step's adapters to slots (sticky: an adapter keeps its
slot while it stays on the GPU, so steady decode rewrites no table; a new one takes a free slot or
one whose adapter this step does not use), fills the metadata and sets ``step.meta`` (MBGMV, one
row per token, for decode steps; SGMV, one segment per run, otherwise; a step of several-token runs
next to one-token runs with adapters is mixed: its one-token runs are MBGMV rows, ``LoraMeta.mixed_step``);
``end_step`` clears it.
A step without adapter tokens sets nothing: every adapted linear is then its base alone.
``begin_step(rows)`` is the same for a step's ``StepRows`` (rows of other kinds count as base).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import torch

from .. import wire
from ..kernels.lora import LoraMeta, LoraWeights, sgmv_tiles, single_rows
from ..kernels.region_copy import copy_regions
from ..model.arch import ModelConfig
from ..model.batch import copy_from_host, host_to_device
from ..model.decoder import linear_slots
from ..model.kv_cache import PagedKVCache
from .host_tier import AdapterLoadError, HostTier
from .lora import LoraAdapterError, LoraSpec, TensorCopy, projection_features, read_lora_spec
from .lora_layers import LoraStep
from .lora_layout import AdapterLayout, GpuEntry, HostCopy, PlacementTables, ReadPlan, SliceRows, offset_align
from .pinned_arena import PinnedArena, give_back, host_buffer, release_hook
from .variants import StepRows, VariantCost, VariantKind

log = logging.getLogger("deltaserve.worker")

PLANS_KEPT = 8192
"""Read plans ``LoraPool`` keeps (one per inspected adapter path; a few tens of KB each)."""


class LoraPlacements:
    """A copy of the LoRA pool's placements for the plan check (``variants.Placements``): which adapters
    hold which pages of the pool, and the rules a ``to_gpu``'s pages must follow."""

    def __init__(self, pool: LoraPool) -> None:
        self.pool = pool
        self.gpu = set(pool.gpu)
        self.page_owner = dict(pool.page_owner)

    def ids(self) -> Collection[int]:
        return self.gpu

    def pages(self) -> Mapping[int, int]:
        return self.page_owner

    def problem(self, op: wire.VariantOp) -> str | None:
        """Why ``op.block_ids`` cannot hold the adapter: outside the router's pool, repeated, held by
        another adapter, or not as many as its finished host copy needs."""
        blocks, num_blocks = list(op.block_ids), self.pool.router_blocks
        if not blocks:
            return "no block ids"
        outside = [b for b in blocks if not 0 <= b < num_blocks]
        repeated = sorted({b for b in blocks if blocks.count(b) > 1})
        taken = [b for b in blocks if b in self.page_owner]
        need = self.pool.num_blocks_of(op.adapter_id)
        if outside:
            return f"block ids {outside[:4]} outside the pool of {num_blocks} blocks"
        if repeated:
            return f"block ids {repeated[:4]} repeated"
        if taken:
            return f"block ids {taken[:4]} hold adapter {self.page_owner[taken[0]]}"
        if need is not None and need != len(blocks):
            return f"{len(blocks)} block ids, the adapter needs {need}"
        return None

    def place(self, op: wire.VariantOp) -> None:
        self.gpu.add(op.adapter_id)
        self.page_owner.update((b, op.adapter_id) for b in op.block_ids)

    def remove(self, variant_id: int) -> None:
        self.gpu.discard(variant_id)
        self.page_owner = {b: a for b, a in self.page_owner.items() if a != variant_id}


class LoraPool:
    """LoRA adapters in host memory and in KV-pool pages, plus the step tables the kernels read."""

    kind = VariantKind.LORA

    def __init__(
        self,
        cfg: ModelConfig,
        kv: PagedKVCache,
        *,
        max_lora_rank: int,
        max_loras_per_step: int,
        max_tokens: int,
        arena: PinnedArena | None = None,
        router_blocks: int | None = None,
    ) -> None:
        if max_lora_rank < 1:
            raise ValueError(f"LoraPool: max_lora_rank {max_lora_rank} must be >= 1")
        if max_loras_per_step < 1:
            raise ValueError(f"LoraPool: max_loras_per_step {max_loras_per_step} must be >= 1")
        self.config = cfg
        """The base model the adapters are validated against."""
        self.kv = kv
        """The one GPU pool: adapter rows live in its pages."""
        self.router_blocks = kv.num_blocks if router_blocks is None else router_blocks
        """Pages of the pool the router allocates (all of them, less the CUDA graphs' scratch page)."""
        self.dtype = kv.dtype
        """dtype of the pool, the host copies and the model."""
        self.device = kv.device
        """Where the pool and the tables live."""
        self.max_lora_rank = max_lora_rank
        """r_max of the tables (``--max-lora-rank``); adapters of a higher rank are refused."""
        self.max_slots = max_loras_per_step
        """Adapters one step may use (``--max-loras-per-step``)."""
        self.order = tuple(linear_slots(cfg))
        """Projection names in ``linear_slots`` order: the slice index of the tables."""
        self.features = projection_features(cfg)
        """Projection -> (in_features, out_features)."""
        self.region_elems = kv.block_size * kv.num_kv_heads * kv.head_dim
        """S: elements of one page half in one layer."""
        self.flat = kv.kv.view(kv.num_layers, -1)
        """[L, 2 * NB * S]: every layer's flat view (row l is ``kv.kv[l].view(-1)``)."""
        self.offset_align = offset_align(
            [self.region_elems, *(d for f in self.features.values() for d in f)], kv.kv.element_size()
        )
        """What every offset is a multiple of (lets the kernels use vector loads)."""
        L, n = cfg.num_layers, len(self.order)
        dev = self.device
        self.a_off = torch.zeros(n, self.max_slots, max_lora_rank, dtype=torch.int64, device=dev)
        """[n_slices, max_slots, r_max] static: A row offsets of each slot's adapter."""
        self.b_off = torch.zeros(n, self.max_slots, max_lora_rank, dtype=torch.int64, device=dev)
        """[n_slices, max_slots, r_max] static: B^T row offsets of each slot's adapter."""
        self.rank = torch.zeros(L, n, self.max_slots, dtype=torch.int32, device=dev)
        """[L, n_slices, max_slots] static: each slot's rank per layer and slice."""
        self.scale = torch.zeros(L, n, self.max_slots, dtype=torch.float32, device=dev)
        """[L, n_slices, max_slots] static: each slot's scaling per layer and slice."""
        self.weights: dict[tuple[int, str], LoraWeights] = {
            (layer, proj): LoraWeights(
                a_pool=self.flat[layer], b_pool=self.flat[layer],
                a_offsets=self.a_off[i], b_offsets=self.b_off[i],
                rank=self.rank[layer, i], scale=self.scale[layer, i],
                in_dim=self.features[proj][0], out_dim=self.features[proj][1],
                check=False, offset_align=self.offset_align,
            )
            for layer in range(L) for i, proj in enumerate(self.order)
        }  # fmt: skip
        """(layer, projection) -> the kernels' weights over the static tables, built once. The
        projections of one module are views a uniform stride apart in every table, which
        ``LoraStack.from_slices`` (``attach_lora``) turns into one stacked view per module."""
        self.max_tokens = max(1, max_tokens)
        """Capacity of the static metadata buffers (grown if a step has more tokens)."""
        self.seg_start = torch.zeros(self.max_tokens + 1, dtype=torch.int32, device=dev)
        """Static ``LoraMeta.seg_start`` buffer."""
        self.seg_adapter = torch.zeros(self.max_tokens, dtype=torch.int32, device=dev)
        """Static ``LoraMeta.seg_adapter`` buffer."""
        self.seg_tiles = torch.zeros(self.max_tokens, 2, dtype=torch.int32, device=dev)
        """Static ``LoraMeta.tiles`` buffer (a tile holds at least one token, so at most one per token)."""
        self.seg_rows = torch.zeros(2, self.max_tokens, dtype=torch.int32, device=dev)
        """Static ``LoraMeta.rows`` / ``row_adapter`` buffer of mixed steps."""
        self.step = LoraStep()
        """What the adapted linears read: the current step's LoraMeta, None when inactive."""
        self._upload_buf: torch.Tensor | None = None
        """Device buffer adapter uploads go through (``_upload``)."""
        self.plans: OrderedDict[str, ReadPlan] = OrderedDict()
        """Adapter path -> how to read it, as its last ``inspect`` found (at most ``PLANS_KEPT``, least
        recently used dropped): ``to_host`` reuses it instead of parsing the config and header again."""
        self.arena = arena
        """Host memory the host copies are carved from (pinned at start-up on CUDA, shared with the delta
        pool; ``pinned_arena.py``), or None: each copy is allocated (and pinned on CUDA) on its own."""
        self.host: HostTier[HostCopy] = HostTier("adapter", release=release_hook(arena, dev, lambda c: c.packed))
        """Adapter id -> its host copy (or the load producing it), loaded in background threads."""
        self.gpu: dict[int, GpuEntry] = {}
        """Adapter id -> its placement on pages."""
        self.costs: dict[int, VariantCost] = {}
        """Adapter id -> what a step using it reads and computes (set when placed)."""
        self.page_owner: dict[int, int] = {}
        """Page id -> the GPU-resident adapter holding it."""
        self.slot_of: dict[int, int] = {}
        """Adapter id -> the table slot currently filled with its rows (sticky across steps)."""
        self.slot_adapter: list[int] = [0] * self.max_slots
        """Slot -> the adapter id it holds (0 = free)."""

    # ------------------------------------------------------------------ inspect / validation

    def _load(self, path: Path) -> tuple[LoraSpec, AdapterLayout]:
        """Validates ``path`` (config and header) as an adapter of this model that fits the pool;
        raises LoraAdapterError. The values are checked as ``_copies`` are read."""
        spec = read_lora_spec(path, self.config)
        if spec.max_rank > self.max_lora_rank:
            (layer, proj), worst = max(spec.sites.items(), key=lambda kv: kv[1].rank)
            raise spec.fail(
                f"rank {spec.max_rank} (layer {layer} {proj}) exceeds this worker's --max-lora-rank "
                f"{self.max_lora_rank}"
            )
        ranks: dict[str, int] = {}
        for (_, proj), site in spec.sites.items():
            ranks[proj] = max(ranks.get(proj, 0), site.rank)
        try:
            layout = AdapterLayout.plan(ranks, self.features, self.order, self.region_elems)
        except ValueError as e:
            raise spec.fail(f"does not fit the pool's pages: {e}") from None
        return spec, layout

    def _copies(self, spec: LoraSpec, layout: AdapterLayout) -> list[TensorCopy]:
        """The reads that fill a host copy ``[L, packed_elems]``: in every layer, each slice's A rows
        then its B^T rows (the layout's order; module docstring)."""
        copies: list[TensorCopy] = []
        for s in layout.slices:
            for layer in range(self.config.num_layers):
                site = spec.sites.get((layer, s.proj))
                if site is None:
                    continue
                start = layer * layout.packed_elems + s.packed_start
                copies.append((site.a_key, site.rank, s.in_dim, start, False))
                copies.append((site.b_key, s.out_dim, site.rank, start + s.rank * s.in_dim, True))
        return copies

    def _plan(self, path: Path) -> ReadPlan:
        """``_load`` plus the copies and the per-layer rank and scale tables of a host copy."""
        spec, layout = self._load(path)
        L, n = self.config.num_layers, len(self.order)
        rank = torch.zeros(L, n, dtype=torch.int32)
        scale = torch.zeros(L, n, dtype=torch.float32)
        for (layer, proj), site in spec.sites.items():
            index = self.order.index(proj)
            rank[layer, index] = site.rank
            scale[layer, index] = site.scaling
        return ReadPlan(
            spec,
            layout,
            self._copies(spec, layout),
            rank,
            scale,
            self._host_bytes(layout),
            PlacementTables.of(layout, n, self.max_lora_rank),
        )

    def inspect(self, path: str | Path) -> wire.VariantInfo:
        """Validates the adapter at ``path`` and reports its footprint; changes no state, never raises
        for a bad adapter (``error`` says what and where instead). Keeps its read plan for ``to_host``."""
        try:
            plan = self._plan(Path(path))
            plan.spec.read_into(plan.copies, None, self.dtype)  # values: finite, also in our dtype
        except (LoraAdapterError, OSError, ValueError, RuntimeError) as e:
            return wire.VariantInfo(error=str(e) or type(e).__name__)
        spec, layout, host_bytes = plan.spec, plan.layout, plan.host_bytes
        self.plans[str(path)] = plan
        self.plans.move_to_end(str(path))
        while len(self.plans) > PLANS_KEPT:
            self.plans.popitem(last=False)
        return wire.VariantInfo(
            error=None,
            num_blocks=layout.num_blocks,
            host_bytes=host_bytes,
            max_rank=spec.max_rank,
            target_modules=[s.proj for s in layout.slices],
            kind=self.kind,
            summary=f"rank {spec.max_rank}",
        )

    def num_blocks_of(self, adapter_id: int) -> int | None:
        """Pages ``adapter_id``'s host copy needs, when its load has finished well (else None)."""
        copy = self.host.ready(adapter_id)
        return None if copy is None else copy.layout.num_blocks

    # ------------------------------------------------------------------ host tier

    def _expected_bytes(self, path: Path) -> int:
        """Bytes of the packed copy: what ``inspect`` found, else from the config and header (0 when
        they cannot be read: the load itself reports the real problem)."""
        known = self.plans.get(str(path))
        if known is not None:
            return known.host_bytes
        try:
            return self._host_bytes(self._load(path)[1])
        except (LoraAdapterError, OSError, ValueError):
            return 0

    def _host_bytes(self, layout: AdapterLayout) -> int:
        """Bytes of a host copy of ``layout`` (``[L, packed_elems]`` in the pool's dtype)."""
        return self.config.num_layers * layout.packed_elems * self.kv.kv.element_size()

    def _read_host_copy(self, path: Path) -> HostCopy:
        """The background half of ``to_host``: read and pack the tensors into the host copy (pinned on
        CUDA) in one GIL-free native call, so loads streaming in do not slow the thread that launches
        the steps. The plan (config, header, layout) is the one ``inspect`` made at registration,
        so a load runs almost no Python (parsing them again held the GIL for milliseconds per load);
        the native read still checks every tensor's name, shape, dtype and values against it, so a
        directory whose weights changed since is refused (its ``to_gpu`` fails). A changed config
        with the same tensors is served as registered."""
        plan = self.plans.get(str(path)) or self._plan(path)
        layout = plan.layout
        packed = self._host_buffer(layout)
        try:
            plan.spec.read_into(plan.copies, packed, self.dtype)
        except BaseException:
            give_back(self.arena, packed, may_be_queued=False, device=self.device)
            raise
        return HostCopy(
            layout,
            packed,
            plan.rank.clone(),
            plan.scale.clone(),
            plan.spec.max_rank,
            tuple(s.proj for s in layout.slices),
            plan.tables,
        )

    def _host_buffer(self, layout: AdapterLayout) -> torch.Tensor:
        """A zeroed ``[L, packed_elems]`` host copy: from the arena when it has room, else allocated (and
        pinned on CUDA: page-locked from the start, so copies to the pool are fast and asynchronous).
        Zeros: the rows past a layer's smaller rank (rank_pattern) are never read, but stay defined."""
        raw = host_buffer(self.arena, self._host_bytes(layout), pin=self.device.type == "cuda", what="adapter")
        return raw.view(self.dtype).view(self.config.num_layers, layout.packed_elems).zero_()

    def to_host(self, adapter_id: int, path: str | Path) -> None:
        """Starts reading ``path`` into host memory in the background (``to_gpu`` waits for it)."""
        p = Path(path)
        self.host.load(adapter_id, p, self._read_host_copy, self._expected_bytes(p))

    def drop_host(self, adapter_id: int) -> None:
        """Frees the host copy (a load still running finishes, and its result is dropped)."""
        self.host.drop(adapter_id)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies held: finished ones measured, running loads as expected."""
        return self.host.nbytes

    def host_ids(self) -> Collection[int]:
        return self.host

    def take_finished(self) -> list[int]:
        return self.host.take_finished()

    def wait_gpu(self, variant_ids: Collection[int]) -> None:
        """Nothing: an adapter's ``to_gpu`` copies its pages in the step that carries it."""

    def take_gpu_ready(self) -> list[int]:
        """None: an adapter's ``to_gpu`` copies in its step (the router does not wait for a report)."""
        return []

    def wait_host(self, adapter_id: int) -> HostCopy:
        """The host copy, after its load finishes; AdapterLoadError if the load failed."""
        return self.host.wait(adapter_id)

    # ------------------------------------------------------------------ GPU tier

    def to_gpu(self, adapter_id: int, block_ids: Sequence[int]) -> None:
        """Writes the host copy into pages ``block_ids`` of every layer and records the offsets.

        Waits for the host load. Raises AdapterLoadError (load failed, or the pages are too few
        for it: both fatal for the worker) and ValueError when the adapter is already placed.
        """
        if adapter_id in self.gpu:
            raise ValueError(f"adapter {adapter_id} is already on the GPU")
        copy = self.wait_host(adapter_id)
        layout = copy.layout
        pages = tuple(int(b) for b in block_ids)
        if len(pages) != layout.num_blocks:
            raise AdapterLoadError(
                f"adapter {adapter_id}: to_gpu got {len(pages)} pages, its layout needs {layout.num_blocks}"
            )
        S, NB, t = self.region_elems, self.kv.num_blocks, copy.tables
        # Region k of the adapter is the K (even k) or V (odd k) half of page pages[k // 2]; index -1
        # (rows past a slice's rank) reads the trailing 0.
        page_of = torch.tensor(pages, dtype=torch.int64).repeat_interleave(2)[: layout.num_regions]
        region_base = torch.zeros(layout.num_regions + 1, dtype=torch.int64)
        region_base[:-1] = ((torch.arange(layout.num_regions) % 2) * NB + page_of) * S
        table = torch.stack((t.region_src, region_base[:-1], t.region_used), 1)
        dev = self.device  # pinned, asynchronous copies: placing an adapter never waits for a running step
        copy_regions(self._upload(copy.packed), self.flat, table, table_dev=host_to_device(table, dev))
        offsets = host_to_device(region_base[t.row_region] + t.row_inner, dev)  # [2, n_slices, r_max]
        self.gpu[adapter_id] = GpuEntry(
            pages,
            offsets[0],
            offsets[1],
            host_to_device(copy.rank, dev),
            host_to_device(copy.scale, dev),
        )
        for p in pages:
            self.page_owner[p] = adapter_id
        self.costs[adapter_id] = VariantCost(copy.packed.nbytes, 2 * copy.packed.numel())  # A/B rows, padding aside
        log.debug(
            "adapter %d placed on %d pages (%d bytes per layer)",
            adapter_id,
            len(pages),
            layout.packed_elems * self.kv.kv.element_size(),
        )

    def _upload(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed`` (pinned) on the device, in a buffer kept for the next adapter's upload (grown
        to the largest adapter seen), so placing an adapter allocates no device memory: a new
        100+ MB allocation per placement can make the caching allocator free and re-map memory
        (device-synchronising) while steps are queued. Reusing it is safe: the next upload is
        queued on the same stream after this one's page copies."""
        if self.device.type == "cpu":
            return packed
        n = packed.numel()
        if self._upload_buf is None or self._upload_buf.numel() < n:
            self._upload_buf = None  # let the old one go first
            self._upload_buf = torch.empty(n, dtype=packed.dtype, device=self.device)
        dst = self._upload_buf[:n].view(packed.shape)
        dst.copy_(packed, non_blocking=True)
        return dst

    def drop_gpu(self, adapter_id: int) -> None:
        """Forgets the placement (its pages are the router's again) and frees its step slot."""
        entry = self.gpu.pop(adapter_id)
        self.costs.pop(adapter_id, None)
        for p in entry.block_ids:
            self.page_owner.pop(p, None)
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self.slot_adapter[slot] = 0

    def step_cost(self, variant_id: int) -> VariantCost | None:
        """What a step reads and computes for the placed adapter (its A/B rows; ``worker/step_floor.py``)."""
        return self.costs.get(variant_id)

    def placements(self) -> LoraPlacements:
        return LoraPlacements(self)

    def apply(self, op: wire.VariantOp) -> None:
        """Executes one (already validated) op."""
        move = wire.TierOp(op.op)
        if move is wire.TierOp.TO_HOST:
            self.to_host(op.adapter_id, op.path)
        elif move is wire.TierOp.TO_GPU:
            self.to_gpu(op.adapter_id, op.block_ids)
        elif move is wire.TierOp.DROP_GPU:
            self.drop_gpu(op.adapter_id)
        else:
            self.drop_host(op.adapter_id)

    # ------------------------------------------------------------------ steps

    def _assign_slots(self, adapter_ids: Sequence[int]) -> dict[int, int]:
        """Slots for the step's distinct adapters: kept if held, else a free or unused-this-step one."""
        wanted = set(adapter_ids)
        if len(wanted) > self.max_slots:
            raise ValueError(f"{len(wanted)} adapters in one step exceed --max-loras-per-step {self.max_slots}")
        missing = [a for a in adapter_ids if a not in self.gpu]
        if missing:
            raise ValueError(f"adapters {sorted(set(missing))} are not on the GPU")
        free = [s for s in range(self.max_slots) if self.slot_adapter[s] not in wanted]
        free.sort(key=lambda s: self.slot_adapter[s] != 0)  # empty slots first
        it = iter(free)
        for a in dict.fromkeys(adapter_ids):
            if a in self.slot_of:
                continue
            s = next(it)
            old = self.slot_adapter[s]
            if old:
                del self.slot_of[old]
            self.slot_adapter[s], self.slot_of[a] = a, s
            g = self.gpu[a]
            self.a_off[:, s].copy_(g.a_off)
            self.b_off[:, s].copy_(g.b_off)
            self.rank[:, :, s].copy_(g.rank)
            self.scale[:, :, s].copy_(g.scale)
        return {a: self.slot_of[a] for a in wanted}

    def assign_rows(self, row_adapters: Sequence[int]) -> list[int]:
        """For a decode step replayed from a CUDA graph: fills the table slots of the rows' adapters
        and returns each row's slot (-1 for base rows). The graph's static metadata takes it from
        there (``DecodeGraphs.run``). Raises ValueError like ``begin_segments``."""
        adapters = [a for a in row_adapters if a != 0]
        slot = self._assign_slots(adapters) if adapters else {}
        return [slot[a] if a != 0 else -1 for a in row_adapters]

    def step_problem(self, variant_ids: Collection[int]) -> str | None:
        if len(variant_ids) > self.max_slots:
            return f"{len(variant_ids)} distinct adapters in one step exceed --max-loras-per-step {self.max_slots}"
        return None

    def begin_step(self, rows: StepRows) -> bool:
        """``begin_segments`` over the step's rows; rows of variants not on this pool's GPU count as base."""
        gpu = self.gpu
        return self.begin_segments([(v if v in gpu else 0, n) for v, n in rows.runs], rows.decode)

    def begin_segments(self, segments: Sequence[tuple[int, int]], decode: bool) -> bool:
        """Sets the step's adapter metadata from its token runs ``(adapter_id, n_tokens)`` (0 = base),
        in batch order; returns whether the step has adapter tokens (False: nothing was set).

        ``decode``: every run is one token (MBGMV metadata); else one SGMV segment per run, and if some
        one-token runs have adapters (decodes next to a chunk) those go to MBGMV (a mixed meta).
        Raises ValueError for an adapter not on the GPU (the executor validates first).
        """
        adapters = [a for a, n in segments if a != 0 and n > 0]
        if not adapters:
            self.step.meta = None
            return False
        slot = self._assign_slots(adapters)
        runs = [(slot[a] if a != 0 else -1, n) for a, n in segments if n > 0]
        if decode:
            if any(n != 1 for _, n in runs):
                raise ValueError("begin_segments: a decode step has one token per run")
            starts = list(range(len(runs) + 1))
        else:
            starts = [0]
            for _, n in runs:
                starts.append(starts[-1] + n)
        seg_adapter = [s for s, _ in runs]
        total = starts[-1]
        if total > self.max_tokens:  # grow the static buffers (graph steps never get here)
            self.max_tokens = total
            self.seg_start = torch.zeros(total + 1, dtype=torch.int32, device=self.device)
            self.seg_adapter = torch.zeros(total, dtype=torch.int32, device=self.device)
            self.seg_tiles = torch.zeros(total, 2, dtype=torch.int32, device=self.device)
            self.seg_rows = torch.zeros(2, total, dtype=torch.int32, device=self.device)
        S = len(seg_adapter)
        rows, row_slots = ([], []) if decode else single_rows(starts, seg_adapter)
        mixed = bool(rows)
        tiles = [] if decode else sgmv_tiles(starts, seg_adapter, skip_single=mixed)
        n_tiles = len(tiles) // 2
        copy_from_host(self.seg_start[: S + 1], torch.tensor(starts, dtype=torch.int32))
        copy_from_host(self.seg_adapter[:S], torch.tensor(seg_adapter, dtype=torch.int32))
        if n_tiles:
            copy_from_host(self.seg_tiles[:n_tiles], torch.tensor(tiles, dtype=torch.int32).view(-1, 2))
        if rows:
            copy_from_host(self.seg_rows[:, : len(rows)], torch.tensor([rows, row_slots], dtype=torch.int32))
        self.step.meta = LoraMeta(
            seg_start=self.seg_start[: S + 1], seg_adapter=self.seg_adapter[:S],
            seg_start_host=tuple(starts), seg_adapter_host=tuple(seg_adapter), num_tokens=total,
            max_adapter=max(seg_adapter), decode=decode,
            tiles=None if decode else self.seg_tiles[:n_tiles], num_tiles=n_tiles,
            rows=self.seg_rows[0, : len(rows)] if mixed else None,
            row_adapter=self.seg_rows[1, : len(rows)] if mixed else None, num_rows=len(rows),
        )  # fmt: skip
        return True

    def end_step(self) -> None:
        """Back to inactive: the adapted linears compute their base alone."""
        self.step.meta = None

    def close(self) -> None:
        """Stops the loader threads (running loads finish, maybe into the arena, which the executor
        owns and keeps)."""
        self.host.close()


AdapterPool = LoraPool
"""The pool's former name (``deltaserve.adapters.AdapterPool``)."""

__all__ = [
    "AdapterLayout",
    "AdapterLoadError",
    "AdapterPool",
    "GpuEntry",
    "HostCopy",
    "LoraPlacements",
    "LoraPool",
    "PlacementTables",
    "ReadPlan",
    "SliceRows",
]
