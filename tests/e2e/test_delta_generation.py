"""Compressed full-fine-tune deltas through the running daemon: `--delta NAME=DIR` at start-up,
selected with `model: "<base>:<name>"`, batched with base and LoRA requests.

The deltas are made by `deltaserve compress` on perturbed copies of the tiny Llama
(`helpers/deltas.py`); the reference is `transformers` generating with the dense model
`W_base + dequant(Δ̃)` that `materialize` writes. With `--max-deltas 1` two deltas cannot be on the
GPU together, so the mixed batch also exercises the scheduler's slot limit (eviction, reload,
skip-the-line and the skippers' preemption).
"""

from __future__ import annotations

import httpx
import pytest

from helpers.deltas import make_delta
from helpers.peft_adapters import make_peft_adapter

from .daemon import Daemon
from .test_lora import _greedy
from .wsclient import ws_generate

PROMPTS = ["the quick brown fox", "once upon a time there was", "hello world"]


@pytest.fixture(scope="module")
def variants(tiny_llama, tmp_path_factory):
    """name -> (directory, dense reference directory or None for the LoRA adapter)."""
    root = tmp_path_factory.mktemp("delta_e2e")
    return {
        "d4": make_delta(tiny_llama, root / "d4", seed=41, bits=4),
        "d2": make_delta(tiny_llama, root / "d2", seed=42, bits=2),
        "qv8": (
            make_peft_adapter(
                tiny_llama, root / "qv8", seed=1, target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16
            )[1],
            None,
        ),
    }


@pytest.fixture(scope="module", params=[3, 1], ids=["slots3", "slots1"])
def delta_daemon(request, tiny_llama, variants):
    args = ["--max-deltas", str(request.param), "--lora", f"qv8={variants['qv8'][0]}"]
    for name in ("d4", "d2"):
        args += ["--delta", f"{name}={variants[name][0]}"]
    with Daemon(tiny_llama, *args) as d:
        yield d


@pytest.fixture(scope="module")
def base_name(delta_daemon):
    return httpx.get(f"{delta_daemon.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))


def test_models_and_admin_list_the_deltas(delta_daemon, base_name):
    ids = [c["id"] for c in httpx.get(f"{delta_daemon.url}/v1/models").json()["data"]]
    assert ids == [base_name, f"{base_name}:qv8", f"{base_name}:d4", f"{base_name}:d2"]
    cards = {c["id"]: c for c in httpx.get(f"{delta_daemon.url}/v1/adapters").json()["data"]}
    assert cards["d4"]["kind"] == "delta" and cards["d4"]["summary"].startswith("4-bit 2:4")
    assert cards["d2"]["summary"].startswith("2-bit 2:4") and cards["qv8"]["kind"] == "lora"


def test_delta_greedy_equals_transformers_on_the_dense_reference(delta_daemon, base_name, variants, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    n = 12
    reqs, expected = {}, {}
    for name in ("d4", "d2"):
        ref = AutoModelForCausalLM.from_pretrained(variants[name][1], dtype=torch.float32).eval()
        for i, prompt in enumerate(PROMPTS):
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            rid = f"{name}-{i}"
            expected[rid] = _greedy(ref, ids, n)
            reqs[rid] = {
                "model": f"{base_name}:{name}",
                "prompt": ids,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
            }
    got = ws_generate(delta_daemon.url, reqs)
    for rid, want in expected.items():
        assert got[rid]["error"] is None, got[rid]
        assert got[rid]["token_ids"] == want, rid
    base = ws_generate(delta_daemon.url, {"b": {**reqs["d4-0"], "model": base_name}})["b"]["token_ids"]
    assert base != expected["d4-0"] and base != expected["d2-0"] and expected["d4-0"] != expected["d2-0"]


def test_mixed_base_lora_delta_batch_gives_each_request_its_tokens_alone(delta_daemon, base_name):
    models = [base_name, f"{base_name}:qv8", f"{base_name}:d4", f"{base_name}:d2"]
    reqs = {
        f"r{i}": {
            "model": models[i % 4],
            "prompt": "mixed batch " * (1 + i % 3),
            "max_tokens": 6 + i % 5,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(12)
    }
    alone = {rid: ws_generate(delta_daemon.url, {rid: body})[rid]["token_ids"] for rid, body in reqs.items()}
    together = ws_generate(delta_daemon.url, reqs)
    for rid in reqs:
        assert together[rid]["error"] is None, together[rid]
        assert together[rid]["token_ids"] == alone[rid], rid


def test_bad_delta_refuses_to_start_naming_the_problem(tiny_llama, tiny_qwen2, variants, tmp_path):
    other, _ = make_delta(tiny_qwen2, tmp_path / "qwen", seed=5)
    for args, words in (
        (["--delta", f"x={other}"], "architectures"),
        (["--delta", f"x={variants['qv8'][0]}"], "LoRA"),
        (["--lora", f"x={variants['d4'][0]}"], "delta"),
    ):
        d = Daemon(tiny_llama, *args)
        try:
            assert d.wait_exit(120) != 0, args
            assert words in d.logs(), (args, d.logs()[-2000:])
        finally:
            d.stop()
