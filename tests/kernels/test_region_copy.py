"""``copy_regions`` (``deltaserve.kernels.region_copy``): kernel = reference = the definition.

The tables are those of real placements: ``AdapterLayout.plan`` of adapters of S-LoRA's S2 ranks
(8 / 16 / 32 / 64) on q/k/v/o or all seven projections of a small model, put into a pool's pages
in the order the popularity shapes give (identical: one adapter placed again and again; distinct:
every rank once; uniform and skewed: drawn over the ranks uniformly or Zipf-1.5), on pages
handed out shuffled. The kernel's pool must equal the reference's bit for bit, and both must
equal the definition: each run holds its source slice in every layer and nothing else changed.
Bad tables are refused before anything is copied.

On CPU the kernel runs under the Triton interpreter; with ``DELTASERVE_TEST_GPU=1`` on CUDA.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from deltaserve.adapters.lora_pool import AdapterLayout
from deltaserve.kernels.region_copy import copy_regions

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU

DEVICE = torch.device("cuda" if os.environ.get("DELTASERVE_TEST_GPU") == "1" else "cpu")
L, S, NB = 3, 512, 40  # layers, elements per page half, pages
FEATURES = {
    "q_proj": (64, 64),
    "k_proj": (64, 32),
    "v_proj": (64, 32),
    "o_proj": (64, 64),
    "gate_proj": (64, 160),
    "up_proj": (64, 160),
    "down_proj": (160, 64),
}
ORDER = tuple(FEATURES)
RANKS = (8, 16, 32, 64)
TARGETS = {"qkvo": ORDER[:4], "all": ORDER}


def popularity(shape: str, n: int, rng: random.Random) -> list[int]:
    if shape == "identical":
        return [64] * n
    if shape == "distinct":
        return list(RANKS)
    weights = [1.0] * len(RANKS) if shape == "uniform" else [1 / (i + 1) ** 1.5 for i in range(len(RANKS))]
    return rng.choices(RANKS, weights, k=n)


def placement_table(rank: int, targets, pages: list[int]) -> tuple[torch.Tensor, int]:
    """(src start, dst start, length) per region of one adapter on ``pages``, and its packed width."""
    layout = AdapterLayout.plan({p: rank for p in targets}, FEATURES, ORDER, S)
    rows, src = [], 0
    for k, used in enumerate(layout.region_used):
        rows.append((src, ((k % 2) * NB + pages[k // 2]) * S, used))
        src += used
    return torch.tensor(rows, dtype=torch.int64), layout.num_blocks


@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("shape", ["identical", "distinct", "uniform", "skewed"])
def test_kernel_equals_reference_and_definition(shape: str, targets: str) -> None:
    rng = random.Random(zlib.crc32(f"{shape}/{targets}".encode()))
    gen = torch.Generator().manual_seed(7)
    pool_ref = torch.randn(L, 2 * NB * S, generator=gen).to(torch.float16).to(DEVICE)
    pool_kernel = pool_ref.clone()
    want = pool_ref.clone()
    free = list(range(NB))
    rng.shuffle(free)
    for rank in popularity(shape, 4, rng):
        blocks = AdapterLayout.plan({p: rank for p in TARGETS[targets]}, FEATURES, ORDER, S).num_blocks
        if blocks > len(free):
            break
        pages = [free.pop() for _ in range(blocks)]
        table, _ = placement_table(rank, TARGETS[targets], pages)
        width = int(table[:, 0][-1] + table[:, 2][-1])
        src = torch.randn(L, width, generator=gen).to(torch.float16).to(DEVICE)
        copy_regions(src, pool_ref, table, use_triton=False)
        copy_regions(src, pool_kernel, table, use_triton=True)
        for s, d, n in table.tolist():  # the definition
            want[:, d : d + n] = src[:, s : s + n]
    assert torch.equal(pool_kernel, pool_ref)
    assert torch.equal(pool_ref, want)


def test_strided_destination_rows_and_empty_tables() -> None:
    """The pool's flat view is rows of one large tensor; only the columns of the runs change."""
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(L, 3 * S, generator=gen).to(DEVICE)
    dst = big[:, S : 3 * S]  # rows contiguous, row stride 3 S
    before = big.clone()
    src = torch.randn(L, 100, generator=gen).to(DEVICE)
    table = torch.tensor([[0, 5, 60], [60, S + 7, 40], [10, 300, 0]], dtype=torch.int64)
    copy_regions(src, dst, table, use_triton=True)
    want = before.clone()
    want[:, S + 5 : S + 65] = src[:, :60]
    want[:, 2 * S + 7 : 2 * S + 47] = src[:, 60:100]
    assert torch.equal(big, want)
    copy_regions(src, dst, torch.zeros(0, 3, dtype=torch.int64), use_triton=True)
    assert torch.equal(big, want)


@pytest.mark.parametrize("use_triton", [False, True])
def test_bad_tables_are_refused_and_copy_nothing(use_triton: bool) -> None:
    src = torch.ones(L, 10, device=DEVICE)
    dst = torch.zeros(L, 20, device=DEVICE)
    bad = {
        "past src": (torch.tensor([[0, 0, 5], [8, 5, 3]]), "past src"),
        "past dst": (torch.tensor([[0, 0, 5], [0, 18, 3]]), "past src .* or dst"),
        "negative": (torch.tensor([[0, -1, 5]]), "negative"),
        "shape": (torch.tensor([[0, 0]]), r"host int64 \[R, 3\]"),
        "dtype": (torch.tensor([[0, 0, 5]], dtype=torch.int32), r"host int64 \[R, 3\]"),
    }
    for table, match in bad.values():
        with pytest.raises(ValueError, match=match):
            copy_regions(src, dst, table, use_triton=use_triton)
    with pytest.raises(ValueError, match="must be .L, \\*. with one L"):
        copy_regions(src[:2], dst, torch.tensor([[0, 0, 1]]), use_triton=use_triton)
    with pytest.raises(ValueError, match="differ"):
        copy_regions(src.half(), dst, torch.tensor([[0, 0, 1]]), use_triton=use_triton)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        copy_regions(src, dst.t().contiguous().t(), torch.tensor([[0, 0, 1]]), use_triton=use_triton)
    assert not dst.any(), "a refused table copied something"
    if use_triton:
        with pytest.raises(ValueError, match="table_dev"):
            copy_regions(
                src,
                dst,
                torch.tensor([[0, 0, 1]]),
                table_dev=torch.zeros(2, 3, dtype=torch.int64, device=DEVICE),
                use_triton=True,
            )
