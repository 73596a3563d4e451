"""GPU storage of the delta slots, sized once: what the worker reserves is what it allocates.

The router picks every delta's slot (``VariantOp.slot``) and keeps at most ``--max-deltas`` N deltas
on the GPU; the worker leaves ``reserve_bytes`` out of the KV pool for them (``worker/memory.py``).
Deltas come in several packed configs (bits x 2:4-or-dense x group size) and the kernels take one
pool per config and linear (``kernels.sbmm.DeltaWeights``). So that N slots take the same bytes
whatever mix of configs fills them, every config's pool of a linear is a view of one arena::

    arena[(layer, proj)]   uint8 [N * S]     S = slot bytes of the linear: the packed bytes of a 4-bit,
                                             dense, 64-column-group delta of it, rounded up to 16
    slot s of a delta of config K, at byte s * S, back to back:
        qvalues int32 [out, kept*bits/32]  qindices int32 [out, kept/16] (2:4 only)  scales, zeros float16 [out, in/G]
    K's DeltaWeights: qvalues and qindices = the arena as int32, scales = the arena as float16,
        zeros = the same shifted by one scales block; per-slot offsets from the layout above

A slot holds a delta of any config that fits S (``fits``): every 4-bit or 2-bit delta, 2:4 or dense,
with groups of 64 columns or more (``deltaserve compress``'s default is 4-bit 2:4, groups of 64), and
smaller groups as far as the bytes allow; inspection refuses a delta that does not fit.

The dense deltas (embedding, lm_head, norms, biases; ``delta_layers.DeltaTables``) take N slots in the
model dtype from the first ``to_gpu``, whatever the configs: ``reserve_bytes`` counts them too.
"""

from __future__ import annotations

import torch

from ..formats.packed_delta import PackedLinear
from ..kernels.sbmm import DeltaWeights
from ..model.arch import ModelConfig
from ..model.decoder import DecoderLM, linear_slots
from .delta_layers import ConfigKey, dense_delta_names
from .lora import projection_features

SLOT_BITS = 4
"""Bits per code of the layout a slot is sized for."""
SLOT_GROUP = 64
"""Input columns per (scale, zero) of the layout a slot is sized for (dense: every column kept)."""
ALIGN = 16
"""Bytes every slot starts on (the CUDA op copies 16-byte pieces)."""


