"""Mixed steps of the multi-LoRA kernels (``LoraMeta.mixed_step``): a prefill chunk's segments on SGMV,
the decode rows (one-token segments) on MBGMV over the meta's row list, in one ``lora_delta`` /
``lora_delta_stacked``.

- over the adapter-popularity shapes (identical, distinct, uniform, skewed) with base rows and
  chunks of base tokens mixed in, GQA-style stacked slices, adapters adapting only some slices:
  the Triton path = the torch reference (per-row x A B scale; it reads the segments as for the
  plain SGMV twin of the same step);
- ``lora_shrink`` / ``lora_expand`` and the per-slice ``lora_delta`` of a mixed meta equal the
  references;
- a CUDA graph's static row list (padding entries of adapter -1 pointing at row 0) gives exactly
  the eager list's output (replayed and eager mixed steps agree bit for bit);
- the metadata: tiles only for the segments of several tokens, rows for the one-token ones.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from deltaserve.kernels.lora import (
    LoraMeta,
    LoraSlice,
    lora_delta,
    lora_delta_stacked,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink_ref,
    lora_shrink_triton,
)
from kernels.test_lora import (
    DEVICE,
    GQA,
    POPULARITY,
    close,
    dense_adapters,
    embedded_stack,
    pooled,
    randn,
    request_adapters,
    stacked_dense,
    stacked_tables,
    token_adapters,
)

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU


def mixed_lens(popularity: str, seed: int) -> tuple[list[int], list[int]]:
    """A step as continuous batching forms it: decode rows of ``popularity`` adapters (base rows
    among them), a 16-token chunk of an adapter after the first few, a 3-token chunk of the base."""
    decodes = request_adapters(popularity, 6, seed)
    lens = [1] * 2 + [16] + [1] * 4 + [3]
    ids = decodes[:2] + [2] + decodes[2:] + [-1]
    return lens, ids


def test_mixed_meta_splits_rows_and_tiles() -> None:
    meta = LoraMeta.mixed_step([1, 20, 1, 1, 2, 1], [4, 1, -1, 7, 3, 0], DEVICE)
    assert meta.mixed and not meta.decode and meta.num_tokens == 26
    assert meta.rows is not None and meta.row_adapter is not None
    assert meta.rows.tolist() == [0, 22, 25] and meta.row_adapter.tolist() == [4, 7, 0]
    assert meta.tiles is not None and meta.tiles.tolist() == [[1, 1], [1, 17], [4, 23]]
    assert not LoraMeta.sgmv([1, 20], [4, 1], DEVICE).mixed


@pytest.mark.parametrize("popularity", POPULARITY)
def test_mixed_step_equals_reference(popularity: str) -> None:
    dtype = torch.float16
    seed = zlib.crc32(f"mixed/{popularity}".encode()) % 1000
    in_dim = 64
    lens, ids = mixed_lens(popularity, seed)
    meta = LoraMeta.mixed_step(lens, ids, DEVICE)
    twin = LoraMeta.sgmv(lens, ids, DEVICE)
    dense = stacked_dense(in_dim, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, in_dim, GQA, dtype, seed), in_dim, GQA, (0, 64, 96))
    x = randn(meta.num_tokens, in_dim, dtype=dtype, seed=seed + 1)
    base = randn(meta.num_tokens, 128, dtype=dtype, seed=seed + 2)
    got = lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True)
    want = lora_delta_stacked(x, base.clone(), stack, meta, use_triton=False)
    close(got, want)
    assert torch.equal(want, lora_delta_stacked(x, base.clone(), stack, twin, use_triton=False))
    adapters = torch.tensor(token_adapters(meta), device=DEVICE)
    assert torch.equal(got[adapters < 0], base[adapters < 0]), "tokens without an adapter keep out unchanged"
    assert not torch.equal(got[adapters >= 0], base[adapters >= 0])


def test_mixed_shrink_and_expand_equal_reference() -> None:
    dtype = torch.float32
    seed = 17
    lens, ids = mixed_lens("distinct", seed)
    meta = LoraMeta.mixed_step(lens, ids, DEVICE)
    w = pooled(dense_adapters(96, 80, dtype, seed), seed)
    x = randn(meta.num_tokens, 96, dtype=dtype, seed=seed + 1)
    base = randn(meta.num_tokens, 80, dtype=dtype, seed=seed + 2)
    v_ref = lora_shrink_ref(x, w, meta)
    close(lora_shrink_triton(x, w, meta), v_ref)
    want = lora_expand_ref(v_ref, w, meta, base.clone())
    close(lora_expand_triton(v_ref, w, meta, base.clone()), want)
    close(lora_delta(x, base.clone(), [LoraSlice(0, 80, w)], meta, use_triton=True), want)  # the per-slice path


def test_static_row_list_with_padding_is_exact() -> None:
    """A replayed mixed step reads a static row list longer than the step's rows (padding entries of
    adapter -1 at token 0): its output is the eager list's, bit for bit."""
    dtype = torch.bfloat16
    seed = 23
    lens, ids = mixed_lens("skewed", seed)
    meta = LoraMeta.mixed_step(lens, ids, DEVICE)
    assert meta.rows is not None and meta.row_adapter is not None
    pad = 7
    padded = dataclasses.replace(
        meta,
        rows=torch.cat([meta.rows, torch.zeros(pad, dtype=torch.int32, device=DEVICE)]),
        row_adapter=torch.cat([meta.row_adapter, torch.full((pad,), -1, dtype=torch.int32, device=DEVICE)]),
        num_rows=meta.num_rows + pad,
    )
    dense = stacked_dense(64, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, 64, GQA, dtype, seed), 64, GQA, (0, 64, 96))
    x = randn(meta.num_tokens, 64, dtype=dtype, seed=seed + 1)
    base = randn(meta.num_tokens, 128, dtype=dtype, seed=seed + 2)
    want = lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True)
    assert torch.equal(lora_delta_stacked(x, base.clone(), stack, padded, use_triton=True), want)
