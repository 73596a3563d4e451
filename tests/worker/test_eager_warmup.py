"""The start-up passes that compile the eager step's attention kernels (``worker/eager_warmup.py``):
on the CPU, that they cover every key-split range of the prefill kernel with and without one-token
rows and leave the model's output unchanged; on a GPU (``make test-gpu-kernels``), that eager
prefill and mixed steps of many shapes compile no attention kernel after the executor started."""

from __future__ import annotations

import os

import pytest
import torch

from deltaserve.kernels.paged_attention import PREFILL_SPLIT_TOKENS
from deltaserve.model.batch import ForwardBatch, scratch_sequences
from deltaserve.model.kv_cache import PagedKVCache
from deltaserve.worker.eager_warmup import DECODE_ROWS, warm_eager_kernels, warmup_prompt_lengths, warmup_steps


def _split_range(tokens: int) -> int:
    """Index of the ``PREFILL_SPLIT_TOKENS`` range a step of ``tokens`` falls in (len(...): above all)."""
    return next((i for i, bound in enumerate(PREFILL_SPLIT_TOKENS) if tokens <= bound), len(PREFILL_SPLIT_TOKENS))


def test_passes_cover_every_split_range_alone_and_beside_decodes() -> None:
    steps = warmup_steps(block_size=16)
    seen = set()
    for seqs in steps:
        tokens = sum(len(ids) for ids, _, _, _ in seqs)
        singles = sum(len(ids) == 1 for ids, _, _, _ in seqs)
        assert singles in (0, DECODE_ROWS)
        seen.add((_split_range(tokens), singles > 0))
        ForwardBatch.build(seqs, 16, "cpu")  # the pages cover every row's tokens
    want = {(r, d) for r in range(len(PREFILL_SPLIT_TOKENS) + 1) for d in (False, True)}
    assert seen == want, f"missing (split range, with decodes): {want - seen}"
    assert len(steps) == len(want), "one pass per variant"
    assert all(n > 1 for n in warmup_prompt_lengths()), "a prompt of one token would be a decode row"


def test_warmup_runs_the_model_eagerly_and_changes_nothing(executor_factory) -> None:
    ex = executor_factory()
    seqs = [([5, 6, 7, 8, 9], 0, [0, 1], True)]
    kv = PagedKVCache(ex.config.num_layers, 4, ex.block_size, ex.config.num_kv_heads, ex.config.head_dim,
                      ex.dtype, ex.device)  # fmt: skip
    before = ex.model.forward(ForwardBatch.build(seqs, ex.block_size, ex.device), kv)
    calls = []
    forward = ex.model.forward
    ex.model.forward = lambda batch, scratch: calls.append(batch.num_tokens) or forward(batch, scratch)
    try:
        seconds = warm_eager_kernels(ex.model, device=ex.device, dtype=ex.dtype, block_size=ex.block_size)
    finally:
        ex.model.forward = forward
    assert seconds >= 0
    assert len(calls) == len(warmup_steps(ex.block_size))
    after = ex.model.forward(ForwardBatch.build(seqs, ex.block_size, ex.device), kv)
    assert torch.equal(before, after)


def _compiled(kernel) -> int:
    """Variants Triton compiled of ``kernel`` on the current device."""
    caches = kernel.device_caches.get(torch.cuda.current_device())
    return len(caches[0]) if caches else 0


@pytest.mark.gpu_kernels
@pytest.mark.skipif(
    not (os.environ.get("DELTASERVE_TEST_GPU") == "1" and torch.cuda.is_available()),
    reason="compiled Triton kernels need a GPU (make test-gpu-kernels)",
)
def test_eager_steps_compile_no_attention_kernel_after_start_up(tiny_llama) -> None:
    from deltaserve.kernels import paged_attention_kernels as k
    from deltaserve.worker.executor import Executor

    ex = Executor(tiny_llama, device="cuda:0", dtype="float16", block_size=16, kv_cache_bytes=64 << 20,
                  cuda_graph_max_batch=0)  # fmt: skip
    kernels = (k.paged_prefill_kernel, k.paged_prefill_merge_kernel, k.paged_decode_kernel)
    before = [_compiled(f) for f in kernels]
    assert all(before), "start-up should have compiled every attention kernel"
    scratch = PagedKVCache(ex.config.num_layers, 200, 16, ex.config.num_kv_heads, ex.config.head_dim,
                           ex.dtype, ex.device)  # fmt: skip
    for prompt in (3, 16, 37, 64, 90, 128, 200, 256, 300, 700):
        for decodes, context in ((0, 0), (1, 15), (3, 40), (5, 255)):
            seqs, _ = scratch_sequences([(prompt, 0)] + [(1, context)] * decodes, 16)
            ex.model.forward(ForwardBatch.build(seqs, 16, ex.device), scratch)
    torch.cuda.synchronize()
    assert [_compiled(f) for f in kernels] == before, "an eager step compiled an attention kernel"
