"""Paged attention: the dispatcher the decoder calls, the torch reference (CPU and CUDA) and the KV write.

``paged_attention_ref`` is the semantic definition every faster kernel (Triton, CUDA) is tested
against; ``paged_attention`` runs the Triton kernels of ``deltaserve.kernels.paged_attention`` on
CUDA and the reference elsewhere (``attention_backend``).

Semantics (per sequence b of a ``ForwardBatch``, per query head h)::

    rows    = [query_start_loc[b], query_start_loc[b+1])        # this step's tokens of b
    ctx     = seq_lens[b]                                        # prefix in cache + this step
    K_b[j]  = cache_k[block_tables[b, j // bs], j % bs]          # j in [0, ctx), position j
    for t in rows:
        p       = positions[t]
        visible = { j : j <= p  and  (window is None or j > p - window) }
        s_j       = scale * q[t, h] . K_b[j, h // (H / H_kv)]
        s_j       = softcap * tanh(s_j / softcap)                    # only with a soft-cap (Gemma 2)
        out[t, h] = softmax_j(s_j) @ V_b[j, ...]   over visible j

The window and the soft-cap are per call (a model's layers may differ: Gemma's alternating
sliding-window and global layers); ``AttentionMeta`` keeps one reference mask per window seen.

Shapes:
    q:        [T, H, D]
    cache_k:  [num_blocks, block_size, H_kv, D]   (one layer of ``PagedKVCache``; same for cache_v)
    out:      [T, H, D]

How the reference computes it, in one code path for mixed prefill + decode: gather every
sequence's context through its block table into ``[B, max_seq_len, H_kv, D]`` (one advanced-index
gather), scatter the T query rows into ``[B, max_query_len, H, D]``, and run
``scaled_dot_product_attention`` with a causal(+window) mask built once per step (and window) from
positions (with a soft-cap: the same attention written out, HF's eager order). Masked
keys get weight exactly 0, so what sits in padding never changes a result (the cache is
zero-initialised, so padding is finite). Padded query rows see key 0 only and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.common import use_triton_for
from .batch import ForwardBatch, to_device

_TORCH_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class _Default:
    """Type of ``DEFAULT``: "the window ``meta`` was built with"."""


DEFAULT = _Default()

BACKENDS = ("torch", "triton")
"""``torch``: ``paged_attention_ref``; ``triton``: the kernels in ``deltaserve.kernels.paged_attention``."""


def attention_backend(device: torch.device) -> str:
    """The backend ``paged_attention`` uses for tensors on ``device`` (``deltaserve.kernels.common``'s setting)."""
    return "triton" if use_triton_for(device) else "torch"


@dataclass
class ReferenceMeta:
    """The reference path's per-step index tensors and dense mask (built once per forward)."""

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


@dataclass
class AttentionMeta:
    """What every layer's attention shares in one forward: the backend and, for the reference only,
    its dense mask and gather indices (built on first use, so the Triton path builds no tensors)."""

    batch: ForwardBatch
    """The step; the Triton kernels read its block_tables, seq_lens and query_start_loc directly."""
    block_size: int
    """Tokens per KV page."""
    sliding_window: int | None
    """Default window for calls that name none: keys visible to position p are those with
    j > p - sliding_window (None: all j <= p)."""
    backend: str
    """One of ``BACKENDS``, fixed for the whole forward."""
    _references: dict[int | None, ReferenceMeta] = field(default_factory=dict)
    """``reference_for(window)`` once built, per window."""
    step_cache: dict[object, torch.Tensor] = field(default_factory=dict)
    """Per-forward tensors other modules derive once and share across layers (``RopeTables.positions``)."""

    @property
    def _reference(self) -> ReferenceMeta | None:
        """Any reference tensors built so far (None: the Triton path built none)."""
        return next(iter(self._references.values()), None)

    @property
    def reference(self) -> ReferenceMeta:
        """The reference path's tensors for the default window (``reference_for``)."""
        return self.reference_for(self.sliding_window)

    def reference_for(self, window: int | None) -> ReferenceMeta:
        """The reference path's tensors for ``window`` (built on first use, then reused by every layer)."""
        ref = self._references.get(window)
        if ref is None:
            ref = self._references[window] = _reference_metadata(self.batch, self.block_size, window)
        return ref


def attention_metadata(
    batch: ForwardBatch, block_size: int, sliding_window: int | None = None, backend: str | None = None
) -> AttentionMeta:
    """Per-forward attention state for ``batch`` (shared by all layers); ``backend`` None means
    ``attention_backend(device)``. Checks that the block tables cover the longest context."""
    if backend is None:
        backend = attention_backend(batch.input_ids.device)
    elif backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: want one of {BACKENDS}")
    num_ctx_blocks = -(-batch.max_seq_len // block_size)
    if batch.block_tables.shape[1] < num_ctx_blocks:
        raise ValueError(
            f"block_tables has {batch.block_tables.shape[1]} columns but max_seq_len "
            f"{batch.max_seq_len} needs {num_ctx_blocks} pages of {block_size}"
        )
    return AttentionMeta(batch=batch, block_size=block_size, sliding_window=sliding_window, backend=backend)


def _reference_metadata(batch: ForwardBatch, block_size: int, sliding_window: int | None) -> ReferenceMeta:
    """Index tensors and dense mask the reference path needs for ``batch``."""
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
    return ReferenceMeta(
        token_seq=token_seq,
        token_off=token_off,
        mask=mask[:, None],
        ctx_tables=batch.block_tables[:, :num_ctx_blocks].long(),
        rows_are_padded_layout=num_tokens == num_seqs * batch.max_query_len,
    )


def paged_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    meta: AttentionMeta | None = None,
    sliding_window: int | None | _Default = DEFAULT,
    backend: str | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged attention as the decoder calls it (Semantics and Shapes: the module docstring).

    ``meta`` (``attention_metadata``, one per forward) fixes the backend; ``sliding_window`` (None:
    full causal) and ``softcap`` are this call's (a layer's); left out, the window is ``meta``'s.
    Without ``meta``, ``backend`` (None: ``attention_backend(q.device)``) is used.
    """
    if meta is None:
        window = None if isinstance(sliding_window, _Default) else sliding_window
        meta = attention_metadata(batch, cache_k.shape[1], window, backend)
    window = meta.sliding_window if isinstance(sliding_window, _Default) else sliding_window
    if meta.backend == "triton":
        # Imported here: triton reads TRITON_INTERPRET at import, and the CPU path never needs it.
        from ..kernels.paged_attention import paged_attention as triton_paged_attention

        tiles, count = batch.attn_tiles, batch.attn_tile_count
        if tiles is None and batch.max_query_len > 1 and batch.host_q_lens is not None:
            tiles, count = _prefill_tile_table(meta, q.shape[1], cache_k.shape[2])
        return triton_paged_attention(
            q,
            cache_k,
            cache_v,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.max_query_len,
            scale,
            window,
            max_seq_len=batch.max_seq_len,
            softcap=softcap,
            tiles=tiles,
            single_rows=batch.single_rows,
            tile_count=count,
        )
    return paged_attention_ref(q, cache_k, cache_v, batch, scale, meta=meta, sliding_window=window, softcap=softcap)


def _prefill_tile_table(meta: AttentionMeta, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager step's prefill tile table and its row count (``kernels.paged_attention.prefill_tiles``
    over the batch's host token counts), built once per forward: the tiled launch gives the step a
    program per real tile, where the untiled grid would give one per (query tile, sequence), every
    one-token sequence included."""
    from ..kernels.paged_attention import prefill_block_q, prefill_tiles

    batch = meta.batch
    device = batch.query_start_loc.device
    key = ("prefill_tiles", num_heads, num_kv_heads)
    if key not in meta.step_cache:
        assert batch.host_q_lens is not None
        block_q = prefill_block_q(num_heads, num_kv_heads, device.type != "cuda")
        tiles = prefill_tiles(list(batch.host_q_lens), block_q, skip_single=batch.single_rows)
        flat = to_device([len(tiles) // 2, 0, *tiles], torch.int32, device)
        meta.step_cache[key] = flat
    flat = meta.step_cache[key]
    return flat[2:].view(-1, 2), flat[:1]


def paged_attention_ref(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    meta: AttentionMeta | None = None,
    sliding_window: int | None | _Default = DEFAULT,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over each sequence's paged context (module docstring).

    ``meta`` is ``attention_metadata(batch, block_size, ...)``; pass it to reuse its masks across
    layers. ``sliding_window`` left out means ``meta``'s window. This path runs whatever
    ``meta.backend`` says: it is the reference.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache_k.shape[2]
    if num_heads % kv_heads != 0:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {kv_heads}")
    if meta is None:
        window = None if isinstance(sliding_window, _Default) else sliding_window
        meta = attention_metadata(batch, cache_k.shape[1], window, "torch")
    window = meta.sliding_window if isinstance(sliding_window, _Default) else sliding_window
    if softcap is not None and not softcap > 0:
        raise ValueError(f"paged_attention: softcap must be positive or None, got {softcap}")
    ref = meta.reference_for(window)
    num_seqs, max_seq_len = batch.num_seqs, batch.max_seq_len
    # [B, nb, bs, H_kv, D] -> [B, nb*bs, H_kv, D] -> first max_seq_len positions.
    k = cache_k[ref.ctx_tables].flatten(1, 2)[:, :max_seq_len]
    v = cache_v[ref.ctx_tables].flatten(1, 2)[:, :max_seq_len]
    if ref.rows_are_padded_layout:  # pure decode, or equal-length chunks: no scatter needed
        qp = q.view(num_seqs, batch.max_query_len, num_heads, head_dim)
    else:
        qp = q.new_zeros((num_seqs, batch.max_query_len, num_heads, head_dim))
        qp[ref.token_seq, ref.token_off] = q
    qp, k, v = qp.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
    mask = ref.bias(q.dtype)
    if softcap is not None:
        out = _softcapped_attention(qp, k, v, mask, scale, softcap)
    elif _TORCH_HAS_ENABLE_GQA:
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=kv_heads != num_heads)
    else:
        group = num_heads // kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2)
    if ref.rows_are_padded_layout:
        return out.reshape(q.shape)
    return out[ref.token_seq, ref.token_off]


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """HF's eager attention with a soft-cap: ``softmax_f32(cap * tanh(scale * q k^T / cap) + bias) v``.

    q [B, H, M, D]; k, v [B, H_kv, N, D]; bias [B, 1, M, N] (0 / -inf); returns [B, H, M, D].
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap + bias
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
