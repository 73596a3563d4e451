"""Dense delta rows (``deltaserve.kernels.dense_delta``): Triton kernel = torch reference = per-row dense delta.

Checks:

- the Triton kernel equals ``dense_delta_rows_ref`` over the delta-popularity shapes of Punica's tests
  (identical: one delta; distinct: every request its own; uniform: ceil(sqrt(n)) deltas; skewed:
  Zipf-1.5 draws) with rows without a delta (-1) mixed in, float32 / float16 / bfloat16, (N, K) off
  and on the 64 x 128 block sizes, metadata from ``DeltaMeta.rows`` capped at 16-row tiles, uncapped
  (work tiles of 1, 4, 16 and 64 rows) and ``DeltaMeta.segments``. Float32 agrees to 1e-5; float16 /
  bfloat16 round twice like the reference, so at least 99% of elements are bit-equal and the rest
  within one unit in the last place;
- the reference equals an independent per-row computation (float64 ``x[t] @ D_s^T``, then the two
  roundings) from the row -> slot list, not from the metadata's grouping;
- rows of slot -1 are untouched bit for bit, padding tiles do nothing, and a launch whose metadata
  tensors were refilled in place after it was built (what a CUDA graph replays) follows the tensors;
- bad calls raise ``ValueError`` and leave ``out`` unchanged.

On CPU the kernel runs under the Triton interpreter; with ``DELTASERVE_TEST_GPU=1`` on CUDA.
"""

from __future__ import annotations

import math
import os
import zlib

import numpy as np
import pytest
import torch

from deltaserve.kernels.dense_delta import dense_delta_rows, dense_delta_rows_ref, dense_delta_rows_triton
from deltaserve.kernels.sbmm import DeltaMeta

pytestmark = pytest.mark.gpu_sbmm  # `make test-gpu-sbmm` selects it on a GPU

