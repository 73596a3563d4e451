"""CPU LoRA helpers through the running daemon (`--cpu-lora-helpers 2 --cpu-lora-policy always`).

Each adapter is cold at its first request (registered at start-up, never yet in the pool), so its
prefill's LoRA runs on the worker's helper processes while its pages load. Checked: greedy tokens
equal transformers + peft for PEFT adapters made by `peft`, and `/metrics` counts the assisted
prefills (`deltaserve_cpu_assisted_prefills_total`).
"""

from __future__ import annotations

import pytest
import torch

from helpers.executors import hf_greedy
from helpers.peft_adapters import SEVEN, make_peft_adapter

from .daemon import Daemon
from .wsclient import ws_generate

# The helpers' waits have deadlines (a stalled helper falls back, counted): on a loaded 2-core
# machine a parallel run can turn every assist into a fallback, so this runs alone (`make test`).
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_lora_loras")
    return {
        "qv8": make_peft_adapter(
            tiny_llama, root / "qv8", seed=3, target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16
        ),
        "all16": make_peft_adapter(tiny_llama, root / "all16", seed=4, target_modules=SEVEN, r=16, lora_alpha=8),
    }


def test_cold_prefills_on_helpers_equal_peft_and_are_counted(tiny_llama, adapters):
    args = ["--cpu-lora-helpers", "2", "--cpu-lora-policy", "always"]
    for name, (_, path) in adapters.items():
        args += ["--lora", f"{name}={path}"]
    prompt = [5, 17, 33, 8, 61, 2, 44, 90, 12]
    with Daemon(tiny_llama, *args) as d:
        for name, (peft_model, _) in adapters.items():
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            got = ws_generate(d.url, {name: body})[name]
            assert got["error"] is None, got
            with torch.no_grad():
                assert got["token_ids"] == hf_greedy(peft_model, prompt, 8), name
        metrics = d.metrics()
    assert metrics["deltaserve_cpu_assisted_prefills_total"] >= 1, metrics
    assert metrics["deltaserve_cpu_assist_fallbacks_total"] == 0
