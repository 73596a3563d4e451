"""Block slots: each distinct piece of the GPU-resident deltas held once, in a slot of its own layer.

A delta's packed linears come in *pieces*, one per (layer, part): part 0 the attention linears
(q, k, v, o), part 1 the FFN linears (gate, up, down), a block zoo's components ``layers.{i}.attn``
and ``layers.{i}.mlp`` (``deltaserve.zoo.blocks``). Piece ``p = 2 * layer + part``; then the dense
embedding delta (``2 * layers``) and the untied lm_head delta (``2 * layers + 1``), whose block slots
are row blocks of their tables (``delta_layers.DeltaTables``). Norm and bias deltas (a vector per
layer) stay in the rows of the delta's own slot.

Per-block batching (BlockLLM §4.1): two deltas that hold the same piece (two zoo variants sharing an
own block; a second fine-tune made from the first) hold it once on the GPU, in one slot of that
layer's arenas, and every row of either runs it in one group of the layer's SBMM call. So the slot a
row uses is per piece, not per delta: ``BlockSlots`` keeps, per piece index, which slot holds which
piece and how many resident deltas use it (refcount); a delta's rows use ``slots[v][p]`` at piece
``p`` (-1 where the delta has no piece there: it runs the base alone, no SBMM work).

Identity of a piece: the payload file(s) its tensors were read from (device, inode, size,
modification time) and its packed config. A zoo variant's payload files are hard links to the zoo's
block files (``zoo add``), so two variants sharing a block name the same inode; a block file is
written once and replaced, never changed in place (``os.replace``), so the same inode with the same
size and time holds the same bytes. A compressed payload (one file) or a payload whose files cannot
be stat'ed identifies its pieces by the host copy alone (shared with nobody).

``DELTASERVE_DELTA_PIECE_SHARING=off`` (default ``on``) identifies every piece by its host copy alone:
every delta is held, copied and computed on its own, as DeltaZip serves distinct fine-tunes. For
benchmarks whose variants link a few payload files to spare disk (bench/serving/variants.py): with
sharing on, 32 variants over 4 payloads would load and run as 4 deltas, not the 32 they stand for.

Slot choice: the delta's own slot (the router's ``VariantOp.slot``) where it is free at that piece,
else the lowest free one. A free slot always exists: the router keeps at most N deltas resident and
each holds at most one piece per index, so at most N - 1 distinct pieces are held there when one more
delta arrives. GPU memory is therefore what the worker reserves for N slots (``delta_slots``)
whatever the sharing: the router's one-slot-per-delta accounting stays a bound, and sharing saves the
bytes read and the work done per step, and the copies made at load.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..formats.packed_delta import PackedLinear, pack
from ..model.arch import ModelConfig
from ..model.decoder import linear_slots

SHARING_ENV = "DELTASERVE_DELTA_PIECE_SHARING"
"""``on`` (default) or ``off``: whether pieces read from the same payload files are shared (module docstring)."""

ATTN, MLP = 0, 1
"""Part of a layer: the attention linears, the FFN linears."""
_MODULE_RE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.")


def part_of(cfg: ModelConfig, proj: str) -> int:
    """``ATTN`` or ``MLP``: the part of a layer the HF projection ``proj`` belongs to."""
    return ATTN if linear_slots(cfg)[proj].module.startswith("self_attn.") else MLP


def piece_index(layer: int, part: int) -> int:
    return 2 * layer + part


def dense_pieces(cfg: ModelConfig) -> tuple[int, int]:
    """(embedding piece, lm_head piece): ``2 * layers`` and ``2 * layers + 1``, the latter the
    embedding's when the head is tied to it (its delta is the embedding's)."""
    embed = 2 * cfg.num_layers
    return embed, embed if cfg.tie_word_embeddings else embed + 1


def dense_piece_names(cfg: ModelConfig) -> dict[str, int]:
    """The dense deltas held as pieces (a block slot of rows in their table), by tensor name."""
    embed, head = dense_pieces(cfg)
    return {"model.embed_tokens.weight": embed, **({} if cfg.tie_word_embeddings else {"lm_head.weight": head})}


def piece_sharing() -> bool:
    """Whether pieces of the same payload files are shared (``DELTASERVE_DELTA_PIECE_SHARING``: on, off)."""
    value = os.environ.get(SHARING_ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{SHARING_ENV}={value!r}: want on or off")
    return value == "on"


def payload_identities(delta_dir: Path, files: Sequence[str], codec: str, cfg: ModelConfig) -> dict[int, Hashable]:
    """Piece index -> identity of the payload file(s) holding its packed tensors (module docstring);
    ``{}`` where files cannot identify pieces (a compressed payload; a file that cannot be read),
    and the caller then gives each piece an identity of its own; also ``{}`` for every payload when
    ``DELTASERVE_DELTA_PIECE_SHARING=off``."""
    if codec != "none" or not piece_sharing():
        return {}
    proj_part = {proj: part_of(cfg, proj) for proj in linear_slots(cfg)}
    dense = dense_piece_names(cfg)
    found: dict[int, set[tuple[int, int, int, int]]] = {}
    try:
        for name in files:
            path = delta_dir / name
            st = os.stat(path)
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            with safe_open(str(path), framework="pt") as f:
                tensors = list(f.keys())
            for t in tensors:
                m = _MODULE_RE.match(t)
                if m is not None and m.group(2) in proj_part:
                    found.setdefault(piece_index(int(m.group(1)), proj_part[m.group(2)]), set()).add(ident)
                elif t in dense:
                    found.setdefault(dense[t], set()).add(ident)
    except (OSError, ValueError, RuntimeError):
        return {}  # the load itself reports what is wrong with the payload
    return {p: tuple(sorted(ids)) for p, ids in found.items()}


@functools.cache
def zero_delta(key: tuple[int, bool, int], features: tuple[int, int]) -> PackedLinear:
    """A packed delta of config ``key`` (bits, 2:4, group) that is exactly zero, for a linear of (in, out)
    ``features``: what a partial delta (``manifest["partial"]``) stores for a linear it leaves to the
    base in a piece it has (the piece's slot then holds every linear of it)."""
    bits, sparse, group = key
    in_f, out_f = features
    mask = torch.tensor([True, True, False, False]).repeat(out_f, in_f // 4) if sparse else None
    groups = torch.zeros(out_f, in_f // group)
    return pack(torch.zeros(out_f, in_f, dtype=torch.int32), mask, groups, groups, bits, group)


@dataclass
class _Held:
    identity: Hashable
    users: int


class BlockSlots:
    """Which slot holds which piece, per piece index, and how many resident deltas use it (module
    docstring). Pure bookkeeping: the pool stores and clears the slots' bytes."""

    def __init__(self, num_pieces: int, max_slots: int) -> None:
        self.num_pieces, self.max_slots = num_pieces, max_slots
        self.held: list[dict[int, _Held]] = [{} for _ in range(num_pieces)]
        """Piece index -> slot -> the piece it holds."""
        self.slot_of_identity: list[dict[Hashable, int]] = [{} for _ in range(num_pieces)]
        """Piece index -> identity -> its slot."""

    def acquire(self, p: int, identity: Hashable, preferred: int) -> tuple[int, bool]:
        """The slot of piece ``identity`` at index ``p`` and whether it is new there (the caller stores
        it): an already held one gains a user; else ``preferred`` if free, else the lowest free slot."""
        slot = self.slot_of_identity[p].get(identity)
        if slot is not None:
            self.held[p][slot].users += 1
            return slot, False
        held = self.held[p]
        if preferred in held:
            free = [s for s in range(self.max_slots) if s not in held]
            if not free:
                raise ValueError(f"piece {p}: all {self.max_slots} block slots are held")
            preferred = free[0]
        held[preferred] = _Held(identity, 1)
        self.slot_of_identity[p][identity] = preferred
        return preferred, True

    def release(self, p: int, slot: int) -> bool:
        """One user fewer of the piece in ``slot`` at ``p``; True when it has none left (the caller
        clears the slot)."""
        h = self.held[p][slot]
        h.users -= 1
        if h.users > 0:
            return False
        del self.held[p][slot]
        del self.slot_of_identity[p][h.identity]
        return True

    def held_counts(self) -> list[int]:
        """Per piece index, the distinct pieces held (what the GPU holds, each once)."""
        return [len(h) for h in self.held]


def group_pieces(
    slots_of: dict[int, tuple[int, ...]], variants: Iterable[int], num_pieces: int
) -> dict[tuple[int, ...], list[int]]:
    """Piece indices grouped by the slots ``variants`` use there (``slots_of[v][p]``), so one row
    mapping (and one SBMM metadata) serves every index of a group: signature -> indices."""
    vs = list(variants)
    groups: dict[tuple[int, ...], list[int]] = {}
    for p in range(num_pieces):
        groups.setdefault(tuple(slots_of[v][p] for v in vs), []).append(p)
    return groups