def packed_bytes(bits: int, sparse: bool, group_size: int, out_features: int, in_features: int) -> int:
    """Bytes of one linear's packed delta in ``deltaserve.formats.packed_delta``'s layout (groups rounded up)."""
    kept = in_features // 2 if sparse else in_features
    qvalues = out_features * kept * bits // 8
    qindices = out_features * (kept // 16) * 4 if sparse else 0
    groups = out_features * -(-in_features // group_size)
    return qvalues + qindices + 2 * 2 * groups  # float16 scales and zeros


def slot_bytes(out_features: int, in_features: int) -> int:
    """S: the bytes one slot of a linear takes (module docstring)."""
    size = packed_bytes(SLOT_BITS, False, SLOT_GROUP, out_features, in_features)
    return -(-size // ALIGN) * ALIGN


def dense_table_bytes(model: DecoderLM, dtype: torch.dtype, max_deltas: int) -> int:
    """Bytes of the dense delta tables for ``max_deltas`` slots (``DeltaPool`` allocates exactly these)."""
    cfg = model.config
    n, item = max_deltas, torch.empty((), dtype=dtype).element_size()
    rows = n * cfg.vocab_size + 1  # the embedding table (tied: lm_head is a view of it)
    if not cfg.tie_word_embeddings:
        rows += n * cfg.vocab_size
    elems = rows * cfg.hidden_size
    slots = linear_slots(cfg)
    for name in dense_delta_names(model):
        if name.endswith(".bias"):
            elems += (n + 1) * slots[name.split(".")[-2]].size
        elif name.endswith("norm.weight"):
            elems += (n + 1) * cfg.hidden_size
    return elems * item


def reserve_bytes(model: DecoderLM, dtype: torch.dtype, max_deltas: int) -> int:
    """GPU bytes ``max_deltas`` delta slots take: the packed arenas plus the dense tables, and the dense
    lane's scratch (one dequantised linear, ``DeltaPool.lane_scratch``) once there are slots."""
    cfg = model.config
    packed = sum(slot_bytes(o, i) for i, o in projection_features(cfg).values()) * cfg.num_layers
    item = torch.empty((), dtype=dtype).element_size()
    scratch = max(o * i for i, o in projection_features(cfg).values()) * item if max_deltas > 0 else 0
    return max_deltas * packed + dense_table_bytes(model, dtype, max_deltas) + scratch


def delta_gpu_bytes(
    cfg: ModelConfig, dtype: torch.dtype, bits: int = 4, sparse: bool = True, group_size: int = 64
) -> int:
    """GPU bytes of one delta of ``cfg`` in the given packed config, as if alone (every block linear
    packed, plus dense embedding, lm_head (untied) and norm deltas in the model dtype): its own size,
    not the slot it takes (``reserve_bytes``)."""
    linears = sum(packed_bytes(bits, sparse, group_size, o, i) for i, o in projection_features(cfg).values())
    item = torch.empty((), dtype=dtype).element_size()
    dense = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    dense += cfg.hidden_size * (2 * cfg.num_layers + 1)
    return linears * cfg.num_layers + dense * item


class DeltaSlots:
    """The packed linears' slots: one arena per block linear, and each config's pools as views of them."""

    def __init__(self, cfg: ModelConfig, max_deltas: int, device: torch.device) -> None:
        self.max_deltas = max_deltas
        """N: slots per arena."""
        self.device = device
        self.features = projection_features(cfg)
        """HF proj -> (in_features, out_features)."""
        self.num_layers = cfg.num_layers
        self.slot_bytes = {proj: slot_bytes(o, i) for proj, (i, o) in self.features.items()}
        """HF proj -> S, the bytes of one slot of its arenas."""
        self.arenas: dict[tuple[int, str], torch.Tensor] = {}
        """(layer, HF proj) -> uint8 [N * S]; allocated with the first config's pools."""

    def fits(self, bits: int, sparse: bool, group_size: int) -> str | None:
        """Why a delta of this packed config cannot take a slot, or None."""
        for proj, (i, o) in self.features.items():
            need = packed_bytes(bits, sparse, group_size, o, i)
            if need > self.slot_bytes[proj]:
                kind = "2:4" if sparse else "dense"
                return (
                    f"its {bits}-bit {kind} packing with groups of {group_size} takes {need} bytes for {proj}, "
                    f"more than a delta slot's {self.slot_bytes[proj]} (slots hold up to {SLOT_BITS}-bit deltas "
                    f"with groups of {SLOT_GROUP} columns or more; compress it with --group-size {SLOT_GROUP})"
                )
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of the arenas allocated so far (all of them once any delta went to the GPU)."""
        return sum(a.nbytes for a in self.arenas.values())

    def pools(self, key: ConfigKey, like: dict[tuple[int, str], PackedLinear]) -> dict[tuple[int, str], DeltaWeights]:
        """Config ``key``'s pool of every linear (N slots, all empty) over the arenas, which are
        allocated now if this is the first config; ``like`` is one delta of that config (its shapes)."""
        bits, sparse, group = key
        pools = {}
        for (layer, proj), p in like.items():
            arena = self.arenas.get((layer, proj))
            if arena is None:
                arena = torch.zeros(self.max_deltas * self.slot_bytes[proj], dtype=torch.uint8, device=self.device)
                self.arenas[(layer, proj)] = arena
            pools[(layer, proj)] = self._views(arena, self.slot_bytes[proj], bits, sparse, group, p)
        return pools

    def _views(
        self, arena: torch.Tensor, size: int, bits: int, sparse: bool, group: int, p: PackedLinear
    ) -> DeltaWeights:
        """A ``DeltaWeights`` of N empty slots whose slot s is bytes [s * size, ...) of ``arena``."""
        out, inf = p.out_features, p.in_features
        kept = inf // 2 if sparse else inf
        qv = out * kept * bits // 8
        qi = out * (kept // 16) * 4 if sparse else 0
        group_elems = out * (inf // group)
        starts = torch.arange(self.max_deltas, dtype=torch.int64, device=self.device) * size
        as_i32, as_f16 = arena.view(torch.int32), arena.view(torch.float16)
        return DeltaWeights(
            qvalues=as_i32, qindices=as_i32 if sparse else as_i32[:0], scales=as_f16, zeros=as_f16[group_elems:],
            qvalues_offsets=starts // 4, qindices_offsets=(starts + qv) // 4, group_offsets=(starts + qv + qi) // 2,
            bits=bits, sparse=sparse, group_size=group, out_features=out, in_features=inf,
            loaded=[False] * self.max_deltas,
        )  # fmt: skip
