"""Delta-aware modules inside ``DecoderLM``: the base computation once, plus each token's delta.

DeltaZip's decoupled forward (§5.1): a variant served as a compressed delta (``deltaserve
compress``) is ``W_base + Δ̃`` for every tensor it changed, and ``W_base + Δ̃`` is never built.
``attach_deltas(model, step)`` wraps, once at start-up:

    block linears (qkv_proj, o_proj, gate_up_proj, down_proj; LoRA-wrapped or plain) -> DeltaLinear
        out = inner(x)                                         base (+ LoRA): once for the whole batch
        for each delta config of the step, each HF slice (q|k|v, gate|up, ...) of the module:
            kernels.sbmm.sbmm(x, out[:, slice], weights, meta) out[t, slice] += x[t] Δ̃_{d(t)}^T, packed
        out[rows of slot d, slice] += Δbias_d                  dense bias deltas (Qwen2's qkv biases)
    model.embed_tokens -> DeltaEmbedding    out[rows of d] += Δembed_d[ids]            dense fp16 delta
    layer norms        -> DeltaRMSNorm      out[r] = norm(x)[r] * (w + Δw_{d(r)})  (HF's order; one gather)
    model.norm         -> DeltaRMSNorm over the logits rows (the final norm runs on them only)
    lm_head            -> DeltaLmHead       out[rows of d] += x[rows] Δhead_d^T       (tied: Δembed_d)

``DeltaStep`` (set by ``DeltaPool.begin_step``, cleared by ``end_step``) says which tokens and which
logits rows belong to which delta slot, and holds the slot-indexed pools: ``weights[config]
[(layer, proj)]`` (``kernels.sbmm.DeltaWeights``, one per packed config) and ``dense[slot]`` (HF
tensor name -> delta in the model dtype, on the device). While ``step.active`` is False every
wrapper is exactly the module it wraps: no extra op.

The wrappers adopt the wrapped module's Parameters (same tensors), like ``LoraLinear``: parameter
names, ``state_dict`` and the tied lm_head stay those of the plain model. A wrapped LoRA linear is
called through ``DeltaLinear.inner`` (kept out of the module tree, so it is not a child).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from ..kernels.sbmm import DeltaMeta, DeltaWeights, sbmm
from ..model.decoder import DecoderLM, RMSNorm, linear_slots
from .lora import hf_module_name

ConfigKey = tuple[int, bool, int]
"""(bits, 2:4 sparse, group size): one ``DeltaWeights`` pool per linear and per key."""


class DeltaStep:
    """The current step's delta rows and the slot-indexed delta pools (module docstring)."""

    def __init__(self) -> None:
        self.metas: tuple[tuple[ConfigKey, DeltaMeta], ...] = ()
        """Per packed config used this step: SBMM metadata over all T tokens (other tokens slot -1)."""
        self.token_rows: dict[int, torch.Tensor] = {}
        """Slot -> indices (int64, on the device) of the step's tokens that use it."""
        self.logit_rows: dict[int, torch.Tensor] = {}
        """Slot -> indices of the logits rows (sampled positions) that use it."""
        self.weights: dict[ConfigKey, dict[tuple[int, str], DeltaWeights]] = {}
        """Config -> (layer, HF proj) -> the packed pool (owned by ``DeltaPool``, filled in place)."""
        self.dense: list[dict[str, torch.Tensor]] = []
        """Slot -> HF tensor name -> dense delta in the model dtype (owned by ``DeltaPool``)."""
        self.norm_tables: dict[str, torch.Tensor] = {}
        """Norm weight name -> ``[slots + 1, hidden]`` table: row 0 zeros (no delta), row s + 1 slot s's
        delta of that norm (zeros where it has none). ``DeltaPool`` keeps it in step with ``dense``, so a
        delta step's norm gathers every row's delta at once instead of one update per slot."""
        self.token_index: torch.Tensor | None = None
        """[T] int64 on the device: slot + 1 of each token of the step (0: no delta): rows of ``norm_tables``."""
        self.logit_index: torch.Tensor | None = None
        """[logits rows] int64: the same for the logits rows."""

    @property
    def active(self) -> bool:
        """True when some token of the current step uses a delta."""
        return bool(self.token_rows)

    def dense_rows(self, name: str, logits: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(rows, delta)`` for each slot of the step whose delta changes tensor ``name``."""
        rows_of = self.logit_rows if logits else self.token_rows
        out = []
        for slot, rows in rows_of.items():
            d = self.dense[slot].get(name)
            if d is not None:
                out.append((rows, d))
        return out


class DeltaLinear(nn.Linear):
    """A block linear (maybe LoRA-wrapped) plus each token's packed delta (module docstring)."""

    def __init__(self, inner: nn.Linear, step: DeltaStep, layer: int, slices: list[tuple[str, int, int]]) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.weight = inner.weight
        self.register_parameter("bias", inner.bias)
        object.__setattr__(self, "inner", inner)  # not a child: its Parameters are ours already
        self.step = step
        self.layer = layer
        """Layer index: the key of this module's pools."""
        self.slices = slices
        """(HF proj, first output column, width) of each HF linear the module holds."""
        self.bias_names = [f"{hf_module_name(layer, p)}.bias" for p, _, _ in slices]
        """Dense delta name of each slice's bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        step = self.step
        if not step.active:
            return out
        for key, meta in step.metas:
            pools = step.weights[key]
            for proj, start, size in self.slices:
                w = pools.get((self.layer, proj))
                if w is not None:
                    sbmm(x, out[:, start : start + size], w, meta)
        for (_, start, size), name in zip(self.slices, self.bias_names):
            for rows, d in step.dense_rows(name):
                out[rows, start : start + size] += d
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, delta_slices={self.slices}"


class DeltaEmbedding(nn.Embedding):
    """Token embeddings plus each token's dense embedding delta."""

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
        if self.step.active:
            for rows, d in self.step.dense_rows(self.NAME):
                out[rows] += d[ids[rows]]
        return out


class DeltaRMSNorm(RMSNorm):
    """RMSNorm whose weight is ``w + Δw_d`` for the rows of delta ``d`` (HF's ``weight * x_normed``)."""

    def __init__(self, inner: RMSNorm, step: DeltaStep, name: str, logits: bool) -> None:
        nn.Module.__init__(self)
        self.weight = inner.weight
        self.eps = inner.eps
        self.step = step
        self.name = name
        """HF tensor name of the weight, e.g. ``model.layers.3.input_layernorm.weight``."""
        self.logits = logits
        """True for the final norm, which runs on the logits rows only."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        deltas = self.step.dense_rows(self.name, self.logits) if self.step.active else []
        if not deltas:
            return super().forward(x, residual)
        ones = torch.ones_like(self.weight)
        if residual is None:
            normed = rmsnorm(x, ones, self.eps)  # 1 * x_normed: exact
        else:
            normed, residual = fused_add_rmsnorm(x, residual, ones, self.eps)
        # Row r: normed[r] * (w + Δw_{d(r)}), Δw = 0 without a delta: one gather for every slot.
        index = self.step.logit_index if self.logits else self.step.token_index
        out = normed * (self.weight + self.step.norm_tables[self.name].index_select(0, index))
        return out if residual is None else (out, residual)


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
        if self.step.active:
            for rows, d in self.step.dense_rows(self.name, logits=True):
                out[rows] += x[rows] @ d.T
        return out


def norm_delta_names(model: DecoderLM) -> set[str]:
    """The RMSNorm weight names ``attach_deltas`` wraps (``DeltaStep.norm_tables``' keys)."""
    names = {"model.norm.weight"}
    for i in range(len(model.model.layers)):
        names.add(f"model.layers.{i}.input_layernorm.weight")
        names.add(f"model.layers.{i}.post_attention_layernorm.weight")
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
    by_module: dict[str, list[tuple[str, int, int]]] = {}
    for proj, s in linear_slots(cfg).items():
        by_module.setdefault(s.module, []).append((proj, s.start, s.size))
    for i, layer in enumerate(model.model.layers):
        for module_path, slices in by_module.items():
            parent_path, _, leaf = module_path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            setattr(parent, leaf, DeltaLinear(getattr(parent, leaf), step, i, slices))
        for norm in ("input_layernorm", "post_attention_layernorm"):  # the names of norm_delta_names
            setattr(layer, norm, DeltaRMSNorm(getattr(layer, norm), step, f"model.layers.{i}.{norm}.weight", False))
    backbone = model.model
    backbone.embed_tokens = DeltaEmbedding(backbone.embed_tokens, step)
    backbone.norm = DeltaRMSNorm(backbone.norm, step, "model.norm.weight", logits=True)
    head_name = DeltaEmbedding.NAME if cfg.tie_word_embeddings else "lm_head.weight"
    model.lm_head = DeltaLmHead(model.lm_head, step, head_name)
