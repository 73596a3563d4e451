"""Delta-aware modules inside ``DecoderLM``: the base computation once, plus each token's delta.

DeltaZip's decoupled forward (§5.1): a variant served as a compressed delta (``deltaserve
compress``) is ``W_base + Δ̃`` for every tensor it changed, and ``W_base + Δ̃`` is never built.
``attach_deltas(model, step)`` wraps, once at start-up:

    block linears (qkv_proj, o_proj, gate_up_proj, down_proj; LoRA-wrapped or plain) -> DeltaLinear
        out = inner(x)                                     base (+ LoRA): once for the whole batch
        for each delta config of the step:
            kernels.sbmm.sbmm_stacked(x, out, slices, meta)  out[t, slice] += x[t] Δ̃_{d(t)}^T, packed,
                                                            every HF slice (q|k|v, gate|up) in one call;
                                                            d(t) = the block slot of t's delta at this
                                                            layer's part (``delta_blocks``): rows of
                                                            deltas sharing the block are one group
        the step's dense lane, if any (captured mixed steps; ``DenseLane``):
            out[:, slice] += (x, its rows zeroed but the lane's) @ dequantize_at(pool, lane.offsets)^T
        out[:, slice] += bias_table[index]                  dense bias deltas (Qwen2's qkv biases)
    model.embed_tokens -> DeltaEmbedding   out += embed_table[d(t) * V + ids]   (a zero row for no delta)
    layer norms        -> DeltaRMSNorm     out[r] = norm(x)[r] * (w + norm_table[index[r]])  (HF's order;
                                                                           gathered in the norm kernel)
    model.norm         -> DeltaRMSNorm over the logits rows (the final norm runs on them only)
    lm_head            -> DeltaLmHead      out[r] += x[r] Δhead_{d(r)}^T   (kernels.dense_delta; tied:
                                                                           the embedding delta)

Every per-token delta is a gather from a slot-indexed table or a kernel over the step's metadata
tensors: no op's shape depends on which rows have which delta. So a decode step with deltas can be
captured in a CUDA graph over static copies of ``DeltaStep``'s tensors (``DeltaPool.graph_state``)
and replayed for any rows and slots, as base-only and LoRA steps are.

``DeltaStep`` (set by ``DeltaPool.begin_step``, cleared by ``end_step``) says which tokens and which
logits rows belong to which delta slot, and holds the slot-indexed pools: ``weights[config]
[(layer, proj)]`` (``kernels.sbmm.DeltaWeights``, one per packed config) and ``tables`` (``DeltaTables``:
the dense deltas, one table per tensor with a row block per slot). While ``step.active`` is False
every wrapper is exactly the module it wraps: no extra op.

The wrappers adopt the wrapped module's Parameters (same tensors), like ``LoraLinear``: parameter
names, ``state_dict`` and the tied lm_head stay those of the plain model. A wrapped LoRA linear is
called through ``DeltaLinear.inner`` (kept out of the module tree, so it is not a child).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.dense_delta import dense_delta_rows
from ..kernels.rmsnorm import RowDelta
from ..kernels.sbmm import DeltaMeta, DeltaWeights, dequantize_at, sbmm_stacked
from ..model.decoder import DecoderLM, RMSNorm, linear_slots
from .delta_blocks import part_of, piece_index
from .lora import hf_module_name
from .variants import StepRows

ConfigKey = tuple[int, bool, int]
"""(bits, 2:4 sparse, group size): one ``DeltaWeights`` pool per linear and per key."""


@dataclass
class DeltaTables:
    """The dense deltas of every slot (owned and filled by ``DeltaPool``; zeros where a delta has none).

    Row blocks are indexed by slot so one gather serves every row of a step: ``norms`` / ``biases`` by
    ``DeltaStep.token_index`` (slot + 1; row 0 is zeros: no delta), ``embed`` by ``slot * vocab + token``
    (its last row is zeros: no delta), ``head`` by the SBMM-style work tiles of ``DeltaStep.head_meta``;
    ``embed`` and ``head`` by *block* slot (``DeltaStep.embed_index``; ``delta_blocks``): a delta's
    embedding or lm_head delta that another resident delta shares is held once.
    """

    norms: dict[str, torch.Tensor] = field(default_factory=dict)
    """RMSNorm weight name -> ``[slots + 1, hidden]``."""
    biases: dict[str, torch.Tensor] = field(default_factory=dict)
    """Linear bias name (``model.layers.{i}.self_attn.q_proj.bias``) -> ``[slots + 1, out]``."""
    embed: torch.Tensor | None = None
    """``[slots * vocab + 1, hidden]``: slot s's embedding delta at rows ``s * vocab ..``; None until the
    first delta is loaded."""
    head: torch.Tensor | None = None
    """``[slots, vocab, hidden]``: each slot's lm_head delta (tied embeddings: a view of ``embed``)."""


