"""Rotary position embedding of q and k, in place, from a per-position cos/sin cache (Triton), and the
store of the step's keys / values into the paged KV cache (``write_kv``), fused with it on the Triton
path (``rotary_embedding_write_kv``: one launch per layer instead of three).

The rotate_half (GPT-NeoX / HF Llama) convention: the two halves of each head vector form the
complex pairs ``(x[i], x[i + D/2])``. The frequencies (plain, linear- or llama3-scaled) are not
this op's business: they are baked into ``cos_sin_cache`` by the model
(``deltaserve.model.decoder.rope_cos_sin_cache``); the op gathers one row per token and rotates.
Numerics are HF's ``apply_rotary_pos_emb`` in the dtype of q: the cache holds cos/sin already
rounded to that dtype (as HF casts them), and each product and the sum are rounded to it.

Semantics::

    for t in range(T):
        c, s = cos_sin_cache[positions[t], :D/2], cos_sin_cache[positions[t], D/2:]
        for x in (q[t, h] for h in range(H)) + (k[t, h] for h in range(H_kv)):
            x1, x2 = x[:D/2], x[D/2:]
            x[:D/2], x[D/2:] = x1 * c - x2 * s, x2 * c + x1 * s     # = x * cos + rotate_half(x) * sin

    write_kv(k, v, cache_k, cache_v, slot_mapping):
        cache_k.view(-1, H_kv, D)[slot_mapping[t]] = k[t]; the same for v      for every t

    rotary_embedding_write_kv(positions, q, k, v, cos_sin_cache, cache_k, cache_v, slot_mapping):
        rotary_embedding(positions, q, k, cos_sin_cache); write_kv(k, v, cache_k, cache_v, slot_mapping)

Shape:
    positions:     [T]              int32 / int64, each in [0, P)
    q:             [T, H, D]        float32 / float16 / bfloat16, last dim contiguous (any other strides,
                                    e.g. a view into a fused qkv output); rotated in place
    k:             [T, H_kv, D]     same dtype as q, last dim contiguous; rotated in place
    cos_sin_cache: [P, D]           ``cat(cos(pos * inv_freq), sin(pos * inv_freq))``, D/2 each, dtype of q
    v:             [T, H_kv, D]     last dim contiguous
    cache_k/v:     [num_blocks, block_size, H_kv, D]   contiguous; slot_mapping [T] int64 (flat slots)

Entry points ``rotary_embedding`` / ``rotary_embedding_write_kv`` run the Triton kernel on CUDA
tensors (or when ``use_triton=True``: CPU tensors then need ``TRITON_INTERPRET=1``) and the references
(``rotary_embedding_ref``, then ``write_kv``), the CPU path, otherwise. Both return ``(q, k)`` (the
same tensors, rotated).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import needs_rne_by_hand, round_to, want_triton


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference and CPU path (module docstring): HF's ``q * cos + rotate_half(q) * sin``."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1)[:, None, :]
    for x in (q, k):
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)
    return q, k


def write_kv(
    k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys / values at their flat slots (module docstring): the torch path and the
    reference of the fused kernel's store."""
    heads, dim = cache_k.shape[-2], cache_k.shape[-1]
    cache_k.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(cache_k.dtype))
    cache_v.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(cache_v.dtype))


