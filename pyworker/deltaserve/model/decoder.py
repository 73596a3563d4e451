"""``DecoderLM``: the one decoder for every Llama-family architecture in ``arch.ARCH_TABLE``.

Per step (a ``ForwardBatch`` of ragged sequences over a ``PagedKVCache``)::

    h = embed_tokens(input_ids)                               [T, hidden]
    cos, sin = rope(positions)                                float32, then model dtype (as HF)
    for each layer:
        x = input_layernorm(h)                                RMSNorm in float32
        q, k, v = q_proj(x), k_proj(x), v_proj(x)             (+ bias for Qwen2 / attention_bias)
        q, k = rotate(q, k, cos, sin)                         HF rotate_half convention
        write_kv(k, v -> cache slots)                         then attend over the paged context
        h = h + o_proj(paged_attention(q, cache))
        h = h + down_proj(silu(gate_proj(x')) * up_proj(x'))  x' = post_attention_layernorm(h)
    logits = lm_head(norm(h[logits_indices])).float()         [S, vocab]

Module names match HF (``model.layers.N.self_attn.q_proj`` ...) so checkpoints load by name, and
every projection is called through its module, so adapter wrappers (LoRA, deltas) can replace
any of them without this file knowing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ModelConfig
from .attention import AttentionMeta, attention_metadata, paged_attention_ref, write_kv
from .batch import ForwardBatch
from .kv_cache import PagedKVCache


class RMSNorm(nn.Module):
    """HF-identical RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim / 2] in float32 on CPU, with llama3 / linear scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {scaling['rope_type']!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """q/k/v/o projections, RoPE, KV write and paged attention for one layer."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        meta: AttentionMeta,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        write_kv(k, v, cache_k, cache_v, batch.slot_mapping)
        out = paged_attention_ref(q, cache_k, cache_v, batch, self.scale, meta=meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        meta: AttentionMeta,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, meta, cache_k, cache_v)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBackbone(nn.Module):
    """The ``model.`` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DecoderLM(nn.Module):
    """Generic Llama-family causal LM over a paged KV cache (module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBackbone(cfg, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.tie_weights()
        # Plain attribute, not a buffer: survives meta-device construction and is never in checkpoints.
        self._inv_freq_cpu = rope_inv_freq(cfg)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def tie_weights(self) -> None:
        """Make lm_head share the embedding matrix."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim], computed in float32 then cast to ``dtype`` (as HF)."""
        device = positions.device
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq[device] = self._inv_freq_cpu.to(device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

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
        h = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rope(batch.positions, h.dtype)
        meta = attention_metadata(batch, kv.block_size, self.config.sliding_window)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, batch, meta, kv.k[i], kv.v[i])
        h = self.model.norm(h[batch.logits_indices])
        return self.lm_head(h).float()
