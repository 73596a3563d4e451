"""The delta pool: compressed full fine-tunes' tiers on the worker (host memory, GPU delta slots) and
the per-step rows the delta-aware modules read (``delta_layers.py``). The ``VariantPool`` of kind
``delta`` (``variants.py``).

A delta directory is what ``deltaserve compress`` writes (``compress/delta_dir.py`` owns the format
and the lineage checks). The router decides where every variant lives (``sched`` crate: at most
``--max-deltas N`` deltas on the GPU, DeltaZip's N); this module executes its ``VariantOp``s for
delta ids and answers ``InspectVariant`` for delta directories. Tiers: the router's state machine
(drawn in ``router/crates/sched/src/adapters.rs``); a delta's ``to_gpu`` names no pages, it fills the
slot s in [0, N) the router picked (``VariantOp.slot``; a slot taken here is refused); ``drop_gpu``
frees the slot; ``drop_host`` frees the host copy (a GPU copy stays valid without it).

GPU storage, per slot s (N slots; slot ids are shared by every linear and every config):
    packed linears  ``weights[(bits, sparse, group)][(layer, proj)]``: a ``kernels.sbmm.DeltaWeights``
                    of N slots per linear and per packed config, every config's a view of the same
                    arena per linear (``delta_slots.py``): N slots take the bytes the worker reserved
                    whatever mix of configs fills them (a slot holds a delta in the pool of its config
                    only; the other pools leave that slot empty)
    dense tensors   ``tables`` (``delta_layers.DeltaTables``): one table per tensor with a row block
                    per slot, in the model dtype (norms from start-up; embedding, lm_head and biases
                    allocated for all N slots when the first delta goes to the GPU); ``to_gpu`` copies
                    the delta's dense deltas into its slot's blocks and zeroes the blocks of tensors it
                    does not change

CUDA graphs (``DecodeGraphs``): ``graph_state(b, keys)`` points the step at static buffers (token
index, per-config work tiles, the lm_head's tiles) sized for ``b`` rows while a decode bucket is
captured; ``fill_graph_rows`` writes a decode step's rows into them before a replay. Graph work tiles
hold at most ``GRAPH_TILE`` tokens (the CUDA op's one 8-token fragment, fixed at capture).

Only deltas made for this base are accepted (``check_lineage`` against the base directory), in
mode ``delta`` (a ``--full-weights`` directory is the compressed fine-tune itself, not a delta),
whose packed tensors are block linears and fit a slot, and whose dense tensors are ones
``attach_deltas`` applies. A delta packs every block linear unless its manifest says ``"partial":
true`` (a block zoo variant, ``deltaserve.zoo``): the linears it leaves out get an exact zero delta.

``begin_step(rows)`` maps each token run and each logits row (``StepRows``) to its delta's slot
and fills ``step`` (``DeltaStep``) for an eager forward; ``end_step`` clears it. Loads failing after
inspection raise ``AdapterLoadError`` from ``to_gpu``; the executor quarantines that delta, exactly
like a LoRA adapter (``worker/quarantine.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import wire
from ..compress.delta_dir import check_lineage, load_delta, read_manifest
from ..formats.packed_delta import PackedLinear, pack
from ..kernels.sbmm import DeltaMeta, cuda_shape_problem, cuda_tile_cap, dense_min_m
from ..model.batch import copy_from_host, host_to_device
from ..model.decoder import DecoderLM, linear_slots
from .delta_layers import ConfigKey, DeltaEmbedding, DeltaStep, dense_delta_names, norm_delta_names
from .delta_slots import DeltaSlots, delta_gpu_bytes
from .host_tier import HostTier
from .pinned_arena import PinnedArena, give_back, host_buffer, release_hook
from .variants import StepRows, VariantCost, VariantKind

log = logging.getLogger("deltaserve.worker")

_PACKED_RE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)$")
GRAPH_TILE = 8
"""Most tokens of one delta per SBMM work tile in a captured decode step: one 8-token MMA fragment
(csrc/sbmm.cu NT = 1), fixed when the graph is captured; more rows of one delta take more tiles."""
HEAD_TILE = 16
"""Most logits rows of one delta per work tile of the lm_head delta (``kernels.dense_delta``)."""


@dataclass
class _GraphRows:
    """Static device buffers a captured decode step reads (``DeltaPool.graph_state``), for up to B rows."""

    index: torch.Tensor
    """[B] int64: slot + 1 of each row (0: none); the token and logits index alike (decode: one each)."""
    metas: dict[ConfigKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """Config -> (order [B], tiles [B, 3], tile count [1]) int32: a ``DeltaMeta``'s tensors."""
    head: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """The lm_head delta's (order, tiles, tile count), as in ``metas``."""


