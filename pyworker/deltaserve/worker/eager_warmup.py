"""Compiling the eager step's attention kernels at start-up, so that no request waits for a compile.

A step that runs eagerly (a step with compressed-delta rows beyond the delta buckets'
``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS``, prompt logprobs, a step beyond the largest token bucket, every step with
graphs off) launches the paged-attention kernels with
compile-time arguments the captured graphs need not have used: whether one-token rows are left to
the decode kernel, the key-split count of its token range
(``kernels.paged_attention.PREFILL_SPLIT_TOKENS``), and the class of its block table's width, which
it sizes to its longest sequence. Triton compiles each new combination at its first launch, inside
that step: 1.3-3.4 s a step on an H200 with an empty Triton cache (``bench/README.md``, "First eager
steps"), during which every running request waits.

:func:`warm_eager_kernels` runs one eager forward pass per such variant over a scratch KV pool
before the worker serves: a prompt in each split range, alone and beside two one-token rows. The
block-table width, which varies from step to step, is not a compile-time argument
(``do_not_specialize`` in ``kernels/paged_attention_kernels.py``), so these passes cover every
width. On a fresh machine each variant compiles once here instead of in a served step (16.2 s on an
H200 with an empty Triton cache); with a warm cache (a restart on the same machine) the passes are
8 eager steps of at most 264 tokens.
"""

from __future__ import annotations

import logging
import time

import torch

from deltaserve.kernels.paged_attention import PREFILL_SPLIT_TOKENS
from deltaserve.model.batch import ForwardBatch, scratch_sequences
from deltaserve.model.decoder import DecoderLM
from deltaserve.model.kv_cache import PagedKVCache

log = logging.getLogger("deltaserve.worker")

DECODE_ROWS = 2
"""One-token rows beside the prompt in the mixed passes."""
DECODE_CONTEXT = 40
"""Tokens each of those rows has computed before."""


def warmup_prompt_lengths() -> tuple[int, ...]:
    """One prompt length inside each key-split range of the prefill kernel: just under each
    ``PREFILL_SPLIT_TOKENS`` bound (with ``DECODE_ROWS`` beside it, still inside), and one above
    the last bound (no split)."""
    below = tuple(bound - DECODE_ROWS - 6 for bound in PREFILL_SPLIT_TOKENS)
    return (*below, PREFILL_SPLIT_TOKENS[-1] + 8)


def warmup_steps(block_size: int) -> list[list[tuple[list[int], int, list[int], bool]]]:
    """The passes' batches (``scratch_sequences``): each prompt length alone, then beside
    ``DECODE_ROWS`` one-token rows."""
    return [
        scratch_sequences([(n, 0)] + [(1, DECODE_CONTEXT)] * rows, block_size)[0]
        for n in warmup_prompt_lengths()
        for rows in (0, DECODE_ROWS)
    ]


@torch.inference_mode()
def warm_eager_kernels(model: DecoderLM, *, device: torch.device, dtype: torch.dtype, block_size: int) -> float:
    """Runs :func:`warmup_steps` eagerly on a scratch KV pool (the serving pool is not touched);
    returns the seconds it took. Call before any variant pool is attached: the passes are base-only."""
    started = time.monotonic()
    steps = warmup_steps(block_size)
    cfg = model.config
    pages = max(sum(len(table) for _, _, table, _ in seqs) for seqs in steps)
    scratch = PagedKVCache(cfg.num_layers, pages, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    for seqs in steps:
        model.forward(ForwardBatch.build(seqs, block_size, device), scratch)
    del scratch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the pools that come next find the allocator as it was
    seconds = time.monotonic() - started
    log.info("eager attention kernels warmed: %d passes (prompts of %s tokens, alone and beside %d decodes) in %.1f s",
             len(steps), ", ".join(map(str, warmup_prompt_lengths())), DECODE_ROWS, seconds)  # fmt: skip
    return seconds
