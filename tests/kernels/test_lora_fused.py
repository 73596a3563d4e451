"""The fused decode LoRA kernel (``kernels/lora/fused.py``): one launch per module = the torch reference.

- over Punica's adapter-popularity shapes (identical, distinct, uniform, skewed) with mixed ranks
  4 / 8 / 16 / 64 (ranks above BLOCK_R go through the program's scratch), rows without an adapter,
  adapters that adapt only some slices, GQA-like unequal slices as strided views inside larger
  tables, float32 / float16 / bfloat16: fused stacked = reference, fused = split decode path;
- a small launch config (monkeypatched) so rows span several row blocks, columns several chunks
  and sub-tiles, input columns several reduction steps, at interpreter-sized shapes;
- the adapted module launches exactly one kernel per call, with a grid that depends on shapes only
  (not on which rows use which adapter);
- GPU only (``make test-gpu-kernels``): a CUDA graph captured once replays other row -> adapter
  assignments exactly as eager calls compute them.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from deltaserve.kernels import lora as lora_kernels
from deltaserve.kernels.lora import LoraMeta, fused, lora_delta_stacked, lora_delta_stacked_ref, mbgmv
from kernels.test_lora import (
    DEVICE,
    DTYPES,
    GQA,
    NUM_SLOTS,
    POPULARITY,
    close,
    embedded_stack,
    randn,
    request_adapters,
    stacked_dense,
    stacked_tables,
    token_adapters,
)

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU

SMALL = {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 32, "BLOCK_N": 16, "CHUNK_N": 32, "num_warps": 4}
"""A launch that splits interpreter-sized shapes: 2+ row blocks, chunks, sub-tiles, reduction steps."""


@pytest.fixture
def decode_path():
    """Sets a decode path for one test and restores the previous one."""
    previous = lora_kernels.get_decode_path()
    yield lora_kernels.set_decode_path
    lora_kernels.set_decode_path(previous)


def gqa_case(popularity: str, dtype: torch.dtype, tokens: int, in_dim: int):
    """A GQA qkv-like stack (slices 64 | 32 | 32 inside out's 128 columns) of NUM_SLOTS adapters of
    mixed ranks, decode metadata of ``tokens`` rows, x and a base output."""
    seed = zlib.crc32(f"fused/{popularity}/{dtype}/{tokens}".encode()) % 1000
    meta = LoraMeta.mbgmv(request_adapters(popularity, tokens, seed), DEVICE)
    dense = stacked_dense(in_dim, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, in_dim, GQA, dtype, seed), in_dim, GQA, (0, 64, 96))
    x = randn(tokens, in_dim, dtype=dtype, seed=seed + 1)
    base = randn(tokens, 128, dtype=dtype, seed=seed + 2)
    return meta, stack, x, base


CASES = [(p, torch.float32) for p in POPULARITY] + [("skewed", d) for d in DTYPES if d != torch.float32]
"""Every popularity in float32, the low-precision dtypes on one (interpreter time is the CI budget)."""


@pytest.mark.parametrize("popularity,dtype", CASES)
def test_fused_equals_reference(popularity: str, dtype: torch.dtype, decode_path) -> None:
    meta, stack, x, base = gqa_case(popularity, dtype, 12, 64)
    decode_path("fused")
    got = lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True)
    close(got, lora_delta_stacked_ref(x, base.clone(), stack, meta))
    ids = torch.tensor(token_adapters(meta), device=DEVICE)
    assert torch.equal(got[ids < 0], base[ids < 0]), "rows without an adapter keep out unchanged"
    if DEVICE.type == "cuda" or dtype == torch.float16:  # fused = split (tolerance: other summation order)
        decode_path("split")
        close(got, lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True))


@pytest.mark.parametrize("popularity", POPULARITY if DEVICE.type == "cuda" else ["identical", "skewed"])
def test_fused_small_tiles(popularity: str, decode_path, monkeypatch) -> None:
    """40 rows (3 row blocks; distinct: 12, one block), slices of 64 / 32 columns (2 / 1 chunks of 2 sub-tiles), 72 input
    columns (3 reduction steps, a ragged last one); fp16."""
    monkeypatch.setattr(fused, "FUSED_LAUNCH", SMALL)
    decode_path("fused")
    meta, stack, x, base = gqa_case(popularity, torch.float16, 12 if popularity == "distinct" else 40, 72)
    got = lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True)
    close(got, lora_delta_stacked_ref(x, base.clone(), stack, meta))


def test_one_launch_per_module_grid_from_shapes(decode_path, monkeypatch) -> None:
    """The stacked decode call launches the fused kernel once and nothing of the split path; the
    grid is the same for any row -> adapter assignment of the same shapes."""
    decode_path("fused")
    launches: list[tuple] = []
    real = fused.fused_decode_grid
    monkeypatch.setattr(fused, "fused_decode_grid", lambda t, w: launches.append(real(t, w)) or real(t, w))

    def split_used(*args, **kwargs):
        raise AssertionError("the fused decode path launched a split-path kernel")

    monkeypatch.setattr(lora_kernels, "mbgmv_shrink_partials", split_used)
    monkeypatch.setattr(lora_kernels, "mbgmv_expand", split_used)
    for popularity in ("identical", "distinct"):
        meta, stack, x, base = gqa_case(popularity, torch.float32, 4, 64)
        lora_delta_stacked(x, base, stack, meta, use_triton=True)
    assert len(launches) == 2 and launches[0] == launches[1]
    assert launches[0] == (stack.num_adapters * 1, 1, 3), launches  # 4 rows: one row block; 64 columns
    assert mbgmv.MB_SHRINK_LAUNCH  # the split path stays importable for A/B runs


def test_bad_decode_path() -> None:
    with pytest.raises(ValueError, match="decode path 'fast'"):
        lora_kernels.set_decode_path("fast")
    assert lora_kernels.get_decode_path() in lora_kernels.DECODE_PATHS


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU (make test-gpu-kernels)")
def test_fused_graph_replay_equals_eager(decode_path) -> None:
    """Captured once over static row -> adapter buffers, replayed with other assignments: the same
    results as eager calls (identical, then distinct, then skewed rows; one row per slot, as many
    as "distinct" can give)."""
    decode_path("fused")
    meta0, stack, x, base = gqa_case("identical", torch.float16, NUM_SLOTS, 128)
    rows = meta0.seg_adapter.clone()
    static_meta = LoraMeta(
        seg_start=meta0.seg_start, seg_adapter=rows, seg_start_host=meta0.seg_start_host,
        seg_adapter_host=meta0.seg_adapter_host, num_tokens=NUM_SLOTS, max_adapter=stack.num_adapters - 1, decode=True,
    )  # fmt: skip
    out = base.clone()
    lora_delta_stacked(x, out, stack, static_meta)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_delta_stacked(x, out, stack, static_meta)
    for popularity in ("identical", "distinct", "skewed"):
        meta = LoraMeta.mbgmv(request_adapters(popularity, NUM_SLOTS, 7), DEVICE)
        rows.copy_(meta.seg_adapter)
        out.copy_(base)
        graph.replay()
        want = lora_delta_stacked(x, base.clone(), stack, meta)
        assert torch.equal(out, want), popularity
        close(out, lora_delta_stacked_ref(x, base.clone(), stack, meta))