@dataclass
class DenseLane:
    """One delta of a captured mixed step that runs dense instead of on the SBMM work tiles: per linear its
    delta is dequantised once into ``scratch`` from the slot offsets the step wrote into ``offsets``
    (``kernels.sbmm.dequantize_at``: a device-side slot), and one matmul over the step's rows, masked to
    its tokens, adds ``x[t] Δ̃^T`` to them (other rows add an exact 0). What the eager step's dense
    segments compute (one dequantisation, fp32 accumulation, one rounding), with shapes fixed by the
    bucket. ``DeltaPool`` owns the buffers and says which delta takes the lane (``dense_lane_for``); its
    tokens are in no work tile."""

    key: ConfigKey
    """The packed config of the lane's delta (fixed at capture: which pools the lane reads)."""
    others: torch.Tensor
    """[T, 1] bool: the rows that are *not* the lane delta's tokens (the ones its matmuls zero)."""
    offsets: dict[tuple[int, str], torch.Tensor]
    """(layer, HF proj) -> [3] int64 on the device: the lane delta's (qvalues, qindices, group) offsets in
    that linear's pool (its block slot at the linear's piece)."""
    scratch: torch.Tensor
    """1-D, the model dtype: room for the widest linear's dense delta."""

    @classmethod
    def over(
        cls,
        key: ConfigKey,
        others: torch.Tensor,
        linears: Sequence[tuple[int, str]],
        offsets: torch.Tensor,
        scratch: torch.Tensor,
    ) -> DenseLane:
        """The lane whose offsets are the rows of ``offsets`` (``[linears, 3]`` int64 on the device), one
        per (layer, proj) of ``linears`` in that order."""
        return cls(key, others, dict(zip(linears, offsets.unbind(0))), scratch)

    def add(self, x: torch.Tensor, out: torch.Tensor, slices: list[tuple[DeltaWeights, int, tuple[int, str]]]) -> None:
        """``out[:, col : col + w.out_features] += (x masked) @ Δ̃^T`` for every ``(w, col, (layer, proj))``
        of ``slices`` (a module's HF linears in the lane's pools)."""
        xm = x.masked_fill(self.others, 0)  # masked_fill, not a product: a padding row's inf stays out
        for w, col, at in slices:
            n, k = w.out_features, w.in_features
            d = dequantize_at(w, self.offsets[at], x.dtype, self.scratch[: n * k].view(n, k))
            out[:, col : col + n].addmm_(xm, d.t())


class DeltaStep:
    """The current step's delta rows and the slot-indexed delta pools (module docstring)."""

    def __init__(self) -> None:
        self.piece_metas: list[tuple[tuple[ConfigKey, DeltaMeta], ...]] = []
        """Per piece ``2 * layer + part`` (``delta_blocks``: part 0 the attention linears, 1 the FFN's),
        per packed config used there: SBMM metadata over all T tokens, each token at the block slot its
        delta's piece holds (other tokens slot -1); empty where no token has a piece."""
        self.head_meta: DeltaMeta | None = None
        """Metadata over the logits rows whose delta changes lm_head (others slot -1): the lm_head delta's
        work tiles (``kernels.dense_delta``)."""
        self.token_index: torch.Tensor | None = None
        """[T] int64 on the device: slot + 1 of each token of the step (0: no delta). None: inactive."""
        self.logit_index: torch.Tensor | None = None
        """[logits rows] int64: the same for the logits rows."""
        self.embed_index: torch.Tensor | None = None
        """[T] int64: the block slot + 1 of each token's embedding delta (0: none; ``delta_blocks``:
        deltas sharing an embedding delta hold it once)."""
        self.weights: dict[ConfigKey, dict[tuple[int, str], DeltaWeights]] = {}
        """Config -> (layer, HF proj) -> the packed pool (owned by ``DeltaPool``, filled in place)."""
        self.tables = DeltaTables()
        """The dense deltas by slot (owned by ``DeltaPool``, filled in place)."""
        self.dense_lane: DenseLane | None = None
        """The step's dense lane (captured mixed steps with a long prompt of one delta), or None."""
        self.rows: StepRows | None = None
        """The rows of the last ``DeltaPool.begin_step`` (kept after it: ``block_speculation`` begins
        the step again when a delta lands mid-forward)."""

    @property
    def active(self) -> bool:
        """True when the current step has delta tokens (its modules add the deltas)."""
        return self.token_index is not None


