"""The adapter pool: LoRA adapters' tiers on the worker (host memory, pages of the KV pool) and the
per-step adapter tables the LoRA kernels read.

The router decides where every adapter lives (S-LoRA's unified paging, ``sched`` crate); this
module executes its ``AdapterOp``s and answers ``InspectAdapter``. There is ONE GPU pool: the KV
cache tensor ``[L, 2, NB, block_size, H_kv, D]`` (``model/kv_cache.py``). A page ``p`` is, in
every layer ``l``, two regions of ``S = block_size * H_kv * D`` elements of the layer's flat view
``kv.kv[l].view(-1)``: K half at ``p * S``, V half at ``(NB + p) * S``. A page holds either a
request's K/V or part of an adapter.

Layout of one adapter (``AdapterLayout``; the same in every layer, so one offsets table serves all)::

    rows, in order: for each projection the adapter targets, in linear_slots order (q k v o gate up down),
                    r_p = its largest rank over layers:
                        r_p rows of A   (A[j, :],  in_dim elements each)
                        r_p rows of B^T (B[:, j],  out_dim elements each)
    regions of pages [p1, p2, ...]:  K(p1) V(p1) K(p2) V(p2) ...
    first fit, in order: a row goes at the current position of the current region if it fits
                         entirely, else at the start of the next region
    num_blocks = ceil(regions used / 2); a row wider than S cannot be placed (inspect refuses it)

    layer flat view:  |K(p1): A_q0 A_q1 .. B_q0 ..  (tail) | ... | V(p1): .. | ...
    host copy:        [L, sum(used part of each region)]  the regions' used parts back to back
                      (so every row is contiguous in it and each region is one slice of it)

Layers where a projection has a smaller rank (PEFT ``rank_pattern``) or no adapter leave its last
rows zero; the per-layer rank table says how many rows are read (0 = not adapted there).

Tiers, one state machine per adapter id (the router sends the ops in ``StepPlan.adapter_ops``; the
executor validates the whole plan first, then applies them in order)::

    (disk) ──to_host(path)──> host: pending ──background load──> host: ready (or failed)
                                  │                                   │
                                  └───────────── to_gpu(pages) ───────┴──> + gpu: placed on pages
    drop_gpu: forget the placement (the pages are the router's again, maybe KV this very step)
    drop_host: free the host copy (a GPU placement stays valid without it)

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
changed since ``inspect``) is raised by ``to_gpu`` as ``AdapterLoadError``: the worker loop makes it
a fatal ``WorkerError`` and the router restarts the worker (its accounting no longer matches the
worker's).

Per-step tables (static: allocated once, filled in place, so captured CUDA graphs stay valid)::

    a_off, b_off [n_slices, max_slots, r_max] int64    element offsets of rank rows, shared by all layers
    rank         [L, n_slices, max_slots]     int32    0 = slot unused / slice not adapted in that layer
    scale        [L, n_slices, max_slots]     float32
    one kernels.lora.LoraWeights(check=False) per (layer, slice) over these tables and the layer's flat view;
        the slices of one module (qkv, gate_up) are consecutive rows of the tables (linear_slots order), so
        ``attach_lora`` stacks them into one ``LoraStack`` view per (layer, module): two launches per module
    seg_start [max_tokens + 1], seg_adapter [max_tokens], seg_tiles [max_tokens, 2] int32: the step's LoraMeta

``begin_step(segments, decode)`` maps the step's adapters to slots (sticky: an adapter keeps its
slot while it stays on the GPU, so steady decode rewrites no table; a new one takes a free slot or
one whose adapter this step does not use), fills the metadata and sets ``step.meta`` (MBGMV, one
row per token, for decode steps; SGMV, one segment per run, otherwise); ``end_step`` clears it.
A step without adapter tokens sets nothing: every adapted linear is then its base alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .. import wire
from ..kernels.lora import LoraMeta, LoraWeights, sgmv_tiles
from ..kernels.region_copy import copy_regions
from ..model.arch import ModelConfig
from ..model.batch import copy_from_host, host_to_device
from ..model.decoder import linear_slots
from ..model.kv_cache import PagedKVCache
from .host_tier import AdapterLoadError, HostTier
from .lora import LoraAdapterError, LoraSpec, TensorCopy, projection_features, read_lora_spec
from .lora_layers import LoraStep
from .pinned_arena import PinnedArena, give_back, host_buffer, release_hook

log = logging.getLogger("deltaserve.worker")

OPS = ("to_host", "to_gpu", "drop_gpu", "drop_host")
"""The ``AdapterOp.op`` strings the worker executes."""
_MAX_VEC_BYTES = 16
"""Widest vector load the kernels may use on aligned rows (``LoraWeights.offset_align``)."""


# ----------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class SliceRows:
    """Where one projection's rank rows sit in an adapter's regions."""

    index: int
    """Position of the projection in ``linear_slots`` order (its row in the a_off/b_off tables)."""
    proj: str
    """HF projection name, e.g. ``"q_proj"``."""
    rank: int
    """r_p: the largest rank this projection has over layers (rows placed for A and for B^T)."""
    in_dim: int
    """Width of an A row."""
    out_dim: int
    """Width of a B^T row."""
    a_pos: tuple[tuple[int, int], ...]
    """(region, element offset inside it) of ``A[j, :]`` for j < rank."""
    b_pos: tuple[tuple[int, int], ...]
    """(region, element offset inside it) of ``B[:, j]`` for j < rank."""
    packed_start: int
    """Element offset of this projection's first A row in a layer's packed host row."""


@dataclass(frozen=True)
class AdapterLayout:
    """One adapter's rows inside pages (module docstring); independent of which pages it gets."""

    region_elems: int
    """S: elements per region (half a page of one layer)."""
    slices: tuple[SliceRows, ...]
    """The targeted projections, in ``linear_slots`` order."""
    region_used: tuple[int, ...]
    """Elements used at the front of each region (its tail is left unused)."""

    @property
    def num_regions(self) -> int:
        return len(self.region_used)

    @property
    def num_blocks(self) -> int:
        """Pages the adapter takes: two regions (K and V half) per page."""
        return -(-self.num_regions // 2)

    @property
    def packed_elems(self) -> int:
        """Elements of one layer's packed host row (every row, back to back)."""
        return sum(self.region_used)

    @classmethod
    def plan(cls, ranks: dict[str, int], features: dict[str, tuple[int, int]], order: Sequence[str],
             region_elems: int) -> "AdapterLayout":
        """First-fit placement of the rows of projections ``ranks`` (proj -> r_p) in ``order``.

        Raises ValueError naming the projection when a row is wider than a region.
        """
        region, off, used = 0, 0, [0]
        packed = 0
        slices = []

        def place(width: int) -> tuple[int, int]:
            nonlocal region, off
            if off + width > region_elems:
                region, off = region + 1, 0
                used.append(0)
            pos = (region, off)
            off += width
            used[region] = off
            return pos

        for index, proj in enumerate(order):
            r = ranks.get(proj, 0)
            if r == 0:
                continue
            fin, fout = features[proj]
            for what, width in (("lora_A row (in_features)", fin), ("lora_B column (out_features)", fout)):
                if width > region_elems:
                    raise ValueError(
                        f"{proj}: a {what} has {width} elements but a page half holds {region_elems} "
                        f"(block_size x kv heads x head_dim); raise --block-size"
                    )
            a_pos = tuple(place(fin) for _ in range(r))
            b_pos = tuple(place(fout) for _ in range(r))
            slices.append(SliceRows(index, proj, r, fin, fout, a_pos, b_pos, packed))
            packed += r * (fin + fout)
        return cls(region_elems, tuple(slices), tuple(used))


@dataclass(frozen=True, eq=False)
class PlacementTables:
    """An adapter layout as host tensors, so placing it on pages is a few vector ops and one region copy
    (``AdapterPool.to_gpu``), not a Python loop over its rows and regions."""

    region_src: torch.Tensor
    """[R] int64: where each region's used part starts in a layer's packed host row."""
    region_used: torch.Tensor
    """[R] int64: elements used at the front of each region."""
    row_region: torch.Tensor
    """[2, n_slices, r_max] int64: region of A row j (``[0]``) and B^T row j (``[1]``) of each slice; -1
    past its rank or for a slice it does not target."""
    row_inner: torch.Tensor
    """[2, n_slices, r_max] int64: element offset of that row inside its region (0 where -1 above)."""

    @classmethod
    def of(cls, layout: AdapterLayout, n_slices: int, r_max: int) -> "PlacementTables":
        used = torch.tensor(layout.region_used, dtype=torch.int64)
        region = torch.full((2, n_slices, r_max), -1, dtype=torch.int64)
        inner = torch.zeros(2, n_slices, r_max, dtype=torch.int64)
        for s in layout.slices:
            for half, pos in enumerate((s.a_pos, s.b_pos)):
                region[half, s.index, : s.rank] = torch.tensor([k for k, _ in pos], dtype=torch.int64)
                inner[half, s.index, : s.rank] = torch.tensor([o for _, o in pos], dtype=torch.int64)
        return cls(torch.cumsum(used, 0) - used, used, region, inner)


# ----------------------------------------------------------------------------------- tiers


PLANS_KEPT = 8192
"""Read plans ``AdapterPool`` keeps (one per inspected adapter path; a few tens of KB each)."""


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """How to read one adapter into a host copy, from its config and header (``AdapterPool._plan``)."""

    spec: LoraSpec
    """The validated config and tensor sites."""
    layout: AdapterLayout
    """Where its rows go inside its pages."""
    copies: list[TensorCopy]
    """The native reads that fill the packed copy (``AdapterPool._copies``)."""
    rank: torch.Tensor
    """[L, n_slices] int32: rows per layer and slice (0 = not adapted there)."""
    scale: torch.Tensor
    """[L, n_slices] float32: the LoRA scaling per layer and slice."""
    host_bytes: int
    """Bytes of the packed host copy."""
    tables: PlacementTables
    """The layout as tensors, for ``to_gpu``."""


@dataclass(frozen=True, eq=False)
class HostCopy:
    """An adapter read, validated and packed in host memory, ready to be copied into pages."""

    layout: AdapterLayout
    """Where its rows go inside its pages."""
    packed: torch.Tensor
    """[L, layout.packed_elems] in the pool dtype (pinned on CUDA): every layer's rows back to back."""
    rank: torch.Tensor
    """[L, n_slices] int32 on CPU: rows read per layer and slice (0 = not adapted there)."""
    scale: torch.Tensor
    """[L, n_slices] float32 on CPU: the LoRA scaling per layer and slice."""
    max_rank: int
    """Largest rank over its modules."""
    target_modules: tuple[str, ...]
    """Adapted projections, in ``linear_slots`` order."""
    tables: PlacementTables
    """The layout as tensors, for ``to_gpu``."""

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


@dataclass(eq=False)
class GpuEntry:
    """An adapter placed on pages: the device tables one step slot is filled from."""

    block_ids: tuple[int, ...]
    """The pages holding it, in region order."""
    a_off: torch.Tensor
    """[n_slices, r_max] int64 on the device: element offset of A row j of each slice (0 beyond its rank)."""
    b_off: torch.Tensor
    """[n_slices, r_max] int64 on the device: element offset of B^T row j of each slice."""
    rank: torch.Tensor
    """[L, n_slices] int32 on the device."""
    scale: torch.Tensor
    """[L, n_slices] float32 on the device."""


def _offset_align(dims: Sequence[int], itemsize: int) -> int:
    """Largest power of two (at most 16 bytes of elements) dividing every dim: every row offset is a
    sum of them, so every offset the tables ever hold is a multiple of it."""
    align = max(1, _MAX_VEC_BYTES // itemsize)
    while align > 1 and any(d % align for d in dims):
        align //= 2
    return align


class AdapterPool:
    """LoRA adapters in host memory and in KV-pool pages, plus the step tables the kernels read."""

    def __init__(self, cfg: ModelConfig, kv: PagedKVCache, *, max_lora_rank: int, max_loras_per_step: int,
                 max_tokens: int, arena: PinnedArena | None = None) -> None:
        if max_lora_rank < 1:
            raise ValueError(f"AdapterPool: max_lora_rank {max_lora_rank} must be >= 1")
        if max_loras_per_step < 1:
            raise ValueError(f"AdapterPool: max_loras_per_step {max_loras_per_step} must be >= 1")
        self.config = cfg
        """The base model the adapters are validated against."""
        self.kv = kv
        """The one GPU pool: adapter rows live in its pages."""
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
        self.offset_align = _offset_align(
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
            raise spec.fail(f"rank {spec.max_rank} (layer {layer} {proj}) exceeds this worker's --max-lora-rank "
                            f"{self.max_lora_rank}")
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
        return ReadPlan(spec, layout, self._copies(spec, layout), rank, scale, self._host_bytes(layout),
                        PlacementTables.of(layout, n, self.max_lora_rank))

    def inspect(self, path: str | Path) -> wire.AdapterInfo:
        """Validates the adapter at ``path`` and reports its footprint; changes no state, never raises
        for a bad adapter (``error`` says what and where instead). Keeps its read plan for ``to_host``."""
        try:
            plan = self._plan(Path(path))
            plan.spec.read_into(plan.copies, None, self.dtype)  # values: finite, also in our dtype
        except (LoraAdapterError, OSError, ValueError, RuntimeError) as e:
            return wire.AdapterInfo(error=str(e) or type(e).__name__)
        spec, layout, host_bytes = plan.spec, plan.layout, plan.host_bytes
        self.plans[str(path)] = plan
        self.plans.move_to_end(str(path))
        while len(self.plans) > PLANS_KEPT:
            self.plans.popitem(last=False)
        return wire.AdapterInfo(
            error=None,
            num_blocks=layout.num_blocks,
            host_bytes=host_bytes,
            max_rank=spec.max_rank,
            target_modules=[s.proj for s in layout.slices],
            kind="lora",
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
        return HostCopy(layout, packed, plan.rank.clone(), plan.scale.clone(), plan.spec.max_rank,
                        tuple(s.proj for s in layout.slices), plan.tables)

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
            pages, offsets[0], offsets[1], host_to_device(copy.rank, dev), host_to_device(copy.scale, dev),
        )
        for p in pages:
            self.page_owner[p] = adapter_id
        log.debug("adapter %d placed on %d pages (%d bytes per layer)", adapter_id, len(pages),
                  layout.packed_elems * self.kv.kv.element_size())

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
        for p in entry.block_ids:
            self.page_owner.pop(p, None)
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self.slot_adapter[slot] = 0

    def apply(self, op: wire.AdapterOp) -> None:
        """Executes one (already validated) op."""
        if op.op == "to_host":
            self.to_host(op.adapter_id, op.path)
        elif op.op == "to_gpu":
            self.to_gpu(op.adapter_id, op.block_ids)
        elif op.op == "drop_gpu":
            self.drop_gpu(op.adapter_id)
        elif op.op == "drop_host":
            self.drop_host(op.adapter_id)
        else:
            raise ValueError(f"unknown adapter op {op.op!r} (expected one of {', '.join(OPS)})")

    # ------------------------------------------------------------------ steps

    def _assign_slots(self, adapter_ids: Sequence[int]) -> dict[int, int]:
        """Slots for the step's distinct adapters: kept if held, else a free or unused-this-step one."""
        wanted = set(adapter_ids)
        if len(wanted) > self.max_slots:
            raise ValueError(
                f"{len(wanted)} adapters in one step exceed --max-loras-per-step {self.max_slots}"
            )
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
        there (``DecodeGraphs.run``). Raises ValueError like ``begin_step``."""
        adapters = [a for a in row_adapters if a != 0]
        slot = self._assign_slots(adapters) if adapters else {}
        return [slot[a] if a != 0 else -1 for a in row_adapters]

    def begin_step(self, segments: Sequence[tuple[int, int]], decode: bool) -> bool:
        """Sets the step's adapter metadata from its token runs ``(adapter_id, n_tokens)`` (0 = base),
        in batch order; returns whether the step has adapter tokens (False: nothing was set).

        ``decode``: every run is one token (MBGMV metadata); else one SGMV segment per run.
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
                raise ValueError("begin_step: a decode step has one token per run")
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
        S = len(seg_adapter)
        tiles = [] if decode else sgmv_tiles(starts, seg_adapter)
        n_tiles = len(tiles) // 2
        copy_from_host(self.seg_start[: S + 1], torch.tensor(starts, dtype=torch.int32))
        copy_from_host(self.seg_adapter[:S], torch.tensor(seg_adapter, dtype=torch.int32))
        if n_tiles:
            copy_from_host(self.seg_tiles[:n_tiles], torch.tensor(tiles, dtype=torch.int32).view(-1, 2))
        self.step.meta = LoraMeta(
            seg_start=self.seg_start[: S + 1], seg_adapter=self.seg_adapter[:S],
            seg_start_host=tuple(starts), seg_adapter_host=tuple(seg_adapter), num_tokens=total,
            max_adapter=max(seg_adapter), decode=decode,
            tiles=None if decode else self.seg_tiles[:n_tiles], num_tiles=n_tiles,
        )  # fmt: skip
        return True

    def end_step(self) -> None:
        """Back to inactive: the adapted linears compute their base alone."""
        self.step.meta = None

    def close(self) -> None:
        """Stops the loader threads (running loads finish, maybe into the arena, which the executor
        owns and keeps)."""
        self.host.close()


__all__ = ["AdapterLayout", "AdapterLoadError", "AdapterPool", "GpuEntry", "HostCopy", "OPS", "SliceRows"]
