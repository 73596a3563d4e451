"""The worker tests' executors: a tiny model on the CPU in float32, and what their tests compare with.

``conftest.py``'s ``executor_factory`` and ``hf_model`` fixtures build on these; tests import the
constants and functions from here (or, as before, from ``test_executor``).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

KV_BYTES = 2 << 20
"""KV pool of an ``executor_factory`` executor unless the test gives ``kv_cache_bytes``."""


def make_executor(model_dir: Path, **kw):  # -> deltaserve.worker.executor.Executor (imported late)
    """An Executor on ``model_dir``: CPU, float32, block size 4, ``KV_BYTES`` of KV unless given."""
    from deltaserve.worker.executor import Executor

    kw.setdefault("kv_cache_bytes", KV_BYTES)
    return Executor(model_dir, device="cpu", dtype="float32", block_size=4, **kw)


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``prompt`` from a transformers model."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            generation_config=gen,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    """``n`` random prompts of ``lo``..``hi`` tokens (ids from 3, below ``vocab``)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
