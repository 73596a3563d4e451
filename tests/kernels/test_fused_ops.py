"""The fused small ops (``deltaserve.kernels.rmsnorm`` / ``rope`` / ``silu_mul``): kernel = reference = HF.

Two checks per op:

- the Triton kernel equals its torch reference over token counts 1 / 7 / 64, widths 64 / 576 and a
  non-power-of-two, float32 / float16 / bfloat16 (rope: MHA and GQA head counts, positions far
  past the first KV page, q and k as strided views into a fused qkv output, as the decoder
  passes them). The kernels mimic HF's rounding to the dtype, so they sit within one unit in the
  last place of the reference (the reduction order and ``exp`` differ);
- the torch reference equals an independent HF implementation (``LlamaRMSNorm``,
  ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb`` for plain / linear / llama3 frequencies,
  ``ACT2FN["silu"]``) bit for bit, so the semantics are checked, not only the kernel.

On CPU the kernels run under the Triton interpreter; with ``DELTASERVE_TEST_GPU=1`` on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from deltaserve.kernels import common as kernel_common
from deltaserve.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from deltaserve.kernels.rope import rotary_embedding, rotary_embedding_ref, rotary_embedding_write_kv
from deltaserve.kernels.silu_mul import silu_and_mul, silu_and_mul_ref
from deltaserve.model.arch import ModelConfig
from deltaserve.model.decoder import rope_cos_sin_cache, rope_inv_freq

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU

DEVICE = torch.device("cuda" if os.environ.get("DELTASERVE_TEST_GPU") == "1" else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOKENS = [1, 7, 64]
# Relative tolerance: about two units in the last place of each dtype (fp32: reduction order).
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ATOL = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-4}
ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}  # fmt: skip


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within ~2 ulps everywhere, and bit-identical almost everywhere in 16-bit dtypes (where the
    kernels round intermediates exactly as HF does; skipping one such rounding breaks this)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=RTOL[want.dtype], atol=ATOL[want.dtype])
    if want.dtype != torch.float32 and want.numel() >= 64:
        same = (got == want).float().mean().item()
        assert same >= 0.97, f"only {same:.1%} of the elements are bit-identical to the reference"


def close_rotation(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> None:
    """``close`` for RoPE outputs: each element within 2 ulps of the *operands* it was computed from.

    out_i = x_i * cos - x_p * sin (x_p its rotate-half partner): where the two products cancel the
    result is near 0, and a compiled kernel that fuses a multiply into the add (FMA) rounds once
    where the reference rounds twice, so a bound relative to the result cannot hold; one relative
    to |x_i| + |x_p| does, and is what "2 ulps" means for this op.
    """
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(want.dtype).eps
    x = before.float().abs()
    partner = torch.roll(x, x.shape[-1] // 2, dims=-1)  # swaps the halves: the rotate-half partner
    err = (got.float() - want.float()).abs()
    bound = 2 * eps * (x + partner)
    worst = (err - bound).max().item()
    assert worst <= 0, f"rope: an element is {worst:.3g} beyond 2 ulps of its operands"
    # Bit-identity with the reference's double rounding holds where the interpreter runs the kernel
    # step by step (CI); compiled code may contract and reorder, so on CUDA ~80% of fp16/bf16
    # elements are identical (H200) and the 2-ulp bound above is the contract.
    if want.dtype != torch.float32 and want.numel() >= 64 and not got.is_cuda:
        same = (got == want).float().mean().item()
        assert same >= 0.97, f"only {same:.1%} of the elements are bit-identical to the reference"


# ---------------------------------------------------------------- RMSNorm (+ residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rmsnorm_kernel_matches_reference(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    x = randn(tokens, hidden, dtype=dtype, seed=tokens * hidden, scale=3.0)
    res = randn(tokens, hidden, dtype=dtype, seed=tokens * hidden + 1)
    w = (1 + randn(hidden, dtype=torch.float32, seed=hidden, scale=0.2)).to(dtype)
    close(rmsnorm(x, w, 1e-5, use_triton=True), rmsnorm_ref(x, w, 1e-5))
    normed, new_res = fused_add_rmsnorm(x, res, w, 1e-6, use_triton=True)
    want_normed, want_res = fused_add_rmsnorm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, want_res), "the residual sum is one rounding of x + residual"
    close(normed, want_normed)


def test_rmsnorm_kernel_leading_dims_and_mixed_weight_dtype() -> None:
    """[B, T, N] input with a non-contiguous row stride, and a float32 weight on float16 input."""
    x = randn(2, 5, 2 * 96, dtype=torch.float16, seed=1)[..., :96]
    w = 1 + randn(96, dtype=torch.float32, seed=2, scale=0.1)
    out = rmsnorm(x, w, 1e-5, use_triton=True)
    assert out.dtype == torch.float32  # promote(weight, x), as HF's ``weight * x.to(in_dtype)``
    close(out, rmsnorm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [0, 3])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rmsnorm_row_delta_kernel_matches_reference(tokens: int, heads: int, dtype: torch.dtype) -> None:
    """Per-row weights ``w + table[index[t]]`` (a compressed delta's norm deltas), gathered in the
    kernel: [rows, N] rows and [rows, heads, N] q / k norms (one weight per row for all its heads),
    with and without the residual; index 0 is the table's zero row (a row without a delta)."""
    hidden = 96
    shape = (tokens, heads, hidden) if heads else (tokens, hidden)
    x = randn(*shape, dtype=dtype, seed=tokens + heads, scale=3.0)
    res = randn(*shape, dtype=dtype, seed=tokens + heads + 1)
    w = (1 + randn(hidden, dtype=torch.float32, seed=hidden, scale=0.2)).to(dtype)
    table = randn(4, hidden, dtype=dtype, seed=7, scale=0.1)
    table[0] = 0
    index = torch.tensor([t % 4 for t in range(tokens)], dtype=torch.int64, device=DEVICE)
    delta = (table, index)
    close(rmsnorm(x, w, 1e-5, delta, use_triton=True), rmsnorm_ref(x, w, 1e-5, delta))
    normed, new_res = fused_add_rmsnorm(x, res, w, 1e-6, delta, use_triton=True)
    want_normed, want_res = fused_add_rmsnorm_ref(x, res, w, 1e-6, delta)
    assert torch.equal(new_res, want_res)
    close(normed, want_normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_row_delta_reference_is_the_row_s_own_weight(dtype: torch.dtype) -> None:
    """The reference's row t equals the plain norm with weight ``w + table[index[t]]`` (HF's
    ``weight * x_normed`` with that weight), bit for bit; rows of index 0 equal the base norm."""
    hidden = 64
    x = randn(5, hidden, dtype=dtype, seed=11, scale=2.0)
    w = (1 + randn(hidden, dtype=torch.float32, seed=12, scale=0.2)).to(dtype)
    table = randn(3, hidden, dtype=dtype, seed=13, scale=0.1)
    table[0] = 0
    index = torch.tensor([0, 2, 1, 0, 2], dtype=torch.int64, device=DEVICE)
    got = rmsnorm_ref(x, w, 1e-5, (table, index))
    for t in range(5):
        assert torch.equal(got[t], rmsnorm_ref(x[t : t + 1], w + table[index[t]], 1e-5)[0])
    assert torch.equal(got[0], rmsnorm_ref(x[:1], w, 1e-5)[0])


def test_rmsnorm_row_delta_bad_shapes_are_refused() -> None:
    x = randn(4, 64, dtype=torch.float32, seed=1)
    w = torch.ones(64, device=DEVICE)
    table = torch.zeros(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="index"):
        rmsnorm(x, w, 1e-5, (table, torch.zeros(3, dtype=torch.int64, device=DEVICE)), use_triton=True)
    with pytest.raises(ValueError, match="index"):
        rmsnorm(x, w, 1e-5, (table, torch.zeros(4, dtype=torch.int32, device=DEVICE)), use_triton=True)
    with pytest.raises(ValueError, match="table"):
        rmsnorm(x, w, 1e-5, (table[:, :32], torch.zeros(4, dtype=torch.int64, device=DEVICE)), use_triton=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_reference_is_hf(dtype: torch.dtype) -> None:
    hidden = 576
    hf = LlamaRMSNorm(hidden, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + randn(hidden, dtype=torch.float32, seed=3, scale=0.3))
    x = randn(7, hidden, dtype=dtype, seed=4, scale=2.0)
    res = randn(7, hidden, dtype=dtype, seed=5)
    with torch.no_grad():
        assert torch.equal(rmsnorm_ref(x, hf.weight, 1e-5), hf(x))
        normed, new_res = fused_add_rmsnorm_ref(x, res, hf.weight, 1e-5)
        assert torch.equal(new_res, res + x)  # HF: hidden_states = residual + hidden_states
        assert torch.equal(normed, hf(res + x))


# ---------------------------------------------------------------- RoPE


def rope_config(head_dim: int, scaling: str) -> ModelConfig:
    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 4 * head_dim,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 500000.0 if scaling == "llama3" else 10000.0, "max_position_embeddings": 8192,
        "rope_scaling": ROPE_SCALINGS[scaling],
    }  # fmt: skip
    return ModelConfig.from_dict(raw)


def qk_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """q [T, H, D] and k [T, H_kv, D] as strided views into one [T, (H + 2 H_kv) D] qkv buffer."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed, scale=2.0)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 64), (6, 1, 128)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rope_kernel_matches_reference(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype) -> None:
    cfg = rope_config(head_dim, "llama3")
    cache = rope_cos_sin_cache(rope_inv_freq(cfg).to(DEVICE), 5000, dtype)
    g = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 5000, (tokens,), generator=g).to(DEVICE)
    positions[0] = 4999  # far past the first page, and the cache's last row
    q, k = qk_views(tokens, heads, kv_heads, head_dim, dtype, seed=tokens + heads)
    q_ref, k_ref = q.clone(), k.clone()
    q_in, k_in = q.clone(), k.clone()
    qkv_before = q._base.clone()
    out_q, out_k = rotary_embedding(positions, q, k, cache, use_triton=True)
    assert out_q is q and out_k is k, "rotated in place"
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    close_rotation(q, q_ref, q_in)
    close_rotation(k, k_ref, k_in)
    # v (the last columns of the qkv buffer) is untouched.
    split = (heads + kv_heads) * head_dim
    assert torch.equal(q._base[:, split:], qkv_before[:, split:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 64), (6, 1, 128)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rope_write_kv_kernel(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype) -> None:
    """The fused launch (decoder layers call it): q and k rotated exactly as ``rotary_embedding``'s
    kernel rotates them, and the cache slots of ``slot_mapping`` then hold that k and v bit for bit
    (``write_kv``), scattered over blocks in any order; every other slot is untouched. The reference
    path (rope reference, then ``write_kv``) agrees within the rotation's 2 ulps."""
    cfg = rope_config(head_dim, "llama3")
    cache = rope_cos_sin_cache(rope_inv_freq(cfg).to(DEVICE), 5000, dtype)
    g = torch.Generator().manual_seed(tokens + 1)
    positions = torch.randint(0, 5000, (tokens,), generator=g).to(DEVICE)
    q, k = qk_views(tokens, heads, kv_heads, head_dim, dtype, seed=tokens + heads + 7)
    split = (heads + kv_heads) * head_dim
    v = q._base[:, split:].view(tokens, kv_heads, head_dim)  # the qkv buffer's v columns, as the decoder passes them
    blocks, block_size = 2 * tokens // 16 + 3, 16
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(DEVICE)
    cache_k = torch.full((blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    cache_v = torch.full_like(cache_k, -7.0)
    q_sep, k_sep, v_in = q.clone(), k.clone(), v.clone()
    q_in, k_in = q.clone(), k.clone()
    rotary_embedding(positions, q_sep, k_sep, cache, use_triton=True)
    out = rotary_embedding_write_kv(positions, q, k, v, cache, cache_k, cache_v, slots, use_triton=True)
    assert out[0] is q and out[1] is k
    assert torch.equal(q, q_sep) and torch.equal(k, k_sep), "the same rotation as the unfused kernel"
    flat_k, flat_v = cache_k.view(-1, kv_heads, head_dim), cache_v.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v_in)
    others = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert bool((flat_k[others] == 7.0).all()) and bool((flat_v[others] == -7.0).all()), "other slots untouched"
    ref_k, ref_v = torch.zeros_like(cache_k), torch.zeros_like(cache_v)
    q_ref, k_ref = q_in.clone(), k_in.clone()
    rotary_embedding_write_kv(positions, q_ref, k_ref, v_in.clone(), cache, ref_k, ref_v, slots, use_triton=False)
    close_rotation(q, q_ref, q_in)
    close_rotation(k, k_ref, k_in)
    close_rotation(flat_k[slots], ref_k.view(-1, kv_heads, head_dim)[slots], k_in)
    assert torch.equal(ref_v.view(-1, kv_heads, head_dim)[slots], v_in)


def test_rope_write_kv_refusals() -> None:
    cfg = rope_config(32, "default")
    cache = rope_cos_sin_cache(rope_inv_freq(cfg).to(DEVICE), 64, torch.float32)
    q, k = qk_views(3, 4, 2, 32, torch.float32, seed=5)
    v = k.clone()
    pos = torch.tensor([0, 1, 2], device=DEVICE)
    slots = torch.tensor([4, 0, 9], device=DEVICE)
    ck = torch.zeros(2, 8, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="v "):
        rotary_embedding_write_kv(pos, q, k, v[:, :1], cache, ck, ck.clone(), slots)
    with pytest.raises(ValueError, match="cache_v"):
        rotary_embedding_write_kv(pos, q, k, v, cache, ck, torch.zeros(2, 8, 2, 16, device=DEVICE), slots)
    with pytest.raises(ValueError, match="cache_k"):
        rotary_embedding_write_kv(pos, q, k, v, cache, ck.transpose(0, 1), ck.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_embedding_write_kv(pos, q, k, v, cache, ck, ck.clone(), slots.int())


def test_rope_kernel_int32_positions_and_refusals() -> None:
    cfg = rope_config(32, "default")
    cache = rope_cos_sin_cache(rope_inv_freq(cfg).to(DEVICE), 64, torch.float32)
    q, k = qk_views(5, 4, 2, 32, torch.float32, seed=9)
    pos = torch.tensor([0, 63, 17, 32, 5], dtype=torch.int32, device=DEVICE)
    want_q, want_k = rotary_embedding_ref(pos.long(), q.clone(), k.clone(), cache)
    rotary_embedding(pos, q, k, cache, use_triton=True)
    close(q, want_q)
    close(k, want_k)
    with pytest.raises(ValueError, match="must share a dtype"):
        rotary_embedding(pos, q, k, cache.half())
    with pytest.raises(ValueError, match=r"cos_sin_cache \[64, 16\] must be \[P, D=32\]"):
        rotary_embedding(pos, q, k, cache[:, :16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_rope_reference_and_cache_are_hf(scaling: str, dtype: torch.dtype) -> None:
    """HF's rotary embedding for the same config: our frequencies, our table and our rotation."""
    head_dim, heads, kv_heads, tokens = 64, 4, 2, 9
    cfg = rope_config(head_dim, scaling)
    hf_cfg = LlamaConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=8192, rope_theta=cfg.rope_theta, rope_scaling=ROPE_SCALINGS[scaling],
    )  # fmt: skip
    positions = torch.tensor([0, 1, 2, 63, 64, 255, 1000, 3000, 8191], device=DEVICE)
    q, k = qk_views(tokens, heads, kv_heads, head_dim, dtype, seed=11)
    # HF layout: [batch, heads, T, D] with cos/sin [batch, T, D].
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg).to(DEVICE)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    cache = rope_cos_sin_cache(rope_inv_freq(cfg).to(DEVICE), 8192, dtype)
    half = head_dim // 2
    assert torch.equal(cache[positions, :half].repeat(1, 2), hf_cos[0])
    assert torch.equal(cache[positions, half:].repeat(1, 2), hf_sin[0])
    rotary_embedding_ref(positions, q, k, cache)
    assert torch.equal(q, want_q[0].transpose(0, 1))
    assert torch.equal(k, want_k[0].transpose(0, 1))


# ---------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 576, 2500])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_kernel_matches_reference(tokens: int, inter: int, dtype: torch.dtype) -> None:
    gate_up = randn(tokens, 2 * inter, dtype=dtype, seed=tokens + inter, scale=4.0)
    close(silu_and_mul(gate_up, use_triton=True), silu_and_mul_ref(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reference_is_hf(dtype: torch.dtype) -> None:
    gate, up = randn(7, 576, dtype=dtype, seed=12, scale=4.0), randn(7, 576, dtype=dtype, seed=13)
    assert torch.equal(silu_and_mul_ref(torch.cat((gate, up), dim=-1)), ACT2FN["silu"](gate) * up)
    # Leading dims pass through; the Triton path agrees on them too.
    gu = randn(2, 3, 2 * 100, dtype=dtype, seed=14)
    out = silu_and_mul(gu, use_triton=True)
    assert out.shape == (2, 3, 100)
    close(out, silu_and_mul_ref(gu))
    with pytest.raises(ValueError, match=r"even last dim"):
        silu_and_mul(gu[..., :199])


# ---------------------------------------------------------------- dispatch


def test_dispatch_follows_device_and_forced_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 64)  # CPU: the reference unless forced
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only read by the check below, not by triton
    assert kernel_common.want_triton("op", x, None) is False
    assert kernel_common.want_triton("op", x, True) is True
    monkeypatch.setattr(kernel_common, "_backend", "triton")
    assert kernel_common.want_triton("op", x, None) is True
    assert kernel_common.want_triton("op", x, False) is False
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        kernel_common.want_triton("rmsnorm", x, None)
