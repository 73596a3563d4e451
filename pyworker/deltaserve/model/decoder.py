"""``DecoderLM``: the one decoder for every architecture in ``arch.ARCH_TABLE``.

Per step (a ``ForwardBatch`` of ragged sequences over a ``PagedKVCache``)::

    h = embed_tokens(input_ids) [* sqrt(hidden): Gemma]; residual = None     [T, hidden]
    rope = rope_tables(max_seq_len)                      rope.py: one cos/sin table per RoPE kind
    for each layer l:
        x, residual = add_rmsnorm(h, residual)           kernels.rmsnorm: residual += h; x = norm(residual)
        q | k | v = qkv_proj(x)                          one matmul (+ bias for Qwen2 / attention_bias)
        q, k = q_norm(q), k_norm(k)                      per head (Qwen3, Gemma 3)
        rotary_embedding(rope rows, q, k, table of l)    kernels.rope: in place, HF rotate_half convention,
        write_kv(k, v -> cache slots)                    one launch for both; then attend over the paged context with l's
        h = o_proj(paged_attention(q, cache))            window, scale and soft-cap (attention.py)
        Llama-style:  x, residual = add_rmsnorm(h, residual)              post_attention_layernorm
                      h = down_proj(act(gate) * up)                       act: silu | gelu_tanh
        Gemma-style:  h = post_attention_layernorm(h)                     sandwich norms
                      x, residual = pre_feedforward_layernorm(h, residual)
                      h = post_feedforward_layernorm(down_proj(act(gate) * up))
    logits = lm_head(norm(h + residual)[logits_indices])   [S, vocab]; Gemma: cap * tanh(logits / cap)

The small ops are ``deltaserve.kernels`` entry points: Triton on CUDA, their torch references (HF's
numerics) elsewhere, so the CPU path stays the reference. Gemma's norms (``norm.RMSNorm`` with
``unit_offset``) and GeGLU are torch ops on every device.

Fused projections: ``self_attn.qkv_proj`` holds HF's q_proj, k_proj, v_proj stacked along its output
rows (``QKV_SLICES``, biases likewise) and ``mlp.gate_up_proj`` holds gate_proj, up_proj
(``GATE_UP_SLICES``). Both are plain ``nn.Linear``. ``linear_slots(cfg)`` says, for each HF linear
name of the architecture table, which module and which output rows hold it (Phi-3's checkpoint
has ``qkv_proj`` / ``gate_up_proj`` themselves: one slot covering the whole module); the loader,
the HF view of ``state_dict`` and adapter wrappers (LoRA's multi-slice expand) all read it, so no
one else knows the stacking. ``DecoderLM.state_dict()`` / ``load_state_dict()`` speak HF's
checkpoint names (the fused tensors appear as row views ``...self_attn.q_proj.weight``...), while
``named_parameters()`` shows the fused modules. Every projection is called through its module,
so wrappers can replace any of them without this file knowing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.rope import rotary_embedding_write_kv
from ..kernels.silu_mul import silu_and_mul
from .arch import ModelConfig
from .attention import AttentionMeta, attention_metadata, paged_attention
from .batch import ForwardBatch
from .kv_cache import PagedKVCache
from .norm import RMSNorm
from .rope import GLOBAL, LOCAL, RopeTables, rope_cos_sin_cache, rope_inv_freq

__all__ = [
    "GATE_UP_SLICES",
    "QKV_SLICES",
    "Attention",
    "DecoderBackbone",
    "DecoderLM",
    "DecoderLayer",
    "LayerGate",
    "LinearSlot",
    "MLP",
    "RMSNorm",
    "Stream",
    "linear_slots",
    "rope_cos_sin_cache",
    "rope_inv_freq",
]

QKV_SLICES = ("q_proj", "k_proj", "v_proj")
"""HF projections stacked, in this order, along the output rows of ``self_attn.qkv_proj``."""
GATE_UP_SLICES = ("gate_proj", "up_proj")
"""HF projections stacked, in this order, along the output rows of ``mlp.gate_up_proj``."""
_LAYER_LINEARS = (
    ("self_attn.qkv_proj", QKV_SLICES),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", GATE_UP_SLICES),
    ("mlp.down_proj", ("down_proj",)),
)
"""Each ``nn.Linear`` of a ``DecoderLayer`` (path inside the layer) and the HF linears it holds."""


class LinearSlot(NamedTuple):
    """Where one HF linear of a block lives in a ``DecoderLayer``."""

    module: str
    """Path of the ``nn.Linear`` inside the layer, e.g. ``"self_attn.qkv_proj"``."""
    start: int
    """First output row (and bias entry) of this HF linear in that module."""
    size: int
    """Output rows of this HF linear (its ``out_features`` in HF)."""


def linear_slots(cfg: ModelConfig) -> dict[str, LinearSlot]:
    """HF linear name (every name of ``cfg.arch.linear_names``) -> the module and output rows holding it.

    The HF module of name ``n`` is ``<parent of slot.module>.n`` (``self_attn.k_proj``), its
    weight ``[slot.size, in]`` is rows ``[slot.start, slot.start + slot.size)`` of the module's.
    """
    rows = {
        "q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size, "o_proj": cfg.hidden_size,
        "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size,
    }  # fmt: skip
    fused_in_checkpoint = set(cfg.arch.linear_names)
    slots: dict[str, LinearSlot] = {}
    for module, names in _LAYER_LINEARS:
        leaf = module.rpartition(".")[2]
        if leaf in fused_in_checkpoint:  # Phi-3: the checkpoint's own qkv_proj / gate_up_proj
            slots[leaf] = LinearSlot(module, 0, sum(rows[name] for name in names))
            continue
        start = 0
        for name in names:
            slots[name] = LinearSlot(module, start, rows[name])
            start += rows[name]
    unknown = set(cfg.arch.linear_names) - set(slots)
    if unknown:
        raise ValueError(f"{cfg.architecture}: linear(s) {sorted(unknown)} have no slot in DecoderLayer")
    return {name: slots[name] for name in cfg.arch.linear_names}


def linear_in_features(cfg: ModelConfig) -> dict[str, int]:
    """HF linear name (every name of ``linear_slots(cfg)``) -> its input width."""
    by_module = {
        "self_attn.qkv_proj": cfg.hidden_size, "self_attn.o_proj": cfg.q_size,
        "mlp.gate_up_proj": cfg.hidden_size, "mlp.down_proj": cfg.intermediate_size,
    }  # fmt: skip
    return {name: by_module[slot.module] for name, slot in linear_slots(cfg).items()}


def embed_scale(cfg: ModelConfig, dtype: torch.dtype) -> float | None:
    """Gemma's embedding multiplier ``sqrt(hidden)`` rounded to ``dtype`` (as HF rounds it); else None."""
    if not cfg.arch.scale_embeddings:
        return None
    return float(torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(dtype))


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in ``x``'s dtype (HF's order of operations)."""
    return torch.tanh(x / cap) * cap


class Attention(nn.Module):
    """Fused qkv projection, q/k norms, RoPE, KV write, paged attention and o projection for one layer."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None, layer: int = 0) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.scale
        self.q_size = cfg.q_size
        self.kv_size = cfg.kv_size
        self.window = cfg.window_of(layer)
        """This layer's sliding window (None: full causal)."""
        self.softcap = cfg.attn_softcap
        """Attention-score soft-cap (Gemma 2), or None."""
        self.rope = LOCAL if cfg.uses_local_rope(layer) else GLOBAL
        """Which ``RopeTables`` table rotates this layer's q and k."""
        # Rows: q_proj | k_proj | v_proj (QKV_SLICES, linear_slots).
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.arch.qk_norm:
            gemma = cfg.arch.gemma_norms
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, unit_offset=gemma)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, unit_offset=gemma)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables | torch.Tensor,
        batch: ForwardBatch,
        meta: AttentionMeta,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> torch.Tensor:
        """``rope``: the step's ``RopeTables`` (or, for single-table models, that one table)."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)  # strided views into the qkv output
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(rope, torch.Tensor):
            table, rows = rope, batch.positions
        else:
            table, rows = rope.tables[self.rope], rope.positions(batch, meta.step_cache)
        rotary_embedding_write_kv(rows, q, k, v, table, cache_k, cache_v, batch.slot_mapping)  # q, k in place
        out = paged_attention(
            q, cache_k, cache_v, batch, self.scale, meta=meta, sliding_window=self.window, softcap=self.softcap
        )
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), gate and up as one fused matmul.

    ``act``: silu (SwiGLU, ``kernels.silu_mul``) or gelu_pytorch_tanh (GeGLU, Gemma; torch ops).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        # Rows: gate_proj | up_proj (GATE_UP_SLICES, linear_slots).
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    """Pre-norm block over a split residual stream: the stream is ``h + residual``.

    Each norm that opens a sub-layer adds the previous sub-layer's output ``h`` into ``residual``
    (fused with the norm); the first layer gets ``residual=None`` and starts the stream from the
    embeddings. With sandwich norms (Gemma) the attention and MLP outputs are normalised too.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None, layer: int = 0) -> None:
        super().__init__()
        gemma = cfg.arch.gemma_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, unit_offset=gemma)
        self.self_attn = Attention(cfg, dtype, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, unit_offset=gemma)
        self.sandwich = cfg.arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, unit_offset=gemma)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, unit_offset=gemma)
        self.mlp = MLP(cfg, dtype)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables | torch.Tensor,
        batch: ForwardBatch,
        meta: AttentionMeta,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(h, residual)``: this layer's MLP output and the stream before it."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, rope, batch, meta, cache_k, cache_v)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(x), residual
        h = self.post_attention_layernorm(h)
        x, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class DecoderBackbone(nn.Module):
    """The ``model.`` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        # Uninitialised (weights come from a checkpoint or random_model): nn.Embedding's own
        # normal_ init on the meta device imports torch._dynamo, ~2 s of every worker's start.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, unit_offset=cfg.arch.gemma_norms)


Stream = tuple[torch.Tensor, torch.Tensor | None]
"""The residual stream between layers: ``(h, residual)`` (``residual`` None before layer 0)."""


class LayerGate(Protocol):
    """Called before each layer of an eager forward while set (``DecoderLM.layer_gate``), and once
    more before the final norm (``layer == num_layers``): may wait, rerun layers through
    ``run_layer(j, stream)`` (which rewrites layer ``j``'s KV) and return the stream to go on from
    (``adapters/block_speculation.py``: surrogate blocks while a delta's blocks load)."""

    def before(self, layer: int, stream: Stream, run_layer: Callable[[int, Stream], Stream]) -> Stream: ...


class DecoderLM(nn.Module):
    """Generic decoder-only causal LM over a paged KV cache (module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBackbone(cfg, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.tie_weights()
        # A plain attribute, not buffers: survives meta-device construction, never in checkpoints.
        self._rope: dict[tuple[torch.device, torch.dtype], RopeTables] = {}
        self.layer_gate: LayerGate | None = None
        """Consulted between layers by eager forwards while set (``LayerGate``); None: not at all."""
        self.register_state_dict_post_hook(_split_fused_state_dict)
        self.register_load_state_dict_pre_hook(_join_fused_state_dict)

    def tie_weights(self) -> None:
        """Make lm_head share the embedding matrix."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rope_tables(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> RopeTables:
        """The RoPE tables (``rope.RopeTables``) covering at least positions [0, num_positions).

        Built once per (device, dtype) for ``max_position_embeddings`` positions; rebuilt (new
        tensors, at least twice as long) only when a step reaches past their end.
        """
        key = (device, dtype)
        rope = self._rope.get(key)
        if rope is None or rope.num_positions < num_positions:
            n = max(self.config.max_position_embeddings, num_positions)
            if rope is not None:
                n = max(n, 2 * rope.num_positions)
            rope = self._rope[key] = RopeTables.build(self.config, n, device, dtype)
        return rope

    def cos_sin_cache(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The full-attention layers' table of ``rope_tables`` (single-table models: every layer's)."""
        return self.rope_tables(num_positions, device, dtype).tables[GLOBAL]

    def checkpoint_layout(self) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        """HF checkpoint tensor name -> (parameter name, first row in it, the HF tensor's shape).

        One entry per parameter as ``named_parameters(remove_duplicate=False)`` lists them (so a
        tied ``lm_head.weight`` appears), with each fused parameter expanded into its HF tensors
        (``linear_slots``). Unfused parameters map to themselves at row 0.
        """
        fused: dict[str, list[tuple[str, int, int]]] = {}
        for name, slot in linear_slots(self.config).items():
            parent = slot.module.rpartition(".")[0]
            for leaf in ("weight", "bias"):
                fused.setdefault(f"{slot.module}.{leaf}", []).append((f"{parent}.{name}.{leaf}", slot.start, slot.size))
        layout: dict[str, tuple[str, int, tuple[int, ...]]] = {}
        for pname, p in self.named_parameters(remove_duplicate=False):
            parts = pname.split(".", 3)  # model, layers, N, <path inside the layer>
            inner = parts[3] if len(parts) == 4 and parts[:2] == ["model", "layers"] else None
            if inner in fused:
                layer = ".".join(parts[:3])
                for hf_inner, start, size in fused[inner]:
                    layout[f"{layer}.{hf_inner}"] = (pname, start, (size, *p.shape[1:]))
            else:
                layout[pname] = (pname, 0, tuple(p.shape))
        return layout

    def check_cache(self, kv: PagedKVCache) -> None:
        cfg = self.config
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(
                f"KV cache shape (layers={kv.num_layers}, kv_heads={kv.num_kv_heads}, head_dim={kv.head_dim}) "
                f"does not match the model ({cfg.num_layers}, {cfg.num_kv_heads}, {cfg.head_dim})"
            )

    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run one step; returns float32 logits [S, vocab] for ``batch.logits_indices`` rows."""
        self.check_cache(kv)
        cfg = self.config
        h = self.model.embed_tokens(batch.input_ids)
        scale = embed_scale(cfg, h.dtype)
        if scale is not None:
            h = h * scale
        rope = self.rope_tables(batch.max_seq_len, h.device, h.dtype)
        meta = attention_metadata(batch, kv.block_size, cfg.sliding_window)
        residual = None
        gate = self.layer_gate
        if gate is None:
            for i, layer in enumerate(self.model.layers):
                h, residual = layer(h, residual, rope, batch, meta, kv.k[i], kv.v[i])
        else:
            layers = self.model.layers

            def run_layer(j: int, stream: Stream) -> Stream:
                return layers[j](stream[0], stream[1], rope, batch, meta, kv.k[j], kv.v[j])

            stream: Stream = (h, None)
            for i in range(len(layers)):
                stream = run_layer(i, gate.before(i, stream, run_layer))
            h, residual = gate.before(len(layers), stream, run_layer)
        rows = batch.logits_indices
        if residual is None:
            h = self.model.norm(h[rows])
        else:
            h, _ = self.model.norm(h[rows], residual[rows])
        logits = self.lm_head(h)
        if cfg.final_softcap is not None:
            logits = softcap(logits, cfg.final_softcap)
        return logits.float()


def _fused_parts(model: DecoderLM, prefix: str) -> dict[str, list[tuple[str, int, int]]]:
    """Fused parameter key (with ``prefix``) -> its HF keys and rows, from ``checkpoint_layout``."""
    parts: dict[str, list[tuple[str, int, int]]] = {}
    for hf_name, (pname, start, shape) in model.checkpoint_layout().items():
        if hf_name != pname:
            parts.setdefault(prefix + pname, []).append((prefix + hf_name, start, shape[0]))
    return parts


def _split_fused_state_dict(model: DecoderLM, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    """``state_dict`` post-hook: each fused tensor becomes its HF tensors (row views), in place and in order."""
    parts = _fused_parts(model, prefix)
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        pieces = parts.get(key)
        if pieces is None:
            state_dict[key] = value
            continue
        for hf_key, start, size in pieces:
            state_dict[hf_key] = value[start : start + size]


def _join_fused_state_dict(model: DecoderLM, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: HF tensors are concatenated into the fused ones they make up.

    A fused tensor some of whose HF parts are absent is left alone: strict loading then reports
    the fused key as missing and the present parts as unexpected.
    """
    for key, hf_parts in _fused_parts(model, prefix).items():
        if key not in state_dict and all(hf_key in state_dict for hf_key, _, _ in hf_parts):
            state_dict[key] = torch.cat([state_dict.pop(hf_key) for hf_key, _, _ in hf_parts])
