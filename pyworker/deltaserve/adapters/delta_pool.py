"""The delta pool: compressed full fine-tunes' tiers on the worker (host memory, GPU delta slots) and
the per-step rows the delta-aware modules read (``delta_layers.py``). The ``VariantPool`` of kind
``delta`` (``variants.py``).

A delta directory is what ``deltaserve compress`` writes (``compress/delta_dir.py`` owns the format
and the lineage checks). The router decides where every variant lives (``sched`` crate: at most
``--max-deltas N`` deltas on the GPU, DeltaZip's N); this module executes its ``VariantOp``s for
delta ids and answers ``InspectVariant`` for delta directories. Tiers: the router's state machine
(drawn in ``router/crates/sched/src/adapters.rs``); a delta's ``to_gpu`` names no pages, it fills the
slot s in [0, N) the router picked (``VariantOp.slot``; a slot taken here is refused), its copies run
beside the steps and reported when done (``delta_loads.py``, ``StepOutput.gpu_ready``); ``drop_gpu``
frees the slot; ``drop_host`` frees the host copy (a GPU copy stays valid without it).

GPU storage, per slot s (N slots):
    packed linears  ``weights[(bits, sparse, group)][(layer, proj)]``: a ``kernels.sbmm.DeltaWeights``
                    of N slots per linear and per packed config, every config's a view of the same
                    arena per linear (``delta_slots.py``): N slots take the bytes the worker reserved
                    whatever mix of configs fills them (a slot holds a piece in the pool of its config
                    only; the other pools leave that slot empty). A delta's linears go in pieces (the
                    attention / FFN linears of one layer) to *block slots* picked per piece
                    (``delta_blocks.py``): a piece two resident deltas share is held once and its rows
                    are one group of that layer's SBMM call (BlockLLM's per-block batching)
    dense tensors   ``tables`` (``delta_layers.DeltaTables``): one table per tensor with a row block
                    per slot, in the model dtype (norms from start-up; embedding, lm_head and biases
                    allocated for all N slots when the first delta goes to the GPU); ``to_gpu`` copies
                    the delta's dense deltas into its slot's blocks and zeroes the blocks of tensors it
                    does not change

CUDA graphs (``DecodeGraphs``): ``graph_state(b, keys)`` points the step at static buffers (token
index, per-config work tiles, the lm_head's tiles) sized for ``b`` rows while a decode bucket is
captured; ``fill_graph_rows`` writes a decode step's rows into them before a replay. Prefill and
mixed steps (``MixedGraphs``) have their own set (``mixed_graph_state`` / ``fill_mixed_rows``): each
token of the bucket a row of the SBMM metadata, and the logits rows apart; a long prompt's delta may
run in the step's dense lane instead (``dense_lane_for``; ``delta_graphs``). Graph work tiles
hold at most ``GRAPH_TILE`` tokens (the CUDA op's widest tile, fixed at capture).

Only deltas made for this base are accepted (``check_lineage`` against the base directory), in
mode ``delta`` (a ``--full-weights`` directory is the compressed fine-tune itself, not a delta),
whose packed tensors are block linears and fit a slot, and whose dense tensors are ones
``attach_deltas`` applies. A delta packs every block linear unless its manifest says ``"partial":
true`` (a block zoo variant, ``deltaserve.zoo``): a piece it leaves out runs the base alone (no SBMM
work), a linear it leaves out of a piece it has gets an exact zero delta.

``begin_step(rows)`` maps each token run and each logits row (``StepRows``) to its delta's slot
(the dense tables) and, per piece, to the block slot its delta's piece holds, and fills ``step`` (``DeltaStep``) for an eager forward; ``end_step`` clears it. Loads failing after
inspection raise ``AdapterLoadError`` from ``to_gpu``; the executor quarantines that delta, exactly
like a LoRA adapter (``worker/quarantine.py``).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import wire
from ..compress.delta_dir import check_lineage, load_delta, read_manifest
from ..formats.packed_delta import PackedLinear
from ..kernels.sbmm import DeltaMeta, DeltaWeights, cuda_shape_problem, cuda_tile_cap, dense_min_m
from ..model.batch import host_to_device
from ..model.decoder import DecoderLM, linear_slots
from .delta_blocks import (
    BlockSlots,
    dense_piece_names,
    dense_pieces,
    group_pieces,
    part_of,
    payload_identities,
    piece_index,
    piece_sharing,
    zero_delta,
)
from .delta_graphs import DeltaGraphRows, dense_lane_tokens
from .delta_layers import ConfigKey, DeltaEmbedding, DeltaStep, DenseLane, dense_delta_names, norm_delta_names
from .delta_loads import DeltaLoads
from .delta_placements import DeltaPlacements
from .delta_slots import DeltaSlots, delta_gpu_bytes
from .host_tier import HostTier
from .pinned_arena import PinnedArena, give_back, host_buffer, release_hook
from .variants import StepRows, VariantCost, VariantKind

log = logging.getLogger("deltaserve.worker")

_PACKED_RE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)$")
GRAPH_TILE = 16
"""Most tokens of one delta per SBMM work tile in a captured decode step, fixed when the graph is captured:
the CUDA op's widest tile (csrc/sbmm.cu ``MAX_NT`` = 2 fragments of 8 tokens; a tile computes only the
fragments its rows fill, so 8 rows of a delta cost what an 8-token tile did), so 16 rows of one delta
dequantise it once; more take more tiles."""
HEAD_TILE = 16
"""Most logits rows of one delta per work tile of the lm_head delta (``kernels.dense_delta``)."""


class DeltaError(ValueError):
    """A delta directory this worker cannot serve (the message names the file, field or tensor)."""


@dataclass(frozen=True, eq=False)
class DeltaHostCopy:
    """A delta read and validated in host memory (pinned on CUDA), ready for a GPU slot."""

    key: ConfigKey
    """(bits, sparse, group size) of every packed linear."""
    packed: dict[tuple[int, str], PackedLinear]
    """(layer, HF proj) -> its packed delta; a partial delta's missing linears of a piece it has are
    exact zero deltas, its pieces without any linear are absent (they run the base alone)."""
    pieces: dict[int, Hashable]
    """Piece index (``delta_blocks``) -> identity of the piece: deltas with the same one share its slot."""
    dense: dict[str, torch.Tensor]
    """HF tensor name -> its dense float16 delta."""
    nbytes: int
    """Host bytes it takes."""
    buf: torch.Tensor
    """The payload buffer every tensor above is a view of (uint8; given back to the arena when dropped)."""


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
        piece_sharing()  # a bad DELTASERVE_DELTA_PIECE_SHARING stops the worker at start, not a load
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
        self.graph_rows: DeltaGraphRows | None = None
        """Static buffers of captured decode steps (``graph_state``); None until graphs ask for them."""
        self.mixed_rows: DeltaGraphRows | None = None
        """Static buffers of captured prefill and mixed steps (``mixed_graph_state``), one row per token."""
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
        self.num_pieces = 2 * self.config.num_layers
        """Pieces of a delta (``delta_blocks``): the attention and the FFN linears of each layer."""
        self.embed_piece, self.head_piece = dense_pieces(self.config)
        """Piece indices of the embedding delta and of the lm_head delta (the embedding's when tied)."""
        self.blocks = BlockSlots(self.num_pieces + 2, max_deltas)
        """Which block slot holds which piece, per piece index, and its users (refcounts): the packed
        linears' pieces, then the embedding's and the untied lm_head's (rows of the dense tables)."""
        self.piece_slots: dict[int, tuple[int, ...]] = {}
        """GPU-resident delta id -> its block slot at each piece index (-1: none, the base alone)."""
        self.projs_of_part = {
            part: [p for p in self.linear_names if part_of(self.config, p) == part] for part in (0, 1)
        }
        """Part -> the HF projections of a layer's piece of that part."""
        self.tile_cap = cuda_tile_cap(device)
        """Most tokens per SBMM work tile: the CUDA op's largest where it runs (builds it now), else None."""
        self._graphable: dict[ConfigKey, bool] = {}
        """``_config_graphable`` of each config whose pools exist."""
        self.dense_min_m = dense_min_m(device)
        """Prefill segments of a delta this long or longer: dequantised once and one matmul (CUDA only)."""
        self.lane_scratch: torch.Tensor | None = None
        """The dense lane's dequantised delta (room for the widest linear), made with the first pools."""
        self._lane_rows: dict[int, torch.Tensor] = {}
        """GPU-resident delta id -> its dense-lane offsets ``[linears, 3]`` on the host (``_lane_offsets``)."""
        self.loads = DeltaLoads(device)
        """The ``to_gpu`` ops' device work, beside the steps (``delta_loads.py``: a loader thread and its
        own stream on CUDA)."""

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
        key = _config_key(manifest)
        packed = {}
        for name, linear in packed_by_name.items():
            m = _PACKED_RE.match(name)
            assert m is not None  # _validate checked every packed name
            packed[(int(m.group(1)), m.group(2))] = linear
        nbytes = sum(p.nbytes() for p in packed.values()) + sum(t.nbytes for t in dense.values())
        present = {piece_index(layer, part_of(self.config, proj)) for layer, proj in packed}
        for piece in present:  # a partial delta (a zoo variant): a piece's missing linears are zero deltas
            layer, part = divmod(piece, 2)
            for proj in self.projs_of_part[part]:
                if (layer, proj) not in packed:
                    packed[(layer, proj)] = zero_delta(key, self.slots.features[proj])
        payload = manifest["payload"]
        files = payload.get("files") if "files" in payload else [payload.get("file", "")]
        found = payload_identities(path, [str(f) for f in files], payload.get("codec", "none"), self.config)
        unique = object()  # pieces the files do not identify are this copy's alone
        present |= {p for name, p in dense_piece_names(self.config).items() if name in dense}
        pieces: dict[int, Hashable] = {p: (key, found.get(p, unique)) for p in sorted(present)}
        return DeltaHostCopy(key, packed, pieces, dense, nbytes, bufs[0])

    def to_host(self, delta_id: int, path: str | Path) -> None:
        """Starts reading ``path`` into host memory in the background (``to_gpu`` waits for it)."""
        p = Path(path)
        try:
            expected = self._expected_bytes(read_manifest(p))
        except (ValueError, OSError, KeyError):
            expected = 0  # the load reports the real problem
        self.host.load(delta_id, p, self._read_host_copy, expected)

    def drop_host(self, delta_id: int) -> None:
        with self.loads.host_fence(delta_id):  # a load beside the steps may still be copying from it
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
        """Device bytes the pool holds: the slot arenas, the dense tables and the dense lane's scratch,
        each storage once (after the first ``to_gpu``, ``delta_slots.reserve_bytes``; the CPU path's
        dequantised reference caches are not device memory and not counted)."""
        t = self.step.tables
        tensors = [
            *self.slots.arenas.values(),
            *t.norms.values(),
            *t.biases.values(),
            t.embed,
            t.head,
            self.lane_scratch,
        ]
        storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in tensors if x is not None}
        return sum(storages.values())

    @property
    def gpu(self) -> set[int]:
        """Delta ids resident in GPU slots."""
        return set(self.slot_of)

    def to_gpu(self, delta_id: int, slot: int) -> None:
        """Takes slot ``slot`` (the router's pick) for the delta and copies it there on the current
        stream, in the step being run (the block speculation gate's landing; ``apply`` runs a
        ``to_gpu`` op beside the steps instead: ``load_beside_steps``). ValueError for a slot out of
        range or taken, or a delta already on the GPU; AdapterLoadError for a failed host read."""
        work = self._place(delta_id, slot)
        self.loads.after_all()  # a piece it shares may still be copying for another delta
        work()

    def load_beside_steps(self, delta_id: int, slot: int) -> None:
        """``to_gpu`` with the copies run beside the steps (``delta_loads.py``): a step that uses the
        delta waits for them (``wait_gpu``), and ``take_gpu_ready`` reports them finished."""
        self.loads.start(delta_id, self._place(delta_id, slot))

    def _place(self, delta_id: int, slot: int) -> Callable[[], None]:
        """Takes slot ``slot`` for the delta (the bookkeeping, at once) and returns the device work that
        fills it: its dense deltas go to the slot's rows of the tables; each of its pieces to a block
        slot of that piece (``delta_blocks``: a piece another resident delta holds already gains a
        user and is not copied again; a new one goes to ``slot`` where free) of every pool of its
        config (the config's views of the slot arenas made the first time it is seen). Waits for the
        host read: ValueError / AdapterLoadError as ``to_gpu`` says."""
        if delta_id in self.slot_of:
            raise ValueError(f"delta {delta_id} is already on the GPU")
        if not 0 <= slot < self.max_deltas:
            raise ValueError(f"delta {delta_id}: slot {slot} is not one of the {self.max_deltas} delta slots")
        holder = next((d for d, s in self.slot_of.items() if s == slot), None)
        if holder is not None:
            raise ValueError(f"delta {delta_id}: delta slot {slot} holds delta {holder}")
        copy = self.wait_host(delta_id)
        pools = self._config_pools(copy.key)
        at = [-1] * (self.num_pieces + 2)
        stores: list[int] = []
        for p, identity in copy.pieces.items():
            at[p], new = self.blocks.acquire(p, identity, preferred=slot)
            if new:
                stores.append(p)
        self.slot_of[delta_id] = slot
        self.key_of[delta_id] = copy.key
        self.piece_slots[delta_id] = tuple(at)
        self.costs[delta_id] = self._cost(copy)

        def work() -> None:
            self._fill_tables(slot, copy.dense)
            for p in stores:
                if p >= self.num_pieces:
                    self._store_dense_piece(p, at[p], copy.dense)
                    continue
                layer, part = divmod(p, 2)
                for proj in self.projs_of_part[part]:
                    # Queued, not waited for: the payload is pinned, and ``drop_host`` fences its
                    # region (``pinned_arena.give_back``) until the copies have run.
                    pools[(layer, proj)].store(at[p], copy.packed[(layer, proj)].to(self.device, non_blocking=True))

        return work

    def _config_pools(self, key: ConfigKey) -> dict[tuple[int, str], DeltaWeights]:
        """Config ``key``'s pool of every linear: the config's views of the slot arenas, made the first time
        it is seen (the arenas, the embedding / lm_head / bias tables and the lane's scratch with the first
        config, as reserved: ``delta_slots.reserve_bytes``)."""
        pools = self.step.weights.get(key)
        if pools is None:
            like = {
                (layer, proj): zero_delta(key, self.slots.features[proj])
                for layer in range(self.config.num_layers) for proj in self.linear_names
            }  # fmt: skip
            pools = self.slots.pools(key, like)
            if self.device.type == "cpu":  # sbmm_ref serves: dequantise each delta once, not every step
                for w in pools.values():
                    w.cache_reference()
            self.step.weights[key] = pools
            self._make_tables()
            self._scratch()
        return pools

    def config_key(self, path: str | Path) -> ConfigKey:
        """The packed config of the delta at ``path`` (its manifest's compression; ``inspect`` validated it)."""
        return _config_key(read_manifest(Path(path)))

    def prepare_config(self, key: ConfigKey) -> bool:
        """Makes config ``key``'s pools ahead of its first delta's ``to_gpu`` (the executor, when a delta of
        a new config is registered: its graphs are captured then, not in the first step that needs them);
        returns whether captured steps take the config (``graphable``)."""
        self._config_pools(key)
        return self.graphable([key])

    def _cost(self, copy: DeltaHostCopy) -> VariantCost:
        """What a step reads for the delta: each piece's packed linears (a piece's zero ones too: the
        kernel reads them) and the lm_head delta (read whole for its logits rows; embedding rows are
        gathered), by piece identity, since deltas sharing a piece read it once per step."""
        shared: dict[Hashable, int] = {}
        for (layer, proj), p in copy.packed.items():
            piece = piece_index(layer, part_of(self.config, proj))
            key = (piece, copy.pieces[piece])
            shared[key] = shared.get(key, 0) + p.nbytes()
        head = copy.dense.get(self.head_name)
        if head is not None:
            item = torch.empty((), dtype=self.dtype).element_size()
            shared[(self.head_piece, copy.pieces[self.head_piece])] = head.numel() * item
        flops = 2 * sum(p.out_features * p.kept for p in copy.packed.values())
        return VariantCost(0, flops, shared)

    def drop_gpu(self, delta_id: int) -> None:
        """Frees the delta's slot (its dense deltas released) and its pieces' block slots that no other
        resident delta uses (their regions zeroed in place)."""
        self.loads.forget(delta_id)
        self.slot_of.pop(delta_id)
        self._lane_rows.pop(delta_id, None)
        key = self.key_of.pop(delta_id)
        self.costs.pop(delta_id, None)
        pools = self.step.weights.get(key, {})
        for p, at in enumerate(self.piece_slots.pop(delta_id)):
            if at >= 0 and self.blocks.release(p, at) and p < self.num_pieces:
                layer, part = divmod(p, 2)
                for proj in self.projs_of_part[part]:
                    w = pools[(layer, proj)]
                    if w.loaded[at]:
                        w.clear(at)
            # an embedding / lm_head piece's rows stay: nothing reads them until a piece is stored there

    def _make_tables(self) -> None:
        """Allocates the embedding, lm_head and bias tables for every slot, with the first pools: a graph
        captured before any delta is resident (``prepare_config``) must run the modules that read them."""
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

    def _fill_tables(self, slot: int, dense: dict[str, torch.Tensor]) -> None:
        """Copies a delta's norm and bias deltas into slot ``slot``'s blocks of the tables (``_make_tables``),
        zeroing the blocks of tensors it does not change."""
        tables = self.step.tables
        assert tables.embed is not None, "made with the first pools"
        blocks = {name: t[slot + 1] for name, t in (*tables.norms.items(), *tables.biases.items())}
        for name, block in blocks.items():
            d = dense.get(name)
            if d is None:
                block.zero_()
            else:
                block.copy_(d.to(self.device, non_blocking=True).view(block.shape))  # the cast on the device

    def _store_dense_piece(self, p: int, at: int, dense: dict[str, torch.Tensor]) -> None:
        """The embedding (``p == embed_piece``) or untied lm_head delta into block slot ``at`` of its table."""
        tables, v = self.step.tables, self.config.vocab_size
        assert tables.embed is not None and tables.head is not None  # _make_tables allocated them
        name, block = (
            (DeltaEmbedding.NAME, tables.embed[at * v : (at + 1) * v]) if p == self.embed_piece
            else ("lm_head.weight", tables.head[at])
        )  # fmt: skip
        block.copy_(dense[name].to(self.device, non_blocking=True).view(block.shape))

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
            self.load_beside_steps(op.adapter_id, op.slot)
        elif move is wire.TierOp.DROP_GPU:
            self.drop_gpu(op.adapter_id)
        else:
            self.drop_host(op.adapter_id)

    # ------------------------------------------------------------------ steps

    def begin_step(self, rows: StepRows, dense_lane: int | None = None) -> bool:
        """Sets the step's delta rows from its token runs ``(variant id, n_tokens)`` in batch order and
        the variant id of each logits row (ids not in this pool count as "no delta"); returns whether
        the step has delta tokens (False: nothing was set). ``dense_lane``: a resident delta whose
        tokens run in the dense lane instead of the work tiles (``dense_lane_for``; a captured mixed
        step's path, run eagerly where capture is off)."""
        logit_ids, decode, self.step.rows = rows.logit_ids, rows.decode, rows
        runs = [(v, n) for v, n in rows.runs if n > 0]
        if not any(v in self.slot_of for v, _ in runs):
            self.end_step()
            return False
        dev = self.device
        token_slot: list[int] = []
        for v, n in runs:
            token_slot.extend([self.slot_of.get(v, -1)] * n)
        embed_slot: list[int] = []
        for v, n in runs:
            embed_slot.extend([self._piece_slot(v, self.embed_piece)] * n)
        logit_slot = [self.slot_of.get(v, -1) for v in logit_ids]
        # From pinned memory: a pageable copy would wait for the step still running (overlapped steps).
        self.step.token_index = host_to_device(torch.tensor(token_slot, dtype=torch.int64) + 1, dev)
        self.step.logit_index = host_to_device(torch.tensor(logit_slot, dtype=torch.int64) + 1, dev)
        self.step.embed_index = host_to_device(torch.tensor(embed_slot, dtype=torch.int64) + 1, dev)
        lens = [n for _, n in runs]
        piece_metas: list[tuple[tuple[ConfigKey, DeltaMeta], ...]] = [()] * self.num_pieces
        for pieces, per_key in self._piece_rows([0 if v == dense_lane else v for v, _ in runs]):
            metas = tuple(
                (key, DeltaMeta.rows(at, dev, max_block_m=self.tile_cap) if decode
                 else DeltaMeta.segments(lens, at, dev, self.tile_cap, self.dense_min_m))
                for key, at in per_key
            )  # fmt: skip
            for p in pieces:
                piece_metas[p] = metas
        self.step.piece_metas = piece_metas
        self.step.head_meta = DeltaMeta.rows(self._head_rows(logit_ids), dev, max_block_m=HEAD_TILE)
        if dense_lane is not None:
            key = self.key_of[dense_lane]
            others = torch.tensor([v != dense_lane for v, n in runs for _ in range(n)], dtype=torch.bool)
            offsets = host_to_device(self._lane_offsets(dense_lane), dev)
            self.step.dense_lane = DenseLane.over(key, host_to_device(others, dev)[:, None], self._lane_linears(key),
                                                  offsets, self._scratch())  # fmt: skip
        return True

    # ------------------------------------------------------------------ the dense lane (``delta_graphs``)

    def dense_lane_for(self, runs: Sequence[tuple[int, int]], bucket: int) -> int | None:
        """The resident delta whose tokens a captured step of token runs ``runs`` in a ``bucket``-token
        graph runs in its dense lane: the one with the most tokens, if it has at least
        ``dense_lane_tokens(bucket)`` and a piece at every layer (a partial zoo delta stays on the
        tiles: the lane runs every linear); else None."""
        counts: dict[int, int] = {}
        for v, n in runs:
            if v in self.slot_of:
                counts[v] = counts.get(v, 0) + n
        if not counts:
            return None
        lane = max(counts, key=counts.__getitem__)
        if counts[lane] < dense_lane_tokens(bucket) or min(self.piece_slots[lane][: self.num_pieces]) < 0:
            return None
        return lane

    def _lane_linears(self, key: ConfigKey) -> list[tuple[int, str]]:
        """The (layer, proj) of config ``key``'s pools, in the order of the lane's offsets rows."""
        return sorted(self.step.weights[key])

    def _lane_offsets(self, delta_id: int) -> torch.Tensor:
        """The resident delta's ``_offsets_at`` its pieces' block slots (cached while it is resident)."""
        rows = self._lane_rows.get(delta_id)
        if rows is None:
            rows = self._lane_rows[delta_id] = self._offsets_at(self.key_of[delta_id], self.piece_slots[delta_id])
        return rows

    def _offsets_at(self, key: ConfigKey, at: Sequence[int]) -> torch.Tensor:
        """``[linears, 3]`` int64 on the host: the (qvalues, qindices, group) offsets in each linear of config
        ``key``'s pools (``_lane_linears`` order) of block slot ``at[piece]`` of the linear's piece."""
        pools = self.step.weights[key]
        table = []
        for layer, proj in self._lane_linears(key):
            w = pools[(layer, proj)]
            table.append([offs[at[piece_index(layer, part_of(self.config, proj))]] for offs in w.slot_offsets])
        return torch.tensor(table, dtype=torch.int64)

    def _scratch(self) -> torch.Tensor:
        """The lane's scratch (``lane_scratch``), made with the first pools (``_config_pools``)."""
        if self.lane_scratch is None:
            size = max(w.out_features * w.in_features for pools in self.step.weights.values() for w in pools.values())
            self.lane_scratch = torch.empty(size, dtype=self.dtype, device=self.device)
        return self.lane_scratch

    def _piece_slot(self, variant_id: int, p: int) -> int:
        """The block slot of the variant's piece ``p``; -1 when it has none (or is not a resident delta)."""
        at = self.piece_slots.get(variant_id)
        return -1 if at is None else at[p]

    def _piece_rows(self, ids: Sequence[int]) -> list[tuple[list[int], list[tuple[ConfigKey, list[int]]]]]:
        """For runs (or rows) of variant ids ``ids``: the piece indices grouped so that every index of a
        group maps each run to the same block slot (``delta_blocks.group_pieces``), each group with, per
        packed config used there, each run's block slot (-1: not a delta of that config, or a delta with
        no piece there). Groups where no run has a piece are left out."""
        variants = sorted({v for v in ids if v in self.slot_of})
        out = []
        for signature, pieces in group_pieces(self.piece_slots, variants, self.num_pieces).items():
            at = dict(zip(variants, signature))
            keys = sorted({self.key_of[v] for v, s in at.items() if s >= 0})
            per_key = [(key, [at.get(v, -1) if self.key_of.get(v) == key else -1 for v in ids]) for key in keys]
            if per_key:
                out.append((pieces, per_key))
        return out

    def _head_rows(self, ids: Sequence[int]) -> list[int]:
        """Each logits row's lm_head block slot (rows of variant ids ``ids``) where its delta changes
        lm_head, else -1: rows of deltas sharing the lm_head delta are one group."""
        return [self._piece_slot(v, self.head_piece) for v in ids]

    def end_step(self) -> None:
        """Back to inactive: the delta-aware modules compute their base alone."""
        self.step.piece_metas = []
        self.step.head_meta = None
        self.step.dense_lane = None
        self.step.token_index = self.step.logit_index = self.step.embed_index = None

    # ------------------------------------------------------------------ CUDA graphs (``delta_graphs``)

    def graphable(self, keys: Sequence[ConfigKey]) -> bool:
        """Whether decode steps of packed configs ``keys`` can be captured: the CUDA SBMM op runs here
        (``tile_cap``) and takes every linear of those configs (their work tiles of ``GRAPH_TILE`` tokens
        are the CUDA op's only), and the dtype is one it takes."""
        if self.tile_cap is None or self.dtype not in (torch.float16, torch.bfloat16):
            return False
        return all(self._config_graphable(key) for key in keys)

    def _config_graphable(self, key: ConfigKey) -> bool:
        """``graphable`` of one config, judged once its pools exist (they never change after: each step
        asked it again for every linear, ~0.1 ms of the launching thread a delta step)."""
        known = self._graphable.get(key)
        if known is not None:
            return known
        pools = self.step.weights.get(key)
        if not pools:
            return False
        x = torch.empty(0, 0, dtype=self.dtype, device=self.device)
        self._graphable[key] = ok = not any(cuda_shape_problem(x, w) for w in pools.values())
        return ok

    def graph_tiles(self, b: int, cap: int) -> int:
        """Rows of a captured step's tile table (its launches' grid): the most work tiles of ``cap`` tokens
        ``b`` rows can make, one partial tile at most per slot (eager decode metadata has ``b`` rows, most of
        them padding blocks that launch and exit)."""
        return min(b, self.max_deltas + b // cap)

    def graph_keys(self, delta_ids: Sequence[int]) -> tuple[ConfigKey, ...]:
        """The packed configs a decode step of rows ``delta_ids`` (variant ids; others count as none)
        uses: the delta part of its graph's key."""
        return tuple(sorted({self.key_of[v] for v in delta_ids if v in self.slot_of}))

    def _graph_buffers(
        self, max_batch: int, keys: Sequence[ConfigKey], max_logits: int | None = None
    ) -> DeltaGraphRows:
        """The static buffers of decode graphs (``max_logits`` None) or of mixed-step graphs, (re)made for
        ``max_batch`` rows (and ``max_logits`` logits rows); per-config ones added as configs appear."""
        g = self.graph_rows if max_logits is None else self.mixed_rows
        if g is None or g.max_batch != max_batch or g.max_logits != max_logits:
            g = DeltaGraphRows(self.device, self.num_pieces, max_batch, self.graph_tiles, max_logits)
            if max_logits is None:
                self.graph_rows = g
            else:
                self.mixed_rows = g
        g.add_keys(keys)
        return g

    @contextmanager
    def graph_state(self, b: int, max_batch: int, keys: Sequence[ConfigKey]) -> Iterator[None]:
        """While a decode bucket of ``b`` rows is captured: the step reads the static buffers (configs
        ``keys``, one metadata per piece), with no delta row yet (slot -1 everywhere); inactive after."""
        with self._static_state(self._graph_buffers(max_batch, keys), b, b, keys):
            yield

    @contextmanager
    def mixed_graph_state(
        self,
        tokens: int,
        logits: int,
        max_tokens: int,
        max_logits: int,
        keys: Sequence[ConfigKey],
        lane_key: ConfigKey | None = None,
    ) -> Iterator[None]:
        """While a prefill / mixed bucket of ``tokens`` tokens and ``logits`` logits rows is captured: as
        ``graph_state``, over the mixed steps' buffers, each token a row of the SBMM metadata; with a dense
        lane for a delta of config ``lane_key`` when given (``delta_graphs``)."""
        g = self._graph_buffers(max_tokens, keys, max_logits)
        with self._static_state(g, tokens, logits, keys):
            if lane_key is not None:  # no row in the lane yet: block slot 0 (each replay writes its delta's)
                self.step.dense_lane = g.lane(tokens, lane_key, self._lane_linears(lane_key), self._scratch())
                slot0 = self._offsets_at(lane_key, [0] * (self.num_pieces + 2))
                g.write_lane(tokens, [False] * tokens, lane_key, slot0)
            yield

    @contextmanager
    def _static_state(self, g: DeltaGraphRows, b: int, logits: int, keys: Sequence[ConfigKey]) -> Iterator[None]:
        """The step reads ``g``'s first ``b`` rows and ``logits`` logits rows (all padding for now)."""
        self._write_rows(g, b, [0] * b, keys, None if g.max_logits is None else [0] * logits)
        self.step.token_index = g.index[:b]
        self.step.logit_index = g.logit_index[:logits]  # decode: the row index itself
        self.step.embed_index = g.embed_index[:b]
        self.step.piece_metas = [
            tuple((key, g.static(g.metas[key], b, GRAPH_TILE, p)) for key in keys) for p in range(self.num_pieces)
        ]
        self.step.head_meta = g.static(g.head, logits, HEAD_TILE)
        try:
            yield
        finally:
            self.end_step()

    def fill_graph_rows(self, delta_ids: Sequence[int], b: int, keys: Sequence[ConfigKey]) -> None:
        """Writes a decode step's rows (variant id per row, ``len <= b``; padding up to ``b``) into the
        static buffers a graph captured with ``graph_state(b, .., keys)`` reads."""
        g = self.graph_rows
        assert g is not None and all(k in g.metas for k in keys), "graph_state first"
        self._write_rows(g, b, list(delta_ids) + [0] * (b - len(delta_ids)), keys)

    def fill_mixed_rows(
        self,
        token_ids: Sequence[int],
        logit_ids: Sequence[int],
        keys: Sequence[ConfigKey],
        dense_lane: int | None = None,
    ) -> None:
        """Writes a prefill / mixed step's variant id per token of its bucket and per logits row of it
        (padding included: 0) into the buffers a graph captured with ``mixed_graph_state`` reads; with
        ``dense_lane`` (a delta id; the graph was captured with its config as ``lane_key``) its tokens go
        to the lane, not the work tiles."""
        g = self.mixed_rows
        assert g is not None and all(k in g.metas for k in keys), "mixed_graph_state first"
        ids = list(token_ids)
        tile_ids = ids if dense_lane is None else [0 if v == dense_lane else v for v in ids]
        self._write_rows(g, len(ids), ids, keys, list(logit_ids), tile_ids)
        if dense_lane is not None:
            key = self.key_of[dense_lane]
            assert key in g.lane_offsets, "mixed_graph_state with the lane's config first"
            g.write_lane(len(ids), [v == dense_lane for v in ids], key, self._lane_offsets(dense_lane))

    def _write_rows(
        self,
        g: DeltaGraphRows,
        b: int,
        ids: list[int],
        keys: Sequence[ConfigKey],
        logit_ids: list[int] | None = None,
        tile_ids: list[int] | None = None,
    ) -> None:
        """Row index, each config's per-piece tiles and the lm_head's tiles of rows ``ids`` (variant ids);
        ``logit_ids``: the logits rows' variant ids where they are not the rows themselves (mixed steps);
        ``tile_ids``: the rows' ids for the work tiles where they differ (a dense lane's rows are 0)."""
        slots = [self.slot_of.get(v, -1) for v in ids]
        logit_slots = None if logit_ids is None else [self.slot_of.get(v, -1) for v in logit_ids]
        g.write_index(b, slots, [self._piece_slot(v, self.embed_piece) for v in ids], logit_slots)
        by_key: dict[ConfigKey, list[tuple[list[int], list[int]]]] = {key: [] for key in keys}
        for pieces, per_key in self._piece_rows(ids if tile_ids is None else tile_ids):
            for key, at in per_key:
                by_key.setdefault(key, []).append((pieces, at))
        for key in keys:
            g.write_pieces(key, b, GRAPH_TILE, by_key[key])
        head_ids = ids if logit_ids is None else logit_ids
        g.write_head(len(head_ids), self._head_rows(head_ids), HEAD_TILE)

    def wait_gpu(self, variant_ids: Collection[int]) -> None:
        """Makes the step's stream wait for the copies of those of ``variant_ids`` still loading beside
        the steps (a step the router admitted with its delta's ``to_gpu``, nothing else to run)."""
        self.loads.wait([v for v in variant_ids if v in self.slot_of])

    def take_gpu_ready(self) -> list[int]:
        """Deltas whose ``to_gpu`` copies finished since the last call (``StepOutput.gpu_ready``)."""
        return self.loads.take_ready()

    def close(self) -> None:
        self.loads.close()
        self.host.close()


__all__ = ["DeltaError", "DeltaHostCopy", "DeltaPlacements", "DeltaPool", "GRAPH_TILE", "HEAD_TILE", "delta_gpu_bytes"]


def _config_key(manifest: dict[str, Any]) -> ConfigKey:
    """A delta's packed config (bits, 2:4 or not, group size) from its validated manifest."""
    comp = manifest["compression"]
    return (int(comp["bits"]), comp["sparsity"] == "2:4", int(comp["group_size"]))
