"""lm-eval-harness, a client no one here wrote, against the daemon: its `local-completions` model
(loglikelihood through `echo` + `logprobs`, and generation) and `local-chat-completions`
(generation through the chat template) run two small local tasks (lm_eval_tasks/: their YAML and
data) for the base and for a LoRA variant, and every score and every per-sample answer equals the
same harness run on transformers (`hf`, with `peft` for the variant): loglikelihoods within 1e-3,
greedy generations and is-greedy flags identical. Tiny random Llama, CPU, float32.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from helpers.peft_adapters import make_peft_adapter

from .daemon import Daemon

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval-harness is a test dependency (pyproject's `test` extra)")

TASKS = Path(__file__).parent / "lm_eval_tasks"
CHOICE, GENERATE = "ds_choice", "ds_generate"


@pytest.fixture(scope="module")
def lora_dir(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_eval_lora") / "lora"
    make_peft_adapter(tiny_llama, out, seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return out


@pytest.fixture(scope="module")
def served(tiny_llama, lora_dir):
    with Daemon(tiny_llama, "--lora", f"tuned={lora_dir}", "--max-model-len", "256") as d:
        yield d


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """The harness must not look for anything on a hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def evaluate(model: str, model_args: dict, tasks: list[str], chat: bool = False) -> dict:
    """The harness's own `simple_evaluate`, run where the tasks' `data_files` (relative) are."""
    from lm_eval.tasks import TaskManager

    with contextlib.chdir(TASKS):
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=tasks,
            task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
            batch_size=1,
            log_samples=True,
            bootstrap_iters=0,
            apply_chat_template=chat,
        )


def hf_args(base: Path, lora: Path | None) -> dict:
    args = {"pretrained": str(base), "dtype": "float32", "device": "cpu"}
    return args | ({"peft": str(lora)} if lora else {})


def api_args(daemon: Daemon, route: str, model: str, base: Path) -> dict:
    return {
        "model": model,
        "base_url": f"{daemon.url}/v1/{route}",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(base),
        "num_concurrent": 2,
        "max_retries": 1,
    }


def assert_same_answers(got: dict, want: dict, tasks: list[str]) -> None:
    for task in tasks:
        assert got["results"][task] == pytest.approx(want["results"][task]), task
        by_doc = {s["doc_id"]: s for s in want["samples"][task]}
        assert len(got["samples"][task]) == len(by_doc) > 0
        for sample in got["samples"][task]:
            ref = by_doc[sample["doc_id"]]
            for mine, theirs in zip(sample["resps"], ref["resps"], strict=True):
                (mine,), (theirs,) = mine, theirs
                if isinstance(mine, str):  # a generation
                    assert mine == theirs, (task, sample["doc"])
                else:  # (loglikelihood, is_greedy)
                    assert float(mine[0]) == pytest.approx(float(theirs[0]), abs=1e-3), (task, sample["doc"])
                    assert bool(mine[1]) == bool(theirs[1]), (task, sample["doc"])


@pytest.mark.parametrize("variant", ["base", "lora"])
def test_local_completions_scores_equal_transformers(variant, served, tiny_llama, lora_dir):
    lora = lora_dir if variant == "lora" else None
    name = f"{tiny_llama.name}:tuned" if lora else tiny_llama.name
    tasks = [CHOICE, GENERATE]
    got = evaluate("local-completions", api_args(served, "completions", name, tiny_llama), tasks)
    want = evaluate("hf", hf_args(tiny_llama, lora), tasks)
    assert_same_answers(got, want, tasks)


def test_local_chat_completions_generations_equal_transformers(served, tiny_llama, lora_dir):
    name = f"{tiny_llama.name}:tuned"
    got = evaluate(
        "local-chat-completions", api_args(served, "chat/completions", name, tiny_llama), [GENERATE], chat=True
    )
    want = evaluate("hf", hf_args(tiny_llama, lora_dir), [GENERATE], chat=True)
    assert_same_answers(got, want, [GENERATE])
