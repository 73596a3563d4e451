"""Memory planning at start-up: how many bytes the paged KV pool gets.

``kv_cache_bytes > 0`` is taken as given. Auto (``kv_cache_bytes == 0``): on CPU a fixed 256 MiB
(RAM is not the scarce resource there and the CPU path is for tests and demos). On CUDA, as in
vLLM::

    gpu_memory_utilization x total
      - memory in use after loading the weights        (torch.cuda.mem_get_info: other processes count)
      - activation peak of the worst steps we expect   (profiled: max_memory_allocated around forwards)
      - what the variant pools may take besides pages  (the delta slots: ``delta_slots.reserve_bytes``)

LoRA adapters take pages of the KV pool itself, which the router allocates, so they reserve nothing
here; every other byte the router may make the worker allocate must be in the last term.
"""

from __future__ import annotations

import logging

import torch

from deltaserve import wire
from deltaserve.model.batch import ForwardBatch, scratch_sequences
from deltaserve.model.decoder import DecoderLM
from deltaserve.model.kv_cache import PagedKVCache

from .requests import RequestState
from .sampler import Sampler

log = logging.getLogger("deltaserve.worker")

#: Auto KV budget on CPU.
CPU_KV_BYTES = 256 << 20
#: Most sequences the profiling run puts in one batch (a typical scheduler max_num_seqs).
PROFILE_MAX_SEQS = 256


def kv_budget(
    model: DecoderLM,
    sampler: Sampler,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_num_batched_tokens: int,
    kv_cache_bytes: int,
    gpu_memory_utilization: float,
    reserve_bytes: int,
) -> int:
    """Bytes for the KV pool: the explicit setting, or auto (module docstring); ``reserve_bytes`` is
    what the variant pools may allocate outside the pool."""
    if kv_cache_bytes > 0:
        return kv_cache_bytes
    if device.type != "cuda":
        return CPU_KV_BYTES
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used_after_weights = total - free
    activation = profile_activation_bytes(
        model, sampler, device=device, dtype=dtype, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens
    )
    budget = int(gpu_memory_utilization * total) - used_after_weights - activation - reserve_bytes
    log.info(
        "auto KV budget: %.2f x %.0f MiB total - %.0f MiB in use after weights - %.0f MiB activations "
        "(profiled, %d tokens) - %.0f MiB delta slots = %.0f MiB",
        gpu_memory_utilization,
        total / (1 << 20),
        used_after_weights / (1 << 20),
        activation / (1 << 20),
        max_num_batched_tokens,
        reserve_bytes / (1 << 20),
        budget / (1 << 20),
    )
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {gpu_memory_utilization} x {total} bytes - "
            f"{used_after_weights} in use - {activation} activations - {reserve_bytes} delta slots = {budget}; "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens or --max-deltas, or set --kv-cache-bytes"
        )
    return budget


@torch.inference_mode()
def profile_activation_bytes(
    model: DecoderLM,
    sampler: Sampler,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_num_batched_tokens: int,
) -> int:
    """Peak extra CUDA memory of the worst steps we expect, measured by running them.

    Two shapes, max of both: one long prefill (attention over the whole context), and
    ``max_num_batched_tokens`` spread over up to PROFILE_MAX_SEQS sequences that all want
    logits and logprobs (the logits and sampler buffers). The scratch KV is subtracted.
    """
    cfg = model.config
    tokens = max_num_batched_tokens
    long_len = min(tokens, cfg.max_position_embeddings)
    num_seqs = min(PROFILE_MAX_SEQS, tokens)
    shapes = [
        [long_len] * max(1, tokens // long_len),
        [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)],
    ]
    peak = 0
    for lengths in shapes:
        seqs, pages = scratch_sequences([(n, 0) for n in lengths], block_size)
        scratch = PagedKVCache(cfg.num_layers, pages, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        batch = ForwardBatch.build(seqs, block_size, device)
        logits = model.forward(batch, scratch)
        # Every row with a bias and penalties too: their buffers (a copy of the logits, counts).
        params = [
            wire.SamplingParams(
                temperature=1.0,
                top_p=0.9,
                top_k=0,
                seed=None,
                logprobs=20,
                logit_bias=[wire.LogitBias(token_id=0, bias=1.0)],
                penalties=wire.Penalties(presence=0.5, frequency=0.5, repetition=1.1),
            )
        ] * len(seqs)
        history = [RequestState(i, [0] * n, n - 1, 0, [], params[i]) for i, n in enumerate(lengths)]
        sampler.sample(logits, params, [0] * len(seqs), history)
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
        del batch, logits, scratch
    torch.cuda.empty_cache()
    return peak
