"""The baseline servers of bench/baselines.py, started by their bench/serving launchers on the
tiny random Llama (CPU), replayed with bench/replay.py, their tokens checked against references:

- peft: 3 adapters (different ranks and targets), at most 2 on the device: a concurrent burst
  (batches with left padding, adapter loads and evictions) gives every request exactly the
  greedy tokens of its adapter alone, computed here by full re-forwarding without a KV cache.
- swap: 3 full models (tiny Llamas with different seeds), at most 2 resident: A, B, A, C, B in
  turn each get their own model's tokens, with 4 loads and never more than 2 resident.
- merged: the daemon on the base with one adapter merged in answers with that adapter's tokens.
- ``--resident auto``: the slot count is the number of whole models that fit beside one batch's
  KV cache and logits, computed from the checkpoint's config.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from bench import baselines, serving
from bench import replay as rp
from bench import workload as wl
from helpers.peft_adapters import hf_model, make_peft_adapter
from helpers.tiny_models import make_tiny_model

ADAPTERS = {"a0000": dict(r=4, target_modules=["q_proj", "v_proj"]),
            "a0001": dict(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            "a0002": dict(r=2, target_modules=["gate_proj", "up_proj", "down_proj"])}  # fmt: skip
"""Adapters of different ranks and targets (loading one changes which layers peft wraps)."""


@pytest.fixture(scope="module")
def lora_dir(tiny_llama, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("baseline-adapters")
    for seed, (name, cfg) in enumerate(ADAPTERS.items()):
        make_peft_adapter(tiny_llama, root / name, seed=seed, **cfg)
    return root


@pytest.fixture(scope="module")
def full_models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("baseline-full")
    for i in range(3):
        src = make_tiny_model(root / "src", "llama", seed=10 + i)
        shutil.move(src, root / f"ft{i:02d}")
    shutil.rmtree(root / "src")
    return root


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Reference: n greedy tokens, re-forwarding the whole sequence each step (no cache, no padding)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def stream_tokens(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    """One streamed completion; its token ids (checks the usage chunk and [DONE] on the way)."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, usage, done = [], None, False
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            ev = json.loads(data)
            assert "error" not in ev, ev
            if ev["choices"]:
                tokens += ev["choices"][0].get("token_ids", [])
            if ev.get("usage"):
                usage = ev["usage"]
    assert done and usage == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
    return tokens


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def tiny_trace(names: list[str], kind: str, vocab: int) -> wl.Trace:
    """~8 requests over 0.4 s, lengths 3..8 in, 2..5 out, over ``names``."""
    if kind == "lora":
        t = wl.slora(len(names), 1.0, 20.0, 1.0, 0.4, input_range=(3, 8), output_range=(2, 5), vocab=(3, vocab), seed=1)
    else:
        t = wl.deltazip(20.0, 0.4, "uniform", n_variants=len(names), input_range=(3, 8), output_range=(2, 5),
                        vocab=(3, vocab), seed=1)  # fmt: skip
    assert [v.name for v in t.variants] == names and len(t.requests) == 8
    return t


def assert_replayed(trace: wl.Trace, url: str, model_for=None) -> None:
    records = rp.run_replay(trace, url, protocol="sse", model_for=model_for, timeout_s=120)
    for r in records:
        assert r.error is None, r
        assert r.n_out == r.output_len and 0 < r.ttft <= r.e2e, r
    assert rp.summarize(records)["output_len_mismatch"] == 0


def vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def test_peft_baseline_swaps_in_the_right_adapter(tiny_llama, lora_dir, tmp_path):
    spec = serving.ServerSpec(model_dir=tiny_llama, lora_dir=lora_dir, devices="cpu", log=tmp_path / "peft.log",
                              flags=["--device-adapters", "2", "--max-batch", "3"])  # fmt: skip
    # Two prompts of different lengths per adapter, all sent at once: batches are left-padded and
    # the adapters (3 for 2 device places) are loaded, one of them evicted...
    jobs = [(name, [5 + i, 40 + 3 * k, 77, 9, 120 + i][: 2 + 3 * k], 3 + k + i)
            for i, name in enumerate(ADAPTERS) for k in range(2)]  # fmt: skip
    with serving.SERVERS["peft"](spec) as ep:
        got = asyncio.run(_gather(ep.url, jobs))
        first = stats(ep.url)
        # ...and, once those are done, the evicted one is asked for again: it must be loaded again.
        evicted = next(n for n in ADAPTERS if n not in first["resident"])
        again = [j for j in jobs if j[0] == evicted]
        got += asyncio.run(_gather(ep.url, again))
        jobs += again
        st = stats(ep.url)
        assert_replayed(tiny_trace(list(ADAPTERS), "lora", vocab_size(tiny_llama)), ep.url)
    from peft import PeftModel

    refs = {name: PeftModel.from_pretrained(hf_model(tiny_llama), lora_dir / name).eval() for name in ADAPTERS}
    base = hf_model(tiny_llama)
    for (name, prompt, n), tokens in zip(jobs, got):
        want = greedy(refs[name], prompt, n)
        assert tokens == want, (name, prompt)
        assert want != greedy(base, prompt, n) or n < 3, (name, "the adapter must change the tokens")
    assert st["max_resident"] <= 2 and len(st["resident"]) <= 2
    assert first["loads"] >= 3 and st["loads"] == first["loads"] + 1 and st["requests"] == len(jobs), (first, st)
    assert evicted in st["resident"], st


