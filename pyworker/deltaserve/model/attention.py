"""Paged attention: the torch reference (CPU and CUDA) and the KV write.

This is the semantic definition every faster kernel (Triton, CUDA) is tested against.

Semantics (per sequence b of a ``ForwardBatch``, per query head h)::

    rows    = [query_start_loc[b], query_start_loc[b+1])        # this step's tokens of b
    ctx     = seq_lens[b]                                        # prefix in cache + this step
    K_b[j]  = cache_k[block_tables[b, j // bs], j % bs]          # j in [0, ctx), position j
    for t in rows:
        p       = positions[t]
        visible = { j : j <= p  and  (window is None or j > p - window) }
        out[t, h] = softmax_j(scale * q[t, h] . K_b[j, h // (H / H_kv)]) @ V_b[j, ...]   over visible j

Shapes:
    q:        [T, H, D]
    cache_k:  [num_blocks, block_size, H_kv, D]   (one layer of ``PagedKVCache``; same for cache_v)
    out:      [T, H, D]

How the reference computes it, in one code path for mixed prefill + decode: gather every
sequence's context through its block table into ``[B, max_seq_len, H_kv, D]`` (one advanced-index
gather), scatter the T query rows into ``[B, max_query_len, H, D]``, and run
``scaled_dot_product_attention`` with a causal(+window) mask built once per step from positions. Masked
keys get weight exactly 0, so what sits in padding never changes a result (the cache is
zero-initialised, so padding is finite). Padded query rows see key 0 only and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .batch import ForwardBatch

_TORCH_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class AttentionMeta:
    """Per-step index tensors shared by every layer (built once per forward)."""

    token_seq: torch.Tensor
    """LongTensor [T]: the sequence each token row belongs to."""
    token_off: torch.Tensor
    """LongTensor [T]: the row's index within its sequence's tokens this step."""
    mask: torch.Tensor
    """BoolTensor [B, 1, max_query_len, max_seq_len]: True where a (padded) query may see a key."""
    ctx_tables: torch.Tensor
    """LongTensor [B, ceil(max_seq_len / block_size)]: the block-table columns the context spans."""
    rows_are_padded_layout: bool
    """Every sequence has max_query_len tokens, so [T] rows reshape to [B, max_query_len] directly."""
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    """Additive (0 / -inf) form of ``mask`` per dtype, built once and reused by every layer."""

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        cached = self._bias.get(dtype)
        if cached is None:
            cached = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            cached.masked_fill_(~self.mask, float("-inf"))
            self._bias[dtype] = cached
        return cached


def attention_metadata(batch: ForwardBatch, block_size: int, sliding_window: int | None = None) -> AttentionMeta:
    """Index tensors and mask for ``batch`` (shared by all layers of one forward)."""
    device = batch.input_ids.device
    num_seqs = batch.num_seqs
    num_tokens = batch.num_tokens
    qsl = batch.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens)
    token_off = torch.arange(num_tokens, device=device) - qsl[token_seq]
    # Padded query rows keep position 0: they see key 0 only, never an all-masked (NaN) row.
    qpos = torch.zeros((num_seqs, batch.max_query_len), dtype=torch.long, device=device)
    qpos[token_seq, token_off] = batch.positions
    kpos = torch.arange(batch.max_seq_len, device=device)
    mask = kpos[None, None, :] <= qpos[:, :, None]
    if sliding_window is not None:
        mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
    num_ctx_blocks = -(-batch.max_seq_len // block_size)
    if batch.block_tables.shape[1] < num_ctx_blocks:
        raise ValueError(
            f"block_tables has {batch.block_tables.shape[1]} columns but max_seq_len "
            f"{batch.max_seq_len} needs {num_ctx_blocks} pages of {block_size}"
        )
    return AttentionMeta(
        token_seq=token_seq,
        token_off=token_off,
        mask=mask[:, None],
        ctx_tables=batch.block_tables[:, :num_ctx_blocks].long(),
        rows_are_padded_layout=num_tokens == num_seqs * batch.max_query_len,
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys/values at their flat slots.

    Semantics: ``cache_k.view(-1, H_kv, D)[slot_mapping[t]] = k[t]`` (same for v), for every t.
    Shapes: k, v [T, H_kv, D]; cache_k, cache_v [num_blocks, block_size, H_kv, D]; slot_mapping [T].
    """
    heads, dim = cache_k.shape[-2], cache_k.shape[-1]
    cache_k.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(cache_k.dtype))
    cache_v.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(cache_v.dtype))


def paged_attention_ref(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    meta: AttentionMeta | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over each sequence's paged context (module docstring).

    ``meta`` is ``attention_metadata(batch, block_size, sliding_window)``; pass it to reuse it across
    layers (``sliding_window`` is then ignored, the mask in ``meta`` already carries it).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache_k.shape[2]
    if num_heads % kv_heads != 0:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {kv_heads}")
    if meta is None:
        meta = attention_metadata(batch, cache_k.shape[1], sliding_window)
    num_seqs, max_seq_len = batch.num_seqs, batch.max_seq_len
    # [B, nb, bs, H_kv, D] -> [B, nb*bs, H_kv, D] -> first max_seq_len positions.
    k = cache_k[meta.ctx_tables].flatten(1, 2)[:, :max_seq_len]
    v = cache_v[meta.ctx_tables].flatten(1, 2)[:, :max_seq_len]
    if meta.rows_are_padded_layout:  # pure decode, or equal-length chunks: no scatter needed
        qp = q.view(num_seqs, batch.max_query_len, num_heads, head_dim)
    else:
        qp = q.new_zeros((num_seqs, batch.max_query_len, num_heads, head_dim))
        qp[meta.token_seq, meta.token_off] = q
    qp, k, v = qp.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
    mask = meta.bias(q.dtype)
    if _TORCH_HAS_ENABLE_GQA:
        out = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=mask, scale=scale, enable_gqa=kv_heads != num_heads
        )
    else:
        group = num_heads // kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2)
    if meta.rows_are_padded_layout:
        return out.reshape(q.shape)
    return out[meta.token_seq, meta.token_off]
