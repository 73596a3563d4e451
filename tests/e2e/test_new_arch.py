"""A base of the issue-25 architectures through the running daemon: a tiny Gemma 2 (soft-capping,
alternating 8-token sliding-window layers, sandwich norms, GeGLU, scaled embeddings) served with a
PEFT LoRA on all seven projections, base and LoRA requests in one batch. Greedy tokens equal
transformers' (the base) and PEFT's (the adapter)."""

from __future__ import annotations

import pytest
import torch

from helpers.executors import hf_greedy
from helpers.peft_adapters import SEVEN, hf_model, make_peft_adapter
from helpers.tiny_models import make_tiny_model

from .daemon import Daemon
from .wsclient import ws_generate


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    base = make_tiny_model(root, "gemma2")
    peft_model, lora = make_peft_adapter(base, root / "lora", seed=4, target_modules=SEVEN, r=8, lora_alpha=16)
    with Daemon(base, "--lora", f"g={lora}") as d:
        yield d, hf_model(base), peft_model


def test_mixed_batch_of_base_and_lora_equals_transformers(gemma2) -> None:
    daemon, base_ref, lora_ref = gemma2
    for ref in (base_ref, lora_ref):  # the daemon ignores EOS here: so must generate
        ref.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in (5, 12, 19, 26)]
    reqs, want = {}, {}
    for i, prompt in enumerate(prompts):
        for model, ref in (("", base_ref), ("g", lora_ref)):
            rid = f"{model or 'base'}-{i}"
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            reqs[rid] = {**body, "model": model} if model else body
            with torch.no_grad():
                want[rid] = hf_greedy(ref, prompt, 10)
    got = ws_generate(daemon.url, reqs)
    for rid, tokens in want.items():
        assert got[rid]["error"] is None, got[rid]
        assert got[rid]["token_ids"] == tokens, rid
    assert want["base-0"] != want["g-0"]  # the adapter changes the output
