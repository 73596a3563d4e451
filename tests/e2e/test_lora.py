"""LoRA adapters through the running daemon: `--lora NAME=DIR` at start-up, selected with
`model: "<base>:<adapter>"` (or the adapter's name), batched with base requests.

Adapters are made by the `peft` library itself; the reference is transformers generating with
each adapter merged into the base (`merge_and_unload`)."""

from __future__ import annotations

import httpx
import pytest
import torch

from helpers.peft_adapters import SEVEN, make_peft_adapter

from .daemon import Daemon
from .wsclient import ws_generate

PROMPTS = ["the quick brown fox", "once upon a time there was", "hello world"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Two adapters with different ranks and targets: (peft model, dir) by name."""
    root = tmp_path_factory.mktemp("loras")
    return {
        "qv8": make_peft_adapter(
            tiny_llama, root / "qv8", seed=1, target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16
        ),
        "all16": make_peft_adapter(
            tiny_llama, root / "all16", seed=2, target_modules=SEVEN, r=16, lora_alpha=8, use_rslora=True
        ),
    }


@pytest.fixture(scope="module")
def lora_daemon(tiny_llama, adapters):
    args = []
    for name, (_, path) in adapters.items():
        args += ["--lora", f"{name}={path}"]
    with Daemon(tiny_llama, *args) as d:
        yield d


@pytest.fixture(scope="module")
def base_name(lora_daemon):
    return httpx.get(f"{lora_daemon.url}/v1/models").json()["data"][0]["id"]


def _greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))


def test_models_lists_base_and_adapters(lora_daemon, base_name):
    cards = httpx.get(f"{lora_daemon.url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [base_name, f"{base_name}:qv8", f"{base_name}:all16"]
    assert all(c["parent"] == base_name for c in cards[1:]) and "parent" not in cards[0]


def test_adapter_greedy_equals_peft_merged(lora_daemon, base_name, adapters, tokenizer):
    import copy

    n = 16
    reqs, expected = {}, {}
    for name, (peft_model, _) in adapters.items():
        merged = copy.deepcopy(peft_model).merge_and_unload().eval()
        for i, prompt in enumerate(PROMPTS):
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            rid = f"{name}-{i}"
            expected[rid] = _greedy(merged, ids, n)
            model = f"{base_name}:{name}" if i % 2 == 0 else name  # both spellings select it
            reqs[rid] = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    got = ws_generate(lora_daemon.url, reqs)
    for rid, want in expected.items():
        assert got[rid]["error"] is None, got[rid]
        assert got[rid]["token_ids"] == want, rid
    # The adapters really change the output: base tokens differ from each adapter's.
    base = ws_generate(lora_daemon.url, {"b": {**reqs["qv8-0"], "model": base_name}})["b"]["token_ids"]
    assert base != expected["qv8-0"] and base != expected["all16-0"]


def test_mixed_batch_gives_each_request_its_tokens_alone(lora_daemon, base_name):
    models = [base_name, f"{base_name}:qv8", f"{base_name}:all16"]
    reqs = {
        f"r{i}": {
            "model": models[i % 3],
            "prompt": "mixed batch " * (1 + i % 4),
            "max_tokens": 10 + i,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(12)
    }
    alone = {rid: ws_generate(lora_daemon.url, {rid: body})[rid]["token_ids"] for rid, body in reqs.items()}
    together = ws_generate(lora_daemon.url, reqs)
    for rid in reqs:
        assert together[rid]["token_ids"] == alone[rid], rid


def test_responses_name_the_adapter(lora_daemon, base_name):
    for model in (f"{base_name}:qv8", "qv8"):
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        assert (
            httpx.post(f"{lora_daemon.url}/v1/completions", json=body, timeout=60).json()["model"] == f"{base_name}:qv8"
        )
    chat = {"model": "all16", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{lora_daemon.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert r["model"] == f"{base_name}:all16"
    assert (
        httpx.post(f"{lora_daemon.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).json()[
            "model"
        ]
        == base_name
    )


def test_unknown_adapter_is_404(lora_daemon, base_name):
    for model in (f"{base_name}:nope", "nope", "other:qv8"):
        r = httpx.post(f"{lora_daemon.url}/v1/completions", json={"model": model, "prompt": "hi"}, timeout=30)
        assert r.status_code == 404, (model, r.text)
        assert "/v1/models" in r.json()["error"]["message"]


def test_bad_adapter_dir_refuses_to_start(tiny_llama, tmp_path):
    bad = tmp_path / "not-an-adapter"
    bad.mkdir()
    d = Daemon(tiny_llama, "--lora", f"x={bad}")
    try:
        assert d.wait_exit(60) != 0
        assert "adapter_config.json" in d.logs()
    finally:
        d.stop()


def test_adapter_the_worker_refuses_stops_start_up_naming_the_field(tiny_llama, adapters, tmp_path):
    import json
    import shutil

    dora = tmp_path / "dora"
    shutil.copytree(adapters["qv8"][1], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    d = Daemon(tiny_llama, "--lora", f"d={dora}")
    try:
        assert d.wait_exit(120) != 0
        assert "use_dora" in d.logs(), d.logs()[-2000:]
    finally:
        d.stop()
