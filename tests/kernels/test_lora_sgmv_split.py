"""Split-K SGMV shrink (``kernels.lora.sgmv``): a short chunk's input columns split over programs.

- over the adapter-popularity shapes (identical, distinct, uniform, skewed), a GQA-style stack with
  adapters adapting only some slices and base tokens mixed in: SPLIT 1, 2 and 3 (forced through a
  monkeypatched ``sgmv_split``) each equal the torch reference, and one another bit for bit, over an
  input width whose last chunk is ragged (4 chunks: the splits 2 / 2, 2 / 1 / 1);
- the per-slice path and ``lora_shrink`` / ``lora_expand``: the unsplit v is exactly the split
  partials summed in chunk order, so a split delta equals shrink-then-expand bit for bit;
- mixed steps (decode rows on MBGMV next to the chunk on SGMV) and a graph bucket's static tile list
  (idle tiles of the padding segment) give the eager step's output whatever SPLIT each picks;
- ``sgmv_split``: 1 for a chunk that fills the GPU, capped at the chunk count, the graph's static
  tile bound counted by tokens;
- the expand's column loop (``sgmv_col_steps`` tiles of BLOCK_N columns a program): 1 to 4 steps,
  ragged groups, groups past a narrower slice, ranks over several rank tiles, with and without the
  split shrink's partials, give the same bits, equal to the reference; and its rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch

from deltaserve.kernels.lora import (
    LoraMeta,
    LoraSlice,
    LoraStack,
    lora_delta,
    lora_delta_stacked,
    lora_expand_triton,
    lora_shrink_triton,
)
from deltaserve.kernels.lora import sgmv as sgmv_kernels
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

IN_DIM = 200
"""Input width: chunks of 64 columns (one BLOCK_K step, as set below) 64 / 64 / 64 / 8, the last
one ragged."""
SPLITS = (1, 2, 3)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch) -> None:
    """Chunks of 64 columns (two BLOCK_K steps of 32), so a small width has several."""
    monkeypatch.setitem(sgmv_kernels.SGMV_SPLIT, "CHUNK_K", 64)
    monkeypatch.setitem(sgmv_kernels._SHRINK, "BLOCK_K", 32)
    assert sgmv_kernels.sgmv_chunks(IN_DIM) == 4


def forced(monkeypatch, split: int) -> None:
    monkeypatch.setattr(sgmv_kernels, "sgmv_split", lambda *_: split)


def chunk_lens(popularity: str, seed: int) -> tuple[list[int], list[int]]:
    """Four requests' chunks (3 to 18 tokens, one of two tiles), every fourth of the base."""
    ids = request_adapters(popularity, 4, seed)
    return [18, 3, 9, 5], ids


def gqa_chunks(popularity: str, tag: str) -> tuple[LoraMeta, LoraStack, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk_lens``' four chunks over the GQA stack (fp16, seeded by ``tag`` and the popularity):
    (meta, stack, x, out before, the reference's out after)."""
    dtype = torch.float16
    seed = zlib.crc32(f"{tag}/{popularity}".encode()) % 1000
    lens, ids = chunk_lens(popularity, seed)
    meta = LoraMeta.sgmv(lens, ids, DEVICE)
    dense = stacked_dense(IN_DIM, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, IN_DIM, GQA, dtype, seed), IN_DIM, GQA, (0, 64, 96))
    x = randn(meta.num_tokens, IN_DIM, dtype=dtype, seed=seed + 1)
    base = randn(meta.num_tokens, 128, dtype=dtype, seed=seed + 2)
    return meta, stack, x, base, lora_delta_stacked(x, base.clone(), stack, meta, use_triton=False)


@pytest.mark.parametrize("popularity", POPULARITY)
def test_split_stacked_equals_reference_for_every_split(popularity: str, monkeypatch) -> None:
    meta, stack, x, base, want = gqa_chunks(popularity, "sgmv-split")
    got = {}
    for split in SPLITS:
        forced(monkeypatch, split)
        got[split] = lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True)
        close(got[split], want)
        assert torch.equal(got[split], got[1]), f"SPLIT {split} must give the unsplit delta bit for bit"
    adapters = torch.tensor(token_adapters(meta), device=DEVICE)
    assert torch.equal(got[3][adapters < 0], base[adapters < 0]), "tokens without an adapter keep out unchanged"