async def _gather(url: str, jobs) -> list[list[int]]:
    return await asyncio.gather(*(stream_tokens(url, m, p, n) for m, p, n in jobs))


def test_swap_baseline_serves_each_model_with_at_most_k_resident(full_models, tmp_path):
    names = sorted(d.name for d in full_models.iterdir())
    spec = serving.ServerSpec(model_dir=None, lora_dir=full_models, devices="cpu", log=tmp_path / "swap.log",
                              flags=["--resident", "2"])  # fmt: skip
    prompt = [11, 200, 37, 4]
    order = ["ft00", "ft01", "ft00", "ft02", "ft01"]
    with serving.SERVERS["swap"](spec) as ep:
        got = [asyncio.run(stream_tokens(ep.url, m, prompt, 6)) for m in order]
        st = stats(ep.url)
        assert_replayed(tiny_trace(names, "full", vocab_size(full_models / "ft00")), ep.url)
        st_after = stats(ep.url)
    refs = {m: greedy(hf_model(full_models / m), prompt, 6) for m in names}
    assert len({tuple(t) for t in refs.values()}) == 3, "the seeds must give different models"
    for m, tokens in zip(order, got):
        assert tokens == refs[m], m
    # ft00 (load), ft01 (load), ft00 (hit), ft02 (load, evicts ft01: least recently used), ft01 (load, evicts ft00).
    assert st["loads"] == 4 and st["max_resident"] == 2 and sorted(st["resident"]) == ["ft01", "ft02"], st
    assert st_after["max_resident"] == 2, st_after


def test_models_that_fit_keeps_the_batch_reserve_and_bounds():
    gib = 1 << 30
    # An H200's ~140 GiB free, 12.55 GiB fp16 7B models, ~21 GiB for a batch: 9 models.
    assert baselines.models_that_fit(140 * gib, int(12.55 * gib), 21 * gib, 32) == 9
    assert baselines.models_that_fit(140 * gib, int(12.55 * gib), 21 * gib, 4) == 4  # no more than exist
    assert baselines.models_that_fit(10 * gib, int(12.55 * gib), 21 * gib, 32) == 1  # at least one


def test_batch_reserve_counts_kv_cache_and_logits(tmp_path):
    cfg = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "num_hidden_layers": 32,
           "vocab_size": 32000}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tokens = 2 * 100
    kv = tokens * 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, fp16
    logits = tokens * 32000 * 4
    assert baselines.batch_reserve_bytes(tmp_path, torch.float16, 2, 100) == kv + logits + (1 << 30)


def test_swap_resident_auto_and_bad_values(full_models):
    models = baselines.model_dirs(full_models)
    cpu = torch.device("cpu")
    # Three tiny models always fit in this machine's memory: auto holds all of them.
    assert baselines.resident_slots("auto", models, cpu, torch.float32, 32, 1024) == 3
    assert baselines.resident_slots("2", models, cpu, torch.float32, 32, 1024) == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit, match="--resident"):
            baselines.resident_slots(bad, models, cpu, torch.float32, 32, 1024)


def test_merged_baseline_serves_the_merged_adapter(tiny_llama, lora_dir, tmp_path):
    from e2e.daemon import daemon_binary
    from peft import PeftModel

    spec = serving.ServerSpec(model_dir=tiny_llama, lora_dir=lora_dir, devices="cpu", daemon=daemon_binary(),
                              log=tmp_path / "merged.log",
                              flags=["--merge=a0001", "--max-model-len", "256"])  # fmt: skip
    prompt = [11, 200, 37, 4, 90]
    with serving.SERVERS["merged"](spec) as ep:
        assert ep.model == "merged"
        r = httpx.post(f"{ep.url}/v1/completions", timeout=60,
                       json={"model": ep.model, "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                             "temperature": 0.0})  # fmt: skip
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert_replayed(tiny_trace(list(ADAPTERS), "lora", vocab_size(tiny_llama)), ep.url, lambda v: ep.model)
    ref = PeftModel.from_pretrained(hf_model(tiny_llama), lora_dir / "a0001").eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert text == tok.decode(greedy(ref, prompt, 6))
    assert text != tok.decode(greedy(hf_model(tiny_llama), prompt, 6))