@triton.jit
def _rotate_heads(
    x_ptr, stride_t, stride_h, t, num_heads, c, s, offs_d, d_ok, dst_ptr, dst_stride_h,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, RNE: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    """Rotate all ``num_heads`` heads of token ``t`` in place; c, s are [BLOCK_D] float32. STORE: the
    rotated heads also go to ``dst_ptr`` (this token's cache slot; heads ``dst_stride_h`` apart)."""
    ty = x_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < num_heads) & d_ok[None, :]
    p1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    cc = c[None, :]
    ss = s[None, :]
    # Each product rounded to the tensor dtype, as HF computes it there (a no-op for float32).
    o1 = round_to(round_to(x1 * cc, ty, RNE) - round_to(x2 * ss, ty, RNE), ty, RNE)
    o2 = round_to(round_to(x2 * cc, ty, RNE) + round_to(x1 * ss, ty, RNE), ty, RNE)
    tl.store(p1, o1.to(ty), mask=mask)
    tl.store(p1 + HALF, o2.to(ty), mask=mask)
    if STORE:
        dt = dst_ptr.dtype.element_ty
        d1 = dst_ptr + offs_h[:, None] * dst_stride_h + offs_d[None, :]
        tl.store(d1, o1.to(ty).to(dt), mask=mask)
        tl.store(d1 + HALF, o2.to(ty).to(dt), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride, v_stride_t, v_stride_h, kv_stride_slot,
    kv_stride_h, H, H_KV,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    RNE: tl.constexpr, WRITE_KV: tl.constexpr,
):  # fmt: skip
    """Token t: rotate its q and k heads in place; WRITE_KV: its rotated k and its v also go to cache
    slot ``slot_mapping[t]`` (``write_kv``)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HALF
    row = cache_ptr + pos * cache_stride
    c = tl.load(row + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(row + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    slot = t
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    _rotate_heads(q_ptr, q_stride_t, q_stride_h, t, H, c, s, offs_d, d_ok, q_ptr, 0, HALF, BLOCK_H, RNE, False)
    kc_row = kc_ptr + slot * kv_stride_slot
    _rotate_heads(
        k_ptr, k_stride_t, k_stride_h, t, H_KV, c, s, offs_d, d_ok, kc_row, kv_stride_h, HALF, BLOCK_HKV, RNE, WRITE_KV
    )
    if WRITE_KV:  # v's two halves, as k's
        offs_h = tl.arange(0, BLOCK_HKV)
        mask = (offs_h[:, None] < H_KV) & d_ok[None, :]
        src = v_ptr + t * v_stride_t + offs_h[:, None] * v_stride_h + offs_d[None, :]
        dst = vc_ptr + slot * kv_stride_slot + offs_h[:, None] * kv_stride_h + offs_d[None, :]
        vt = vc_ptr.dtype.element_ty
        tl.store(dst, tl.load(src, mask=mask, other=0.0).to(vt), mask=mask)
        tl.store(dst + HALF, tl.load(src + HALF, mask=mask, other=0.0).to(vt), mask=mask)


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"rotary_embedding: q {list(q.shape)} and k {list(k.shape)} must be [T, heads, D]")
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or positions.shape != (t,):
        raise ValueError(
            f"rotary_embedding: q {list(q.shape)}, k {list(k.shape)} and positions {list(positions.shape)} "
            f"disagree on T or D"
        )
    if d % 2 or cache.dim() != 2 or cache.shape[1] != d:
        raise ValueError(f"rotary_embedding: cos_sin_cache {list(cache.shape)} must be [P, D={d}] with D even")
    if not (q.dtype == k.dtype == cache.dtype):
        raise ValueError(
            f"rotary_embedding: q ({q.dtype}), k ({k.dtype}) and cos_sin_cache ({cache.dtype}) must share a dtype"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding: q and k must have a contiguous last dim")


def rotary_embedding_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel for ``rotary_embedding`` (no dispatch); positions are not range-checked here."""
    _check(positions, q, k, cos_sin_cache)
    if q.shape[0]:
        _launch(positions, q, k, cos_sin_cache, None)
    return q, k


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """The kernel, one program per token; ``kv`` = (v, cache_k, cache_v, slot_mapping): it also stores them."""
    t, h, d = q.shape
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = d // 2
    if kv is None:
        v, kc, vc, slots, kv_slot, kv_head = k, k, k, positions, 0, 0  # unused (WRITE_KV=False)
    else:
        v, kc, vc, slots = kv
        kv_slot, kv_head = kc.stride(1), kc.stride(2)
    _rope_kernel[(t,)](
        positions, q, k, cache, v, kc, vc, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0), v.stride(0), v.stride(1), kv_slot,
        kv_head, h, k.shape[1],
        HALF=half, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(h), BLOCK_HKV=triton.next_power_of_2(k.shape[1]),
        RNE=needs_rne_by_hand(q), WRITE_KV=kv is not None, num_warps=4,
    )  # fmt: skip


def _check_kv(
    k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor
) -> None:
    want = (k.shape[1], k.shape[2])
    if v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(
            f"rotary_embedding_write_kv: v {list(v.shape)} must be k's shape {list(k.shape)}, last dim contiguous"
        )
    for name, c in (("cache_k", cache_k), ("cache_v", cache_v)):
        if c.dim() != 4 or (c.shape[2], c.shape[3]) != want or not c.is_contiguous() or c.shape != cache_k.shape:
            raise ValueError(
                f"rotary_embedding_write_kv: {name} {list(c.shape)} must be contiguous [blocks, block_size, {want[0]}, {want[1]}]"
            )
    if slots.shape != (k.shape[0],) or slots.dtype != torch.int64:
        raise ValueError(f"rotary_embedding_write_kv: slot_mapping {list(slots.shape)} {slots.dtype} must be int64 [T]")


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place (module docstring); Triton on CUDA, the reference elsewhere."""
    _check(positions, q, k, cos_sin_cache)
    if want_triton("rotary_embedding", q, use_triton):
        return rotary_embedding_triton(positions, q, k, cos_sin_cache)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache)


def rotary_embedding_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place, then store k and v at their cache slots (module docstring): one launch
    on the Triton path; ``rotary_embedding`` then ``write_kv`` on the reference path."""
    _check(positions, q, k, cos_sin_cache)
    _check_kv(k, v, cache_k, cache_v, slot_mapping)
    if want_triton("rotary_embedding_write_kv", q, use_triton):
        if q.shape[0]:
            _launch(positions, q, k, cos_sin_cache, (v, cache_k, cache_v, slot_mapping))
        return q, k
    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    write_kv(k, v, cache_k, cache_v, slot_mapping)
    return q, k