def test_split_partials_sum_to_the_unsplit_v(monkeypatch) -> None:
    """Per slice (bfloat16, ranks 4..64 over several rank tiles): the partials summed in chunk order
    and rounded are ``lora_shrink``'s v exactly, and a split ``lora_delta`` is shrink-then-expand."""
    dtype = torch.bfloat16
    seed = 31
    meta = LoraMeta.sgmv([18, 5, 11], [2, 3, 1], DEVICE)  # ranks 16, 64, 8 (RANKS cycle)
    w = pooled(dense_adapters(IN_DIM, 80, dtype, seed), seed)
    x = randn(meta.num_tokens, IN_DIM, dtype=dtype, seed=seed + 1)
    base = randn(meta.num_tokens, 80, dtype=dtype, seed=seed + 2)
    v = lora_shrink_triton(x, w, meta)
    part = sgmv_kernels.sgmv_shrink_partials(x, w, meta, 3)
    total = torch.zeros(part.shape[2:], dtype=torch.float32, device=DEVICE)
    for c in range(part.shape[1]):
        total += part[0, c]
    ranks = w.rank.tolist()
    for t, a in enumerate(token_adapters(meta)):
        r = ranks[a]
        assert torch.equal(total[t, :r].to(dtype), v[t, :r]), (t, a)
    two_step = lora_expand_triton(v, w, meta, base.clone())
    forced(monkeypatch, 3)
    split = lora_delta(x, base.clone(), [LoraSlice(0, 80, w)], meta, use_triton=True)
    assert torch.equal(split, two_step)


def test_split_mixed_step_and_static_tiles(monkeypatch) -> None:
    """A mixed step (decode rows on MBGMV, the chunk on SGMV) split 1 and 3 equals the reference and
    itself; a graph bucket's tile list (the real tiles, then idle tiles of the padding segment, 16
    tokens of padding), split 4 and 2, gives the eager rows exactly."""
    dtype = torch.float16
    seed = 41
    lens = [1, 1, 20, 1, 3]
    ids = [4, -1, 2, 7, -1]
    meta = LoraMeta.mixed_step(lens, ids, DEVICE)
    padded_lens = lens + [16]
    static = LoraMeta.mixed_step(padded_lens, ids + [-1], DEVICE)
    assert static.tiles is not None and meta.tiles is not None and meta.rows is not None
    idle = torch.tensor([[len(lens), 0]] * 5, dtype=torch.int32, device=DEVICE)
    static = LoraMeta(
        seg_start=static.seg_start, seg_adapter=static.seg_adapter, seg_start_host=static.seg_start_host,
        seg_adapter_host=static.seg_adapter_host, num_tokens=static.num_tokens, max_adapter=static.max_adapter,
        decode=False, tiles=torch.cat([meta.tiles, idle]), num_tiles=meta.num_tiles + 5,
        rows=meta.rows, row_adapter=meta.row_adapter, num_rows=meta.num_rows,
    )  # fmt: skip
    dense = stacked_dense(IN_DIM, GQA, dtype, seed)
    stack = embedded_stack(*stacked_tables(dense, IN_DIM, GQA, dtype, seed), IN_DIM, GQA, (0, 64, 96))
    x = randn(static.num_tokens, IN_DIM, dtype=dtype, seed=seed + 1)
    base = randn(static.num_tokens, 128, dtype=dtype, seed=seed + 2)
    t = meta.num_tokens
    want = lora_delta_stacked(x[:t], base[:t].clone(), stack, meta, use_triton=False)
    first = None
    for split in (1, 3):
        forced(monkeypatch, split)
        got = lora_delta_stacked(x[:t], base[:t].clone(), stack, meta, use_triton=True)
        close(got, want)
        first = got if first is None else first
        assert torch.equal(got, first)
        forced(monkeypatch, 5 - split)  # the graph picks another SPLIT than the eager step (4: one chunk each)
        replayed = lora_delta_stacked(x, base.clone(), stack, static, use_triton=True)
        assert torch.equal(replayed[:t], got) and torch.equal(replayed[t:], base[t:])


def test_split_rule(monkeypatch) -> None:
    """SPLIT from shapes: 1 once tiles x slices reach min_programs_per_sm (2 here, as configured) x
    the SMs (132 off the GPU) or the partials would pass 16 MB, else enough splits for that many
    programs, at most the chunk count (64-column chunks here)."""
    monkeypatch.setitem(sgmv_kernels.SGMV_SPLIT, "min_programs_per_sm", 2)
    cpu = torch.device("cpu")
    rule = sgmv_kernels.sgmv_split
    assert rule(4096, 2, 32, 3, 16, cpu) == 44  # a 32-token chunk, qkv: cdiv(264, 6) of 64 chunks
    assert rule(4096, 2, 32, 1, 16, cpu) == 64  # every chunk its own program
    assert rule(IN_DIM, 2, 32, 1, 16, cpu) == 4  # capped at the chunks
    assert rule(4096, 10, 160, 3, 16, cpu) == 9  # cdiv(264, 30)
    assert rule(4096, 88, 1408, 3, 16, cpu) == 1  # 264 programs: the chunk fills the GPU
    assert rule(4096, 300, 4800, 1, 16, cpu) == 1
    assert rule(4096, 200, 3200, 1, 16, cpu) == 2  # partials of 64 x 3200 x 16 x 4 bytes (13 MB)
    assert rule(4096, 200, 3200, 1, 128, cpu) == 1  # ... of 64 x 3200 x 128 x 4 bytes pass 16 MB
    assert rule(4096, 2, 32, 3, 0, cpu) == 44  # (a pool without ranks)
    # A graph bucket's static tile list (cdiv(T, 16) + sequences, mostly idle) counts as its tokens' tiles.
    assert rule(4096, 2 + 32, 32, 3, 16, cpu) == rule(4096, 2, 32, 3, 16, cpu)