@functools.cache
def _zero_delta(key: ConfigKey, features: tuple[int, int]) -> PackedLinear:
    """A packed delta of config ``key`` that is exactly zero, for a linear of (in, out) ``features``:
    what a partial delta (``manifest["partial"]``) stores for the block linears it leaves to the base."""
    bits, sparse, group = key
    in_f, out_f = features
    mask = torch.tensor([True, True, False, False]).repeat(out_f, in_f // 4) if sparse else None
    groups = torch.zeros(out_f, in_f // group)
    return pack(torch.zeros(out_f, in_f, dtype=torch.int32), mask, groups, groups, bits, group)


class DeltaError(ValueError):
    """A delta directory this worker cannot serve (the message names the file, field or tensor)."""


@dataclass(frozen=True, eq=False)
class DeltaHostCopy:
    """A delta read and validated in host memory (pinned on CUDA), ready for a GPU slot."""

    key: ConfigKey
    """(bits, sparse, group size) of every packed linear."""
    packed: dict[tuple[int, str], PackedLinear]
    """(layer, HF proj) -> its packed delta."""
    dense: dict[str, torch.Tensor]
    """HF tensor name -> its dense float16 delta."""
    nbytes: int
    """Host bytes it takes."""
    buf: torch.Tensor
    """The payload buffer every tensor above is a view of (uint8; given back to the arena when dropped)."""


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


class DeltaPool:
    """Compressed deltas in host memory and in GPU slots, plus the step rows the modules read."""

    kind = VariantKind.DELTA

    def __init__(
        self,
        model: DecoderLM,
        base_dir: str | Path,
        *,
        max_deltas: int,
        device: torch.device,
        dtype: torch.dtype,
        arena: PinnedArena | None = None,
    ) -> None:
        if max_deltas < 1:
            raise ValueError(f"DeltaPool: max_deltas {max_deltas} must be >= 1")
        self.config = model.config
        self.base_dir = Path(base_dir)
        """The base model directory every delta's lineage is checked against."""
        self.max_deltas = max_deltas
        """N: GPU slots (``--max-deltas``); the router keeps at most N deltas GPU-resident."""
        self.device, self.dtype = device, dtype
        self.dense_names = dense_delta_names(model)
        """Dense tensors a delta may change (those the delta-aware modules apply)."""
        self.linear_names = set(linear_slots(self.config))
        """HF projections a packed delta may target."""
        self.step = DeltaStep()
        """What the delta-aware modules read; its pools and tables are this pool's."""
        self.slots = DeltaSlots(self.config, max_deltas, device)
        """The packed linears' slot arenas, which every config's pools view."""
        self.step.tables.norms = {n: torch.zeros(max_deltas + 1, self.config.hidden_size, dtype=dtype, device=device)
                                  for n in norm_delta_names(model)}  # fmt: skip
        self.head_name = DeltaEmbedding.NAME if self.config.tie_word_embeddings else "lm_head.weight"
        """The dense delta lm_head adds (the embedding's when tied)."""
        self.has_head = [False] * max_deltas
        """Per slot: its delta changes lm_head (a ``head_name`` delta): its logits rows get the lm_head
        delta's work (other slots' rows are left out of it, their table blocks are zeros anyway)."""
        self.graph_rows: _GraphRows | None = None
        """Static buffers of captured decode steps (``graph_state``); None until graphs ask for them."""
        self.arena = arena
        """Host memory the payloads are read into (pinned at start-up on CUDA, shared with the adapter
        pool; ``pinned_arena.py``), or None: each payload is allocated (and pinned on CUDA) on its own."""
        self.host: HostTier[DeltaHostCopy] = HostTier("delta", release=release_hook(arena, device, lambda c: c.buf))
        """Delta id -> its host copy (or the load producing it), loaded in background threads."""
        self.slot_of: dict[int, int] = {}
        """Delta id -> its GPU slot."""
        self.key_of: dict[int, ConfigKey] = {}
        """GPU-resident delta id -> the packed config its slot is filled in."""
        self.costs: dict[int, VariantCost] = {}
        """GPU-resident delta id -> what a step using it reads and computes."""
        self.tile_cap = cuda_tile_cap(device)
        """Most tokens per SBMM work tile: the CUDA op's largest where it runs (builds it now), else None."""
        self.dense_min_m = dense_min_m(device)
        """Prefill segments of a delta this long or longer: dequantised once and one matmul (CUDA only)."""

    # ------------------------------------------------------------------ inspect / validation

    def _validate(self, path: Path) -> dict[str, Any]:
        """Checks ``path`` is a delta of this base that this worker can apply; returns its manifest."""
        manifest = read_manifest(path)
        if manifest.get("mode", "delta") != "delta":
            raise DeltaError(
                f"{path}: mode '{manifest.get('mode')}' holds compressed full weights (the --full-weights "
                "baseline), not a delta of the base; serve it as a model after `materialize`"
            )
        check_lineage(manifest, self.base_dir, path)
        for name, entry in manifest["tensors"].items():
            if entry["kind"] == "packed":
                m = _PACKED_RE.match(name)
                if m is None or int(m.group(1)) >= self.config.num_layers or m.group(2) not in self.linear_names:
                    raise DeltaError(f"{path}: packed tensor '{name}' is not a block linear of this model")
            elif name not in self.dense_names:
                raise DeltaError(f"{path}: dense delta '{name}' has no per-token path on this worker")
        packed = {n for n, e in manifest["tensors"].items() if e["kind"] == "packed"}
        want = {f"model.layers.{i}.{linear_slots(self.config)[p].module.split('.')[0]}.{p}"
                for i in range(self.config.num_layers) for p in self.linear_names}  # fmt: skip
        missing = sorted(want - packed)
        if missing and manifest.get("partial") is not True:
            raise DeltaError(
                f"{path}: {len(missing)} block linears have no packed delta, e.g. '{missing[0]}' "
                "(deltaserve compress packs every one)"
            )
        comp = manifest["compression"]
        problem = self.slots.fits(int(comp["bits"]), comp["sparsity"] == "2:4", int(comp["group_size"]))
        if problem is not None:
            raise DeltaError(f"{path}: {problem}")
        return manifest

    def inspect(self, path: str | Path) -> wire.VariantInfo:
        """Validates the delta at ``path`` and reports its footprint; changes no state, never raises
        for a bad delta (``error`` says what and where instead)."""
        p = Path(path)
        try:
            manifest = self._validate(p)
        except (ValueError, OSError, KeyError, TypeError) as e:
            return wire.VariantInfo(error=f"delta {p}: {e}" if str(p) not in str(e) else str(e), kind=self.kind)
        comp, sizes = manifest["compression"], manifest["sizes"]
        targets = sorted(
            {
                m.group(2)
                for n, e in manifest["tensors"].items()
                if e["kind"] == "packed" and (m := _PACKED_RE.match(n)) is not None  # _validate matched each
            }
        )
        return wire.VariantInfo(
            error=None, num_blocks=0, host_bytes=self._expected_bytes(manifest), max_rank=0, target_modules=targets,
            kind=self.kind,
            summary=f"{comp['bits']}-bit {comp['sparsity']}, {float(sizes['compression_ratio']):.1f}x smaller than fp16",
        )  # fmt: skip

    @staticmethod
    def _expected_bytes(manifest: dict[str, Any]) -> int:
        """Host bytes of the loaded copy: the manifest's per-tensor sizes."""
        return sum(int(e.get("bytes", 0)) for e in manifest["tensors"].values())

    # ------------------------------------------------------------------ host tier

    def _read_host_copy(self, path: Path) -> DeltaHostCopy:
        """The background half of ``to_host``: validate again, load (into page-locked memory on CUDA)."""
        manifest = self._validate(path)
        bufs: list[torch.Tensor] = []

        def alloc(nbytes: int) -> torch.Tensor:
            bufs.append(host_buffer(self.arena, nbytes, pin=self.device.type == "cuda", what="delta"))
            return bufs[-1]

        try:
            _, packed_by_name, dense = load_delta(path, alloc=alloc)
        except BaseException:
            for b in bufs:
                give_back(self.arena, b, may_be_queued=False, device=self.device)
            raise
        comp = manifest["compression"]
        key: ConfigKey = (int(comp["bits"]), comp["sparsity"] == "2:4", int(comp["group_size"]))
        packed = {}
        for name, p in packed_by_name.items():
            m = _PACKED_RE.match(name)
            assert m is not None  # _validate checked every packed name
            packed[(int(m.group(1)), m.group(2))] = p
        nbytes = sum(p.nbytes() for p in packed.values()) + sum(t.nbytes for t in dense.values())
        for layer in range(self.config.num_layers):  # a partial delta (a zoo variant): zeros elsewhere
            for proj in self.linear_names:
                if (layer, proj) not in packed:
                    packed[(layer, proj)] = _zero_delta(key, self.slots.features[proj])
        return DeltaHostCopy(key, packed, dense, nbytes, bufs[0])

    def to_host(self, delta_id: int, path: str | Path) -> None:
        """Starts reading ``path`` into host memory in the background (``to_gpu`` waits for it)."""
        p = Path(path)
        try:
            expected = self._expected_bytes(read_manifest(p))
        except (ValueError, OSError, KeyError):
            expected = 0  # the load reports the real problem
        self.host.load(delta_id, p, self._read_host_copy, expected)

    def drop_host(self, delta_id: int) -> None:
        self.host.drop(delta_id)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies held: finished ones measured, running loads as expected."""
        return self.host.nbytes

    def host_ids(self) -> Collection[int]:
        return self.host

    def take_finished(self) -> list[int]:
        return self.host.take_finished()

    def wait_host(self, delta_id: int) -> DeltaHostCopy:
        return self.host.wait(delta_id)

    # ------------------------------------------------------------------ GPU tier

    @property
    def gpu_bytes(self) -> int:
        """Device bytes the pool holds: the slot arenas and the dense tables, each storage once (after
        the first ``to_gpu``, ``delta_slots.reserve_bytes``; the CPU path's dequantised reference
        caches are not device memory and not counted)."""
        t = self.step.tables
        tensors = [*self.slots.arenas.values(), *t.norms.values(), *t.biases.values(), t.embed, t.head]
        storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in tensors if x is not None}
        return sum(storages.values())

    @property
    def gpu(self) -> set[int]:
        """Delta ids resident in GPU slots."""
        return set(self.slot_of)

    def to_gpu(self, delta_id: int, slot: int) -> None:
        """Copies the host copy into slot ``slot`` (the router's pick) of every pool of its config (the
        config's views of the slot arenas made the first time it is seen) and its dense deltas to the
        device. ValueError for a slot out of range or taken, or a delta already on the GPU."""
        if delta_id in self.slot_of:
            raise ValueError(f"delta {delta_id} is already on the GPU")
        if not 0 <= slot < self.max_deltas:
            raise ValueError(f"delta {delta_id}: slot {slot} is not one of the {self.max_deltas} delta slots")
        holder = next((d for d, s in self.slot_of.items() if s == slot), None)
        if holder is not None:
            raise ValueError(f"delta {delta_id}: delta slot {slot} holds delta {holder}")
        copy = self.wait_host(delta_id)
        pools = self.step.weights.get(copy.key)
        if pools is None:
            pools = self.slots.pools(copy.key, copy.packed)
            if self.device.type == "cpu":  # sbmm_ref serves: dequantise each delta once, not every step
                for w in pools.values():
                    w.cache_reference()
            self.step.weights[copy.key] = pools
        for k, p in copy.packed.items():  # every delta packs every block linear (_validate)
            pools[k].store(slot, p.to(self.device))
        self._fill_tables(slot, copy.dense)
        self.slot_of[delta_id] = slot
        self.key_of[delta_id] = copy.key
        head = copy.dense.get(self.head_name)  # read whole for its logits rows; embedding rows are gathered
        head_bytes = 0 if head is None else head.numel() * torch.empty((), dtype=self.dtype).element_size()
        packed = copy.packed.values()  # every block linear, a partial delta's zero ones too: the kernel reads them
        self.costs[delta_id] = VariantCost(
            sum(p.nbytes() for p in packed) + head_bytes, 2 * sum(p.out_features * p.kept for p in packed)
        )

    def drop_gpu(self, delta_id: int) -> None:
        """Frees the delta's slot (its regions zeroed in place, its dense deltas released)."""
        slot = self.slot_of.pop(delta_id)
        key = self.key_of.pop(delta_id)
        self.costs.pop(delta_id, None)
        for w in self.step.weights.get(key, {}).values():
            if w.loaded[slot]:
                w.clear(slot)
        self.has_head[slot] = False  # the tables' blocks are refilled (or zeroed) by the slot's next to_gpu

    def _fill_tables(self, slot: int, dense: dict[str, torch.Tensor]) -> None:
        """Copies a delta's dense deltas into slot ``slot``'s blocks of the tables (allocated for every
        slot the first time), zeroing the blocks of tensors it does not change."""
        tables = self.step.tables
        cfg, n = self.config, self.max_deltas
        if tables.embed is None:
            zeros = functools.partial(torch.zeros, dtype=self.dtype, device=self.device)
            tables.embed = zeros(n * cfg.vocab_size + 1, cfg.hidden_size)
            tables.head = (
                tables.embed[:-1].view(n, cfg.vocab_size, cfg.hidden_size)
                if cfg.tie_word_embeddings
                else zeros(n, cfg.vocab_size, cfg.hidden_size)
            )
            for name in sorted(self.dense_names):
                if name.endswith(".bias"):
                    tables.biases[name] = zeros(n + 1, self._bias_width(name))
        v = cfg.vocab_size
        blocks = {DeltaEmbedding.NAME: tables.embed[slot * v : (slot + 1) * v]}
        if not cfg.tie_word_embeddings:
            assert tables.head is not None  # allocated with embed above
            blocks["lm_head.weight"] = tables.head[slot]
        blocks.update({name: t[slot + 1] for name, t in (*tables.norms.items(), *tables.biases.items())})
        for name, block in blocks.items():
            d = dense.get(name)
            if d is None:
                block.zero_()
            else:
                block.copy_(d.to(self.device, non_blocking=True).view(block.shape))  # the cast on the device
        self.has_head[slot] = self.head_name in dense

    def _bias_width(self, name: str) -> int:
        """Output features of the linear whose bias ``name`` is (``model.layers.{i}.<parent>.<proj>.bias``)."""
        return linear_slots(self.config)[name.split(".")[-2]].size

    def step_cost(self, variant_id: int) -> VariantCost | None:
        """What a step reads and computes for the resident delta (``worker/step_floor.py``)."""
        return self.costs.get(variant_id)

    def placements(self) -> DeltaPlacements:
        return DeltaPlacements(self)

    def step_problem(self, variant_ids: Collection[int]) -> str | None:
        return None  # at most max_deltas are resident, and a step may use all of them

    def apply(self, op: wire.VariantOp) -> None:
        """Executes one (already validated) op for a delta id."""
        move = wire.TierOp(op.op)
        if move is wire.TierOp.TO_HOST:
            self.to_host(op.adapter_id, op.path)
        elif move is wire.TierOp.TO_GPU:
            assert op.slot is not None  # the plan check refused a delta's to_gpu without a slot
            self.to_gpu(op.adapter_id, op.slot)
        elif move is wire.TierOp.DROP_GPU:
            self.drop_gpu(op.adapter_id)
        else:
            self.drop_host(op.adapter_id)

    # ------------------------------------------------------------------ steps

    def begin_step(self, rows: StepRows) -> bool:
        """Sets the step's delta rows from its token runs ``(variant id, n_tokens)`` in batch order and
        the variant id of each logits row (ids not in this pool count as "no delta"); returns whether
        the step has delta tokens (False: nothing was set)."""
        logit_ids, decode = rows.logit_ids, rows.decode
        slots = [(self.slot_of.get(v, -1), n) for v, n in rows.runs if n > 0]
        used = {s for s, _ in slots if s >= 0}
        if not used:
            self.end_step()
            return False
        dev = self.device
        token_slot: list[int] = []
        for s, n in slots:
            token_slot.extend([s] * n)
        logit_slot = [self.slot_of.get(v, -1) for v in logit_ids]
        # From pinned memory: a pageable copy would wait for the step still running (overlapped steps).
        self.step.token_index = host_to_device(torch.tensor(token_slot, dtype=torch.int64) + 1, dev)
        self.step.logit_index = host_to_device(torch.tensor(logit_slot, dtype=torch.int64) + 1, dev)
        metas = []
        for key in self._keys(used):
            of_key = self._of_key(key, [s for s, _ in slots])
            if decode:
                meta = DeltaMeta.rows(of_key, dev, max_block_m=self.tile_cap)
            else:
                meta = DeltaMeta.segments([n for _, n in slots], of_key, dev, self.tile_cap, self.dense_min_m)
            metas.append((key, meta))
        self.step.metas = tuple(metas)
        self.step.head_meta = DeltaMeta.rows(self._head_rows(logit_slot), dev, max_block_m=HEAD_TILE)
        return True

    def _keys(self, used: set[int]) -> list[ConfigKey]:
        """The packed configs of the deltas in slots ``used``, sorted."""
        slot_id = {s: d for d, s in self.slot_of.items()}
        return sorted({self.key_of[slot_id[s]] for s in used})

    def _of_key(self, key: ConfigKey, slots: Sequence[int]) -> list[int]:
        """``slots`` with every slot whose delta is not of config ``key`` replaced by -1."""
        slot_key = {s: self.key_of[d] for d, s in self.slot_of.items()}
        return [s if s >= 0 and slot_key[s] == key else -1 for s in slots]

    def _head_rows(self, logit_slot: Sequence[int]) -> list[int]:
        """Each logits row's slot where its delta changes lm_head, else -1."""
        return [s if s >= 0 and self.has_head[s] else -1 for s in logit_slot]

    def end_step(self) -> None:
        """Back to inactive: the delta-aware modules compute their base alone."""
        self.step.metas = ()
        self.step.head_meta = None
        self.step.token_index = self.step.logit_index = None

    # ------------------------------------------------------------------ CUDA graphs

    def graphable(self, keys: Sequence[ConfigKey]) -> bool:
        """Whether decode steps of packed configs ``keys`` can be captured: the CUDA SBMM op runs here
        (``tile_cap``) and takes every linear of those configs (their work tiles of ``GRAPH_TILE`` tokens
        are the CUDA op's only), and the dtype is one it takes."""
        if self.tile_cap is None or self.dtype not in (torch.float16, torch.bfloat16):
            return False
        x = torch.empty(0, 0, dtype=self.dtype, device=self.device)
        for key in keys:
            pools = self.step.weights.get(key)
            if not pools or any(cuda_shape_problem(x, w) for w in pools.values()):
                return False
        return True

    def graph_tiles(self, b: int, cap: int) -> int:
        """Rows of a captured step's tile table (its launches' grid): the most work tiles of ``cap`` tokens
        ``b`` rows can make, one partial tile at most per slot (eager decode metadata has ``b`` rows, most of
        them padding blocks that launch and exit)."""
        return min(b, self.max_deltas + b // cap)

    def graph_keys(self, delta_ids: Sequence[int]) -> tuple[ConfigKey, ...]:
        """The packed configs a decode step of rows ``delta_ids`` (variant ids; others count as none)
        uses: the delta part of its graph's key."""
        return tuple(self._keys({self.slot_of[v] for v in delta_ids if v in self.slot_of}))

    def _graph_buffers(self, max_batch: int, keys: Sequence[ConfigKey]) -> _GraphRows:
        """The static buffers, (re)made for ``max_batch`` rows; per-config ones added as configs appear."""

        def tile_buffers() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            def zeros(*shape: int) -> torch.Tensor:
                return torch.zeros(*shape, dtype=torch.int32, device=self.device)

            return zeros(max_batch), zeros(max_batch, 3), zeros(1)

        g = self.graph_rows
        if g is None or g.index.shape[0] != max_batch:
            g = self.graph_rows = _GraphRows(
                torch.zeros(max_batch, dtype=torch.int64, device=self.device), {}, tile_buffers()
            )
        for key in keys:
            if key not in g.metas:
                g.metas[key] = tile_buffers()
        return g

    @contextmanager
    def graph_state(self, b: int, max_batch: int, keys: Sequence[ConfigKey]) -> Iterator[None]:
        """While a decode bucket of ``b`` rows is captured: the step reads the static buffers (configs
        ``keys``), with no delta row yet (slot -1 everywhere); inactive again after."""
        g = self._graph_buffers(max_batch, keys)
        self._write_rows(g, b, [-1] * b, keys)

        def static(order: torch.Tensor, tiles: torch.Tensor, count: torch.Tensor, cap: int) -> DeltaMeta:
            meta = DeltaMeta.rows([-1] * b, self.device, max_block_m=cap)
            grid = self.graph_tiles(b, cap)
            return dataclasses.replace(
                meta,
                order=order[:b],
                tiles=tiles[:grid],
                tile_count=count,
                grid_tiles=grid,
                block_m=cap,
                tile_tokens=cap,
            )

        self.step.token_index = self.step.logit_index = g.index[:b]
        self.step.metas = tuple((key, static(*g.metas[key], GRAPH_TILE)) for key in keys)
        self.step.head_meta = static(*g.head, HEAD_TILE)
        try:
            yield
        finally:
            self.end_step()

    def fill_graph_rows(self, delta_ids: Sequence[int], b: int, keys: Sequence[ConfigKey]) -> None:
        """Writes a decode step's rows (variant id per row, ``len <= b``; padding up to ``b``) into the
        static buffers a graph captured with ``graph_state(b, .., keys)`` reads."""
        g = self.graph_rows
        assert g is not None and all(k in g.metas for k in keys), "graph_state first"
        slots = [self.slot_of.get(v, -1) for v in delta_ids] + [-1] * (b - len(delta_ids))
        self._write_rows(g, b, slots, keys)

    def _write_rows(self, g: _GraphRows, b: int, slots: list[int], keys: Sequence[ConfigKey]) -> None:
        copy_from_host(g.index[:b], torch.tensor(slots, dtype=torch.int64) + 1)

        def write(bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: list[int], cap: int) -> None:
            meta = DeltaMeta.rows(rows, "cpu", max_block_m=cap)  # built on the host, copied in
            grid = self.graph_tiles(b, cap)
            assert meta.num_tiles <= grid  # its real tiles come first, padding after
            for buf, host in zip(bufs, (meta.order, meta.tiles[:grid], meta.tile_count)):
                assert host is not None  # row metadata has an order and a tile count
                copy_from_host(buf[: host.shape[0]], host)

        for key in keys:
            write(g.metas[key], self._of_key(key, slots), GRAPH_TILE)
        write(g.head, self._head_rows(slots), HEAD_TILE)

    def close(self) -> None:
        self.host.close()


__all__ = ["DeltaError", "DeltaHostCopy", "DeltaPlacements", "DeltaPool", "GRAPH_TILE", "HEAD_TILE", "delta_gpu_bytes"]