class DeltaLinear(nn.Linear):
    """A block linear (maybe LoRA-wrapped) plus each token's packed delta (module docstring)."""

    inner: nn.Linear
    """The wrapped linear (set with ``object.__setattr__``: not a child module)."""

    def __init__(
        self, inner: nn.Linear, step: DeltaStep, layer: int, piece: int, slices: list[tuple[str, int, int]]
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.weight = inner.weight
        self.register_parameter("bias", inner.bias)
        object.__setattr__(self, "inner", inner)  # not a child: its Parameters are ours already
        self.step = step
        self.layer = layer
        """Layer index: the key of this module's pools."""
        self.piece = piece
        """``2 * layer + part``: which of ``step.piece_metas`` its rows read."""
        self.slices = slices
        """(HF proj, first output column, width) of each HF linear the module holds."""
        self.bias_names = [f"{hf_module_name(layer, p)}.bias" for p, _, _ in slices]
        """Dense delta name of each slice's bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        step = self.step
        token_index = step.token_index
        if token_index is None:  # inactive
            return out
        for key, meta in step.piece_metas[self.piece]:
            pools = step.weights[key]
            slices = [(w, start) for proj, start, _ in self.slices if (w := pools.get((self.layer, proj))) is not None]
            if slices:
                sbmm_stacked(x, out, slices, meta)
        lane = step.dense_lane
        if lane is not None:
            pools = step.weights[lane.key]
            lane.add(x, out, [(pools[at], start, at) for proj, start, _ in self.slices
                              if (at := (self.layer, proj)) in lane.offsets])  # fmt: skip
        for (_, start, size), name in zip(self.slices, self.bias_names):
            table = step.tables.biases.get(name)
            if table is not None:
                out[:, start : start + size] += table.index_select(0, token_index)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, delta_slices={self.slices}"


class DeltaEmbedding(nn.Embedding):
    """Token embeddings plus each token's dense embedding delta (one gather for every row)."""

    NAME = "model.embed_tokens.weight"

    def __init__(self, inner: nn.Embedding, step: DeltaStep) -> None:
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = inner.num_embeddings, inner.embedding_dim
        self.padding_idx, self.max_norm, self.sparse = inner.padding_idx, None, False
        self.norm_type, self.scale_grad_by_freq = 2.0, False
        self.weight = inner.weight
        self.step = step

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight)
        table = self.step.tables.embed
        index = self.step.embed_index
        if index is not None and table is not None:  # active, with an embedding delta table
            vocab = self.num_embeddings
            rows = torch.where(index > 0, (index - 1) * vocab + ids, table.shape[0] - 1)  # last row: zeros
            out += table.index_select(0, rows)
        return out