@pytest.mark.parametrize("popularity", POPULARITY)
def test_expand_column_steps_give_the_same_bits(popularity: str, monkeypatch) -> None:
    """BLOCK_N 16 over the GQA stack (q 4 column tiles, k / v 2): 3 steps leave q a ragged second
    group and k / v a group past their width; rank 64 (RANKS) takes the loop over further rank tiles."""
    monkeypatch.setitem(sgmv_kernels._EXPAND, "BLOCK_N", 16)
    meta, stack, x, base, want = gqa_chunks(popularity, "sgmv-cols")
    first = None
    for split in (1, 3):
        forced(monkeypatch, split)
        for steps in (1, 2, 3, 4):
            monkeypatch.setattr(sgmv_kernels, "sgmv_col_steps", lambda *_, n=steps: n)
            got = lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True)
            close(got, want)
            first = got if first is None else first
            assert torch.equal(got, first), f"split {split}, {steps} column steps"


def test_column_steps_rule(monkeypatch) -> None:
    """The most column steps (a power of two, at most max_col_steps, 8 here, never more than the
    tiles) that keep min_programs_per_sm x the SMs programs (4 x 132 off the GPU: 528), the chunk's
    tiles counted by tokens."""
    monkeypatch.setitem(sgmv_kernels._EXPAND, "max_col_steps", 8)
    monkeypatch.setitem(sgmv_kernels._EXPAND, "min_programs_per_sm", 4)
    cpu = torch.device("cpu")
    rule = sgmv_kernels.sgmv_col_steps
    assert rule(64, 32, 512, 3, cpu) == 8  # a 512-token qkv chunk: 96 x 8 groups = 768 programs
    assert rule(172, 32, 512, 2, cpu) == 8  # gate_up: 64 x 22 groups
    assert rule(64, 8, 128, 3, cpu) == 2  # 24 token-slices: 24 x 32 = 768 >= 528, 24 x 16 short
    assert rule(64, 2, 32, 3, cpu) == 1  # a 32-token chunk cannot fill the GPU: one tile a program
    assert rule(3, 300, 4800, 1, cpu) == 2  # never more steps than the tiles (a power of two)
    assert rule(64, 8 + 40, 128, 3, cpu) == rule(64, 8, 128, 3, cpu)  # a graph's static tile bound


@pytest.mark.parametrize(
    "env,value,ok",
    [
        ("DELTASERVE_SGMV_COL_STEPS", "3", True),
        ("DELTASERVE_SGMV_COL_STEPS", "0", False),
        ("DELTASERVE_SGMV_COL_STEPS", "wide", False),
        ("DELTASERVE_SGMV_SPLIT", "-1", False),
    ],
)
def test_benchmark_overrides_are_checked_at_import(env: str, value: str, ok: bool) -> None:
    """The benchmarks' launch overrides: a positive integer is taken (the column steps capped at the
    column tiles); anything else stops the import with the variable's name, before any launch."""
    code = (
        "import torch; from deltaserve.kernels.lora import sgmv; "
        "print(sgmv.sgmv_col_steps(64, 32, 512, 3, torch.device('cpu')), sgmv.sgmv_col_steps(2, 32, 512, 3, torch.device('cpu')))"
    )
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, env: value}, capture_output=True, text=True)
    if ok:
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["3", "2"]
    else:
        assert run.returncode != 0 and f"{env}={value!r}" in run.stderr


def test_shrink_refuses_chunks_that_are_not_whole_block_k_steps(monkeypatch) -> None:
    """A tuning run that swaps BLOCK_K or CHUNK_K into a pair whose chunks are not whole BLOCK_K steps
    gets an error naming both, not partial sums cut at the wrong columns."""
    monkeypatch.setitem(sgmv_kernels._SHRINK, "BLOCK_K", 48)
    meta, stack, x, base, _ = gqa_chunks("identical", "sgmv-split")
    with pytest.raises(ValueError, match="CHUNK_K 64 is not a multiple of BLOCK_K 48"):
        lora_delta_stacked(x, base.clone(), stack, meta, use_triton=True)
