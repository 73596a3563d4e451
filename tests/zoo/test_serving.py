"""A block zoo through the running daemon: ``deltaserve --zoo DIR`` serves every variant stored as
ΔCompress deltas as ``<base>:<name>``, batched with base and LoRA requests.

The variants' own blocks are partial deltas (their ``variants/<name>/`` directories) served by the
compressed-delta machinery; the reference is ``transformers`` generating with what the blocks hold,
``W_base + dequant(Δ̃)`` on the own layers and the base elsewhere (``materialize``), as for deltas.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from e2e.daemon import Daemon
from e2e.wsclient import ws_generate

from deltaserve.compress import materialize
from helpers.executors import hf_greedy
from helpers.peft_adapters import make_peft_adapter

from .conftest import ZooFixture

pytest.importorskip("peft")

PROMPTS = ["the quick brown fox", "once upon a time there was"]
N = 8


@pytest.fixture(scope="module")
def served(zoo_fixture: ZooFixture, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("zoo_serving")
    lora = make_peft_adapter(zoo_fixture.base, root / "qv8", seed=1, target_modules=["q_proj", "v_proj"], r=8)[1]
    refs = {
        name: materialize(zoo_fixture.zoo / "variants" / name, zoo_fixture.base, root / f"ref-{name}")
        for name in ("ft1", "ft2")
    }
    with Daemon(zoo_fixture.base, "--zoo", str(zoo_fixture.zoo), "--lora", f"qv8={lora}", "--max-deltas", "2") as d:
        base_name = httpx.get(f"{d.url}/v1/models").json()["data"][0]["id"]
        yield d, base_name, refs


def test_models_list_the_zoo_variants(served) -> None:
    d, base_name, _ = served
    ids = [c["id"] for c in httpx.get(f"{d.url}/v1/models").json()["data"]]
    assert ids == [base_name, f"{base_name}:qv8", f"{base_name}:ft1", f"{base_name}:ft2"]


def test_zoo_variants_greedy_equal_transformers_in_one_mixed_batch(served, zoo_fixture: ZooFixture) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    d, base_name, refs = served
    tok = Tokenizer.from_file(str(zoo_fixture.base / "tokenizer.json"))
    models = {"base": zoo_fixture.base, **refs}
    reqs, expected = {}, {}
    for name, model_dir in models.items():
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for i, prompt in enumerate(PROMPTS):
            ids = tok.encode(prompt, add_special_tokens=False).ids
            expected[f"{name}-{i}"] = hf_greedy(hf, ids, N)
            model = base_name if name == "base" else f"{base_name}:{name}"
            reqs[f"{name}-{i}"] = {"model": model, "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    lora = {f"lora-{i}": {**reqs[f"base-{i}"], "model": f"{base_name}:qv8"} for i in range(len(PROMPTS))}
    lora_alone = {rid: ws_generate(d.url, {rid: body})[rid]["token_ids"] for rid, body in lora.items()}
    got = ws_generate(d.url, {**reqs, **lora})  # base, LoRA and both zoo variants together
    for rid, want in expected.items():
        assert got[rid]["error"] is None, got[rid]
        assert got[rid]["token_ids"] == want, rid
    for rid, want in lora_alone.items():
        assert got[rid]["token_ids"] == want, rid
    assert expected["ft1-0"] != expected["base-0"] and expected["ft2-0"] != expected["ft1-0"]
