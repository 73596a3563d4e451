"""1,000 registered LoRA adapters on the CPU worker, with a host-memory budget of a few adapters
and a page pool that holds KV for the batch plus only some adapters: every request still gets
exactly its adapter's tokens while adapters are evicted and reloaded through the tiers
(disk -> host -> pool pages), and the worker's measured host memory stays within the budget.

The 1,000 directories are copies of 16 distinct adapters made by `peft` (different seeds, ranks
and target sets), so each request's reference is transformers + peft with its source adapter
merged."""

from __future__ import annotations

import copy
import json
import random
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file

from helpers.peft_adapters import SEVEN, make_peft_adapter

from .daemon import Daemon
from .wsclient import ws_generate

NUM_ADAPTERS = 1000
DISTINCT = 16
N_OUT = 6
PROMPTS = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45], [7, 7, 7]]


def _bytes_per_page(model_dir, block_size=16):
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * block_size * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def zoo(tiny_llama, tmp_path_factory):
    """(zoo dir with 1000 adapters a0000.., [reference tokens per distinct adapter per prompt], host bytes of one)."""
    root = tmp_path_factory.mktemp("zoo")
    sources = root / "sources"
    refs, sizes = [], []
    for i in range(DISTINCT):
        kw = (
            dict(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8)
            if i % 2 == 0
            else dict(target_modules=SEVEN, r=2, lora_alpha=4)
        )
        peft_model, path = make_peft_adapter(tiny_llama, sources / f"s{i}", seed=100 + i, **kw)
        merged = copy.deepcopy(peft_model).merge_and_unload().eval()
        merged.generation_config.eos_token_id = None
        merged.generation_config.pad_token_id = 0
        with torch.no_grad():
            refs.append(
                [
                    merged.generate(torch.tensor([p]), max_new_tokens=N_OUT, do_sample=False)[0, len(p) :].tolist()
                    for p in PROMPTS
                ]
            )
        sizes.append(sum(t.numel() * 4 for t in load_file(path / "adapter_model.safetensors").values()))
    adapters = root / "adapters"
    adapters.mkdir()
    for i in range(NUM_ADAPTERS):
        shutil.copytree(sources / f"s{i % DISTINCT}", adapters / f"a{i:04d}")
    return adapters, refs, max(sizes)


def test_thousand_adapters_evict_and_reload_correctly_within_the_host_budget(tiny_llama, zoo):
    adapters, refs, one = zoo
    host_budget = 5 * one  # room for five host copies
    pool_pages = 40  # KV for a batch of 16 short requests plus a couple of dozen adapter pages
    args = [
        "--lora-dir",
        str(adapters),
        "--variant-host-bytes",
        str(host_budget),
        "--kv-cache-bytes",
        str(pool_pages * _bytes_per_page(tiny_llama)),
        "--max-num-seqs",
        "16",
    ]
    with Daemon(tiny_llama, *args).wait_ready(600) as d:
        listed = httpx.get(f"{d.url}/v1/adapters", timeout=60).json()["data"]
        assert len(listed) == NUM_ADAPTERS and all(a["status"] == "active" for a in listed)
        assert d.metrics()["deltaserve_adapters_registered"] == NUM_ADAPTERS

        rng = random.Random(7)
        first_round = None
        seen: set[int] = set()
        for round_no in range(8):
            picks = rng.sample(range(NUM_ADAPTERS), 16) if round_no < 7 else first_round
            first_round = first_round or picks
            seen.update(picks)
            reqs = {
                f"r{round_no}-{j}": {
                    "model": f"a{a:04d}",
                    "prompt": PROMPTS[j % len(PROMPTS)],
                    "max_tokens": N_OUT,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                for j, a in enumerate(picks)
            }
            got = ws_generate(d.url, reqs, timeout_s=300)
            for j, a in enumerate(picks):
                rid = f"r{round_no}-{j}"
                assert got[rid]["error"] is None, got[rid]
                assert got[rid]["token_ids"] == refs[a % DISTINCT][j % len(PROMPTS)], (rid, a)
            m = d.metrics()
            assert m["deltaserve_adapter_host_bytes_measured"] <= host_budget, m
            assert m["deltaserve_adapter_host_bytes"] <= host_budget, m

        m = d.metrics()
        # The last round repeated the first one's adapters after 96 others went through: they were
        # evicted from the pool and from host memory, and read again from disk.
        assert m["deltaserve_adapter_gpu_evictions_total"] > 0, m
        assert m["deltaserve_adapter_host_loads_total"] > len(seen), m
        assert m["deltaserve_adapter_gpu_loads_total"] > len(seen), m
