"""The ``tiles`` LoRA decode path: decode rows grouped by adapter and run as SGMV tiles gathered
through the group order (``LoraMeta.groups``, ``kernels/lora/meta.py`` ``adapter_groups``).

- the grouping: every row with an adapter appears once, groups are contiguous and sorted by slot,
  token order kept within a group, tiles of at most 16 rows cover exactly the grouped rows, and the
  static tile bound (``group_tile_bound``) holds for any assignment; padding tiles name a group of
  adapter -1;
- the kernels over Punica's popularity shapes (identical, distinct, uniform, skewed) with mixed
  ranks, base rows mixed in, one slice and a GQA stack, float32 / float16 / bfloat16: the tiles path
  = the torch reference, and = the split decode path within rounding;
- a CUDA graph's static group buffer (the tile list padded to the bound, rows padded with -1)
  computes bit for bit what the exact eager meta computes (different split-K choices included);
- the path needs ``groups``: a decode meta without them is refused.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from deltaserve.kernels import lora as lora_kernels
from deltaserve.kernels.lora import (
    SGMV_TILE,
    LoraMeta,
    LoraSlice,
    group_buffer,
    group_tile_bound,
    grouped_view,
    lora_delta,
    lora_delta_stacked,
    lora_delta_stacked_ref,
    lora_expand_ref,
    lora_shrink_ref,
    sgmv,
)
from deltaserve.kernels.lora.meta import adapter_groups
from kernels.test_lora import (
    DEVICE,
    DTYPES,
    GQA,
    NUM_SLOTS,
    POPULARITY,
    close,
    dense_adapters,
    embedded_stack,
    pooled,
    randn,
    request_adapters,
    stacked_dense,
    stacked_tables,
)

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU


@pytest.fixture
def tiles_path():
    previous = lora_kernels.set_decode_path("tiles")
    yield
    lora_kernels.set_decode_path(previous)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_adapter_groups_cover_each_adapter_row_once(popularity: str, rows: int) -> None:
    ids = request_adapters(popularity, rows, seed=rows)
    rows = len(ids)  # "distinct" stops at NUM_SLOTS rows
    order, starts, adapters = adapter_groups(ids)
    assert sorted(order) == [t for t, a in enumerate(ids) if a >= 0]
    assert adapters == sorted(set(adapters)), "one group per adapter, by slot"
    assert len(starts) == (len(adapters) + 1 if adapters else 1) and starts[-1] == len(order)
    for g, a in enumerate(adapters):
        members = order[starts[g] : starts[g + 1]]
        assert members and all(ids[t] == a for t in members) and members == sorted(members)
    flat = group_buffer(ids, rows, None)
    meta = grouped_view(torch.tensor(flat, dtype=torch.int32), ids, None)
    tiles = meta.tiles.tolist()
    covered = [p for g, m0 in tiles for p in range(m0, min(m0 + SGMV_TILE, starts[g + 1]))]
    assert covered == list(range(len(order))), "tiles cover every grouped row once, in order"
    assert len(tiles) <= group_tile_bound(rows, NUM_SLOTS)


def test_group_buffer_pads_to_the_static_bound() -> None:
    ids = [2, -1, 2, 0, 2]
    bound = group_tile_bound(8, NUM_SLOTS)
    flat = group_buffer(ids + [-1] * 3, 8, bound)
    meta = grouped_view(torch.tensor(flat, dtype=torch.int32), None, bound, rows=8)
    assert meta.num_tiles == bound == meta.tiles.shape[0] and meta.order is not None
    tiles = meta.tiles.tolist()
    real = [(0, 0), (1, 1)]  # group 0: adapter 0 (row 3); group 1: adapter 2 (rows 0, 2, 4)
    assert [tuple(t) for t in tiles[:2]] == real
    assert meta.order.tolist()[:4] == [3, 0, 2, 4]
    pad_group = tiles[2][0]
    assert all(tuple(t) == (pad_group, 4) for t in tiles[2:]) and meta.seg_adapter.tolist()[pad_group] == -1
    with pytest.raises(ValueError, match="static bound"):
        group_buffer(list(range(8)), 8, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_tiles_path_equals_reference(popularity: str, dtype: torch.dtype, tiles_path) -> None:
    """One slice and a GQA stack (64 | 32 | 32), 21 decode rows (12 distinct; two tiles for a popular adapter),
    mixed ranks, base rows: the tiles path = the reference, and = the split path within rounding."""
    seed = zlib.crc32(f"tiles/{popularity}/{dtype}".encode()) % 1000
    ids = request_adapters(popularity, 21, seed)
    tokens, in_dim = len(ids), 96  # "distinct": NUM_SLOTS rows
    meta = LoraMeta.mbgmv(ids, DEVICE)
    assert meta.groups is not None
    w = pooled(dense_adapters(in_dim, 72, dtype, seed), seed)
    x = randn(tokens, in_dim, dtype=dtype, seed=seed + 1)
    base = randn(tokens, 72, dtype=dtype, seed=seed + 2)
    want = lora_expand_ref(lora_shrink_ref(x, w, meta), w, meta, base.clone())
    got = lora_delta(x, base.clone(), [LoraSlice(0, 72, w)], meta, use_triton=True)
    close(got, want)
    rows_without = [t for t in range(tokens) if meta.seg_adapter_host[t] < 0]
    assert torch.equal(got[rows_without], base[rows_without]), "base rows keep out as it is"
    lora_kernels.set_decode_path("split")
    close(lora_delta(x, base.clone(), [LoraSlice(0, 72, w)], meta, use_triton=True), got)
    lora_kernels.set_decode_path("tiles")
    dense = stacked_dense(in_dim, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, in_dim, GQA, dtype, seed), in_dim, GQA, (0, 64, 96))
    out = randn(tokens, 128, dtype=dtype, seed=seed + 3)
    close(
        lora_delta_stacked(x, out.clone(), stack, meta, use_triton=True),
        lora_delta_stacked_ref(x, out.clone(), stack, meta),
    )


@pytest.mark.parametrize("popularity", POPULARITY)
def test_static_group_buffer_equals_exact_meta(popularity: str, tiles_path, monkeypatch) -> None:
    """A CUDA graph's meta: rows padded to the bucket with -1, the tile list padded to the bound, and
    another split-K (the split follows the tile count, so a graph and an eager step may pick
    different ones; forced here, 1 against 3 of the 3 input chunks): bit for bit the eager result."""
    seed = zlib.crc32(f"tiles-static/{popularity}".encode()) % 1000
    ids = request_adapters(popularity, 13, seed)
    tokens, bucket, in_dim, dtype = len(ids), 16, 1100, torch.float16  # "distinct": NUM_SLOTS rows
    eager = LoraMeta.mbgmv(ids, DEVICE)
    bound = group_tile_bound(bucket, NUM_SLOTS)
    buf = torch.tensor(group_buffer(ids + [-1] * (bucket - tokens), bucket, bound), dtype=torch.int32, device=DEVICE)
    static = LoraMeta.mbgmv(ids + [-1] * (bucket - tokens), DEVICE)
    static = dataclasses_replace(static, groups=grouped_view(buf, None, bound, rows=bucket))
    dense = stacked_dense(in_dim, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, in_dim, GQA, dtype, seed), in_dim, GQA, (0, 64, 96))
    x = randn(bucket, in_dim, dtype=dtype, seed=seed + 1)
    out = randn(bucket, 128, dtype=dtype, seed=seed + 2)
    monkeypatch.setattr(sgmv, "_FORCED", "1")
    got_eager = lora_delta_stacked(x[:tokens], out[:tokens].clone(), stack, eager, use_triton=True)
    monkeypatch.setattr(sgmv, "_FORCED", "3")
    assert sgmv.sgmv_split(in_dim, bound, bucket, 3, 64, DEVICE, gathered=True) == 3
    got_static = lora_delta_stacked(x, out.clone(), stack, static, use_triton=True)
    assert torch.equal(got_static[:tokens], got_eager)
    assert torch.equal(got_static[tokens:], out[tokens:]), "padding rows are untouched"


def test_tiles_path_needs_groups(tiles_path) -> None:
    meta = LoraMeta.mbgmv([0, 1], DEVICE)
    no_groups = dataclasses_replace(meta, groups=None)
    w = pooled(dense_adapters(64, 32, torch.float32, 1), 1)
    x = randn(2, 64, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="adapter groups"):
        lora_delta(x, torch.zeros(2, 32, device=DEVICE), [LoraSlice(0, 32, w)], no_groups, use_triton=True)


def dataclasses_replace(meta: LoraMeta, **changes) -> LoraMeta:
    return dataclasses.replace(meta, **changes)