DEVICE = torch.device("cuda" if os.environ.get("DELTASERVE_TEST_GPU") == "1" else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POPULARITY = ["identical", "distinct", "uniform", "skewed"]
SHAPES = [(100, 72), (64, 128)]
"""(N, K): partial column and K tiles (BLOCK_N 64, BLOCK_K 128), then exactly one of each."""
ROWS = {"identical": 24, "distinct": 6, "uniform": 20, "skewed": 36}
"""Decode rows per popularity: with a quarter of them base-only, uncapped ``DeltaMeta.rows`` takes
work tiles of 64 (identical), 1 (distinct), 4 (uniform) and 16 (skewed) rows."""
METAS = ["rows16", "rows", "segments"]
NUM_SLOTS = 6


def request_deltas(popularity: str, n: int, seed: int, base_every: int = 4) -> list[int]:
    """Delta slot of each of ``n`` requests; every ``base_every``-th has none (-1)."""
    rng = np.random.default_rng(seed)
    if popularity == "identical":
        ids = [2] * n
    elif popularity == "distinct":  # each slot at most once per NUM_SLOTS requests
        ids = [int(s) for s in rng.permutation(NUM_SLOTS)] * math.ceil(n / NUM_SLOTS)
    elif popularity == "uniform":
        k = math.ceil(math.sqrt(n))
        ids = [int(i) % k for i in rng.permutation(n)]
    elif popularity == "skewed":  # Zipf-1.5 over the slots: a few deltas take most requests
        p = 1.0 / np.arange(1, NUM_SLOTS + 1) ** 1.5
        ids = [int(i) for i in rng.choice(NUM_SLOTS, size=n, p=p / p.sum())]
    else:
        raise AssertionError(popularity)
    return [-1 if i % base_every == base_every - 1 else a for i, a in enumerate(ids[:n])]


def make_meta(kind: str, popularity: str, seed: int) -> tuple[DeltaMeta, list[int]]:
    """The metadata and each row's slot. rows16 / rows: one row per request (tiles capped at 16 rows /
    uncapped); segments: 8 requests of 1..5 rows each."""
    if kind == "segments":
        slots = request_deltas(popularity, 8, seed)
        lens = [int(n) for n in np.random.default_rng(seed).integers(1, 6, size=len(slots))]
        return DeltaMeta.segments(lens, slots, DEVICE), [d for d, n in zip(slots, lens) for _ in range(n)]
    slots = request_deltas(popularity, ROWS[popularity], seed)
    return DeltaMeta.rows(slots, DEVICE, max_block_m=16 if kind == "rows16" else None), slots


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


def inputs(n: int, k: int, t: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """x [T, K], out [T, N], table [NUM_SLOTS, N, K] (delta-sized values, 0.02)."""
    return (randn(t, k, dtype=dtype, seed=seed), randn(t, n, dtype=dtype, seed=seed + 1),
            randn(NUM_SLOTS, n, k, dtype=dtype, seed=seed + 2, scale=0.02))  # fmt: skip


def per_row(x: torch.Tensor, out: torch.Tensor, table: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """The Semantics row by row from the slot list, the product in float64."""
    want = out.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            prod = (x[t].double() @ table[s].double().T).to(out.dtype)
            want[t] = (out[t].double() + prod.double()).to(out.dtype)
    return want


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: 1e-5. fp16 / bf16: within 1e-2 and >= 99% of the elements bit-equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    equal = (got == want).float().mean().item()
    assert equal >= 0.99, f"only {equal:.2%} of the elements are bit-equal"


def case_seed(popularity: str, dtype: torch.dtype, kind: str, shape: tuple[int, int]) -> int:
    return zlib.crc32(f"{popularity}/{dtype}/{kind}/{shape}".encode()) % 10_000


@pytest.mark.parametrize("shape", SHAPES, ids=[f"n{n}-k{k}" for n, k in SHAPES])
@pytest.mark.parametrize("kind", METAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_kernel_equals_reference(popularity: str, dtype: torch.dtype, kind: str, shape: tuple[int, int]) -> None:
    seed = case_seed(popularity, dtype, kind, shape)
    meta, slots = make_meta(kind, popularity, seed)
    x, base, table = inputs(*shape, meta.num_tokens, dtype, seed)

    want = dense_delta_rows_ref(x, base.clone(), table, meta)
    got = dense_delta_rows(x, base.clone(), table, meta, use_triton=True)
    close(got, want)
    ids = torch.tensor(slots, device=DEVICE)
    assert torch.equal(got[ids < 0], base[ids < 0]), "rows without a delta must keep out unchanged"
    assert not torch.equal(want[ids >= 0], base[ids >= 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_reference_equals_per_row_dense(popularity: str, dtype: torch.dtype) -> None:
    """The reference (grouped by ``meta.slot_tokens``) equals the Semantics row by row in float64; the
    entry point with ``use_triton=False`` is the reference."""
    for kind in METAS:
        seed = zlib.crc32(f"ref/{popularity}/{dtype}/{kind}".encode()) % 10_000
        meta, slots = make_meta(kind, popularity, seed)
        x, base, table = inputs(100, 72, meta.num_tokens, dtype, seed)
        want = per_row(x, base, table, slots)
        close(dense_delta_rows_ref(x, base.clone(), table, meta), want)
        assert torch.equal(dense_delta_rows(x, base.clone(), table, meta, use_triton=False),
                           dense_delta_rows_ref(x, base.clone(), table, meta))  # fmt: skip


def test_metas_cover_every_tile_size() -> None:
    """The cases of ``test_kernel_equals_reference`` reach every work-tile size of ``DeltaMeta`` (so both
    kernel BLOCK_Ms, 16 and 64, and tiles padded from 1 row to 16)."""
    sizes: dict[str, set[int]] = {kind: set() for kind in METAS}
    for p in POPULARITY:
        for dtype in DTYPES:
            for kind in METAS:
                for shape in SHAPES:
                    sizes[kind].add(make_meta(kind, p, case_seed(p, dtype, kind, shape))[0].block_m)
    assert sizes["rows"] >= {1, 4, 16, 64} and sizes["rows16"] >= {1, 4, 16}, sizes
    assert max(sizes["rows16"]) == 16 and {16, 64} & sizes["segments"], sizes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_padding_tiles_and_base_rows_untouched(dtype: torch.dtype) -> None:
    """A decode step with no delta rows (every one of its T tiles padding) launches and changes nothing,
    NaN / inf in out included; with a few delta rows, the other rows stay bit for bit."""
    t, n, k = 12, 100, 72
    x, base, table = inputs(n, k, t, dtype, 7)
    base[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    meta = DeltaMeta.rows([-1] * t, DEVICE)
    assert meta.num_tiles == 0 and meta.grid_tiles == t
    got = dense_delta_rows_triton(x, base.clone(), table, meta)
    assert torch.equal(got.view(torch.int16), base.view(torch.int16))

    slots = [-1, 3, -1, -1, 0, -1, -1, -1, 3, -1, -1, -1]
    meta = DeltaMeta.rows(slots, DEVICE)
    assert meta.num_tiles == 2 and meta.grid_tiles == t
    got = dense_delta_rows_triton(x, base.clone(), table, meta)
    rest = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(got[rest].view(torch.int16), base[rest].view(torch.int16))
    used = [i for i, s in enumerate(slots) if s >= 0]
    close(got[used], per_row(x, base, table, slots)[used])


def test_metadata_refilled_in_place() -> None:
    """The launch reads ``order`` / ``tiles`` on the device, whatever the host fields say: metadata
    built for an all-base step, refilled in place with another step's tensors (same T and block_m, as
    a captured CUDA graph's static tensors are), computes the other step."""
    t, n, k = 10, 64, 128
    x, base, table = inputs(n, k, t, torch.float32, 11)
    static = DeltaMeta.rows([-1] * t, DEVICE)
    step = DeltaMeta.rows([5, -1, 0, 1, -1, 2, 3, -1, 4, -1], DEVICE)
    assert static.block_m == step.block_m == 1
    static.order.copy_(step.order)
    static.tiles.copy_(step.tiles)
    close(dense_delta_rows_triton(x, base.clone(), table, static), dense_delta_rows_ref(x, base.clone(), table, step))


def _bad_calls() -> dict:
    """name -> (error match, function of (x, out, table, meta) giving the bad call's arguments)."""
    f16 = torch.float16
    return {
        "table-N": ("table", lambda x, o, tb, m: (x, o, tb[:, :-1].contiguous(), m)),
        "table-K": ("table", lambda x, o, tb, m: (x, o, tb[:, :, :-1].contiguous(), m)),
        "table-2d": ("table", lambda x, o, tb, m: (x, o, tb[0], m)),
        "table-dtype": ("dtype mismatch", lambda x, o, tb, m: (x, o, tb.to(f16), m)),
        "out-dtype": ("dtype mismatch", lambda x, o, tb, m: (x, o.to(f16), tb, m)),
        "x-rows": ("x ", lambda x, o, tb, m: (x[:-1], o, tb, m)),
        "x-dtype": ("x dtype", lambda x, o, tb, m: (x.to(torch.int32), o, tb, m)),
        "slot-range": ("slot 6 out of range", lambda x, o, tb, m: (x, o, tb, DeltaMeta.rows([0, 6, -1, 1], DEVICE))),
        "dense-segments": ("dense segments", lambda x, o, tb, m: (
            x, o, tb, DeltaMeta.segments([2, 2], [0, 1], DEVICE, max_block_m=16, dense_min_m=2))),
        "out-strided": ("contiguous last dim", lambda x, o, tb, m: (
            x, torch.stack([o, o], dim=-1)[..., 0], tb, m)),
        "x-strided": ("contiguous last dim", lambda x, o, tb, m: (x.t().contiguous().t(), o, tb, m)),
        "table-strided": ("must be contiguous", lambda x, o, tb, m: (x, o, tb.transpose(1, 2).contiguous()
                                                                     .transpose(1, 2), m)),
    }  # fmt: skip


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_calls_raise_and_change_nothing(case: str, use_triton: bool) -> None:
    match, make = _bad_calls()[case]
    x, out, table = inputs(32, 16, 4, torch.float32, 3)
    meta = DeltaMeta.rows([0, 2, -1, 1], DEVICE)
    x, out, table, meta = make(x, out, table, meta)
    before = out.clone()
    with pytest.raises(ValueError, match=match):
        dense_delta_rows(x, out, table, meta, use_triton=use_triton)
    assert torch.equal(out, before)