class DeltaRMSNorm(RMSNorm):
    """RMSNorm whose weight is ``w + Δw_d`` for the rows of delta ``d`` (HF's ``weight * x_normed``)."""

    def __init__(self, inner: RMSNorm, step: DeltaStep, name: str, logits: bool) -> None:
        nn.Module.__init__(self)
        self.weight = inner.weight
        self.eps = inner.eps
        self.unit_offset = inner.unit_offset
        self.step = step
        self.name = name
        """HF tensor name of the weight, e.g. ``model.layers.3.input_layernorm.weight``."""
        self.logits = logits
        """True for the final norm, which runs on the logits rows only."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, row_delta: RowDelta | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.step.active or row_delta is not None:
            return super().forward(x, residual, row_delta)
        # Row r: norm(x)[r] with weight w + Δw_{d(r)}; Δw is the zero row without a delta: the base
        # norm's value. ``RMSNorm`` applies a per-row weight in its own convention (Gemma's 1 + w);
        # Llama's gathers and adds it in the norm kernel (one launch, as the base norm).
        index = self.step.logit_index if self.logits else self.step.token_index
        assert index is not None  # active: both are set
        return super().forward(x, residual, (self.step.tables.norms[self.name], index))


class DeltaLmHead(nn.Linear):
    """lm_head plus each logits row's dense delta (the embedding delta when weights are tied)."""

    def __init__(self, inner: nn.Linear, step: DeltaStep, name: str) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.weight = inner.weight
        self.register_parameter("bias", inner.bias)
        self.step = step
        self.name = name
        """Delta tensor name: ``lm_head.weight``, or ``model.embed_tokens.weight`` when tied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        step = self.step
        if step.active and step.head_meta is not None and step.tables.head is not None:
            dense_delta_rows(x, out, step.tables.head, step.head_meta)
        return out


def _layer_norms(layer: nn.Module) -> list[str]:
    """Paths of a layer's RMSNorms (input / post-attention, Gemma's feed-forward norms, q/k norms)."""
    return [path for path, m in layer.named_modules() if isinstance(m, RMSNorm) and path]


def norm_delta_names(model: DecoderLM) -> set[str]:
    """The RMSNorm weight names ``attach_deltas`` wraps (``DeltaTables.norms``' keys)."""
    names = {"model.norm.weight"}
    for i, layer in enumerate(model.model.layers):
        names.update(f"model.layers.{i}.{path}.weight" for path in _layer_norms(layer))
    return names


def dense_delta_names(model: DecoderLM) -> set[str]:
    """Every dense tensor name a delta may change in ``model`` (what ``attach_deltas`` applies)."""
    cfg = model.config
    names = {DeltaEmbedding.NAME} | norm_delta_names(model)
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    slots = linear_slots(cfg)
    for i, layer in enumerate(model.model.layers):
        for proj, s in slots.items():
            if layer.get_submodule(s.module).bias is not None:
                names.add(f"{hf_module_name(i, proj)}.bias")
    return names


def attach_deltas(model: DecoderLM, step: DeltaStep) -> None:
    """Wraps ``model``'s linears, embedding, norms and lm_head so they add ``step``'s deltas.

    Call after ``attach_lora`` (a LoRA-wrapped linear is wrapped again). Raises ValueError if
    deltas are attached already.
    """
    if isinstance(model.model.embed_tokens, DeltaEmbedding):
        raise ValueError("attach_deltas: the model already has deltas attached")
    cfg = model.config
    for name, table in step.tables.norms.items():  # q/k norms (Qwen3, Gemma 3) are head_dim wide
        width = model.get_parameter(name).shape[0]
        if table.shape[1] != width:
            step.tables.norms[name] = table.new_zeros(table.shape[0], width)
    by_module: dict[str, list[tuple[str, int, int]]] = {}
    for proj, s in linear_slots(cfg).items():
        by_module.setdefault(s.module, []).append((proj, s.start, s.size))
    for i, layer in enumerate(model.model.layers):
        for module_path, slices in by_module.items():
            parent_path, _, leaf = module_path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            piece = piece_index(i, part_of(cfg, slices[0][0]))
            setattr(parent, leaf, DeltaLinear(getattr(parent, leaf), step, i, piece, slices))
        for path in _layer_norms(layer):  # the names of norm_delta_names
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path) if parent_path else layer
            norm = DeltaRMSNorm(getattr(parent, leaf), step, f"model.layers.{i}.{path}.weight", False)
            setattr(parent, leaf, norm)
    backbone = model.model
    backbone.embed_tokens = DeltaEmbedding(backbone.embed_tokens, step)
    backbone.norm = DeltaRMSNorm(backbone.norm, step, "model.norm.weight", logits=True)
    head_name = DeltaEmbedding.NAME if cfg.tie_word_embeddings else "lm_head.weight"
    model.lm_head = DeltaLmHead(model.lm_head, step, head_name)
