"""RoPE frequencies and the per-position cos/sin tables the decoder's layers rotate q and k with.

What differs between families is all here, as data read from ``ModelConfig``:

- plain, ``linear`` and ``llama3`` scaling: one table ``cat(cos(p * inv_freq), sin(p * inv_freq))``;
- LongRoPE (Phi-3 / 3.5, ``rope_type`` "longrope" or "su"): two frequency sets (short and long
  factors) and a cos/sin scale (``attention_factor``). As transformers does, a token uses the long
  set when its sequence is longer than ``original_max_position_embeddings`` at this step (its
  ``seq_lens`` entry), the short set otherwise. The table then holds both sets (short rows
  ``[0, P)``, long rows ``[P, 2P)``) and such a token is rotated with row ``P + position``;
- Gemma 3: its sliding-window layers use a second table (``local_rope_theta``).

Every table is computed in float32 on CPU-identical arithmetic and cast to the model dtype (HF's
rotary embedding does the same), so ``kernels.rope`` gathers one row per token whatever the family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .arch import ModelConfig
from .batch import ForwardBatch

GLOBAL = "global"
"""Table of the full-attention layers (and of every layer unless the model has a local RoPE)."""
LOCAL = "local"
"""Table of Gemma 3's sliding-window layers."""


def rope_inv_freq(cfg: ModelConfig, local: bool = False, long: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim / 2] in float32 on CPU (transformers' arithmetic).

    ``local``: the sliding-window layers' RoPE (Gemma 3); ``long``: LongRoPE's long factors.
    """
    theta, scaling = (cfg.local_rope_theta, cfg.local_rope_scaling) if local else (cfg.rope_theta, cfg.rope_scaling)
    assert theta is not None
    dim = cfg.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta**exponent)
    inv_freq = 1.0 / (theta**exponent)
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


def rope_cos_sin_cache(
    inv_freq: torch.Tensor, num_positions: int, dtype: torch.dtype, attention_scaling: float = 1.0
) -> torch.Tensor:
    """``kernels.rope``'s table [num_positions, head_dim]: ``cat(cos(p * inv_freq), sin(p * inv_freq))``.

    Computed in float32 on ``inv_freq``'s device (times ``attention_scaling``, LongRoPE's), then cast
    to ``dtype``: the values HF's rotary embedding produces for position p.
    """
    freqs = torch.arange(num_positions, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return torch.cat((cos, sin), dim=-1).to(dtype)


def _longrope(scaling: dict[str, Any] | None) -> bool:
    return scaling is not None and scaling["rope_type"] == "longrope"


@dataclass
class RopeTables:
    """The cos/sin tables of one model on one (device, dtype), covering ``num_positions`` positions."""

    tables: dict[str, torch.Tensor]
    """``GLOBAL`` (and ``LOCAL`` for Gemma 3) -> ``[P, D]``, or ``[2P, D]`` with LongRoPE (short | long)."""
    num_positions: int
    """P: positions each frequency set covers."""
    long_after: int | None = None
    """LongRoPE's ``original_max_position_embeddings``: sequences longer than this use the long rows."""
    _key: object = field(default_factory=object)
    """Identifies this table set in an ``AttentionMeta``'s per-step cache."""

    @classmethod
    def build(cls, cfg: ModelConfig, num_positions: int, device: torch.device, dtype: torch.dtype) -> RopeTables:
        tables: dict[str, torch.Tensor] = {}
        long_after = None
        for name, local in ((GLOBAL, False), (LOCAL, True)):
            if local and cfg.local_rope_theta is None:
                continue
            scaling = cfg.local_rope_scaling if local else cfg.rope_scaling
            if _longrope(scaling):
                assert scaling is not None
                scale = float(scaling["attention_factor"])
                short = rope_cos_sin_cache(rope_inv_freq(cfg, local).to(device), num_positions, dtype, scale)
                long = rope_cos_sin_cache(rope_inv_freq(cfg, local, long=True).to(device), num_positions, dtype, scale)
                tables[name] = torch.cat((short, long))
                long_after = int(scaling["original_max_position_embeddings"])
            else:
                tables[name] = rope_cos_sin_cache(rope_inv_freq(cfg, local).to(device), num_positions, dtype)
        return cls(tables, num_positions, long_after)

    def positions(self, batch: ForwardBatch, step_cache: dict[object, torch.Tensor] | None = None) -> torch.Tensor:
        """Each token's row in the tables: its position, plus P for LongRoPE's long rows (module docstring).

        ``step_cache`` (one dict per forward, e.g. ``AttentionMeta.step_cache``) keeps the rows for
        the other layers of the same step. No host synchronisation (CUDA-graph capturable).
        """
        if self.long_after is None:
            return batch.positions
        if step_cache is not None and self._key in step_cache:
            return step_cache[self._key]
        if batch.max_query_len == 1 and batch.num_tokens == batch.num_seqs:
            token_len = batch.seq_lens
        else:
            qsl = batch.query_start_loc.long()
            token_len = torch.repeat_interleave(batch.seq_lens, qsl[1:] - qsl[:-1], output_size=batch.num_tokens)
        rows = batch.positions + (token_len > self.long_after).to(batch.positions.dtype) * self.num_positions
        if step_cache is not None:
            step_cache[self._key] = rows
        return rows
