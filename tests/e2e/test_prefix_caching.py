"""Prefix caching through the daemon (tiny Llama, CPU; on by default, `--enable-prefix-caching`):
a long prompt sent twice gives the same greedy tokens on the miss and on the hit, and the hit shows
in `/metrics` (whole 16-token pages, the last prompt token always computed); a LoRA variant misses
the base model's pages and then hits its own; `n=3` greedy choices are identical and the prompt is
prefilled once (the other two choices hit its pages); with `--no-enable-prefix-caching` nothing is
cached and the tokens are the same."""

from __future__ import annotations

import httpx
import pytest

from helpers.peft_adapters import SEVEN, make_peft_adapter

from .daemon import Daemon

BLOCK = 16  # the daemon's default --block-size
PROMPT_LEN = 70  # 4 whole pages can be hit: 64 tokens (never the 70th, whose logits are sampled)
HIT = (PROMPT_LEN - 1) // BLOCK * BLOCK


def prompt(seed: int) -> list[int]:
    """A prompt of PROMPT_LEN token ids, distinct per seed (the tiny vocab has 512 ids)."""
    return [(seed * 37 + i * 11) % 500 + 5 for i in range(PROMPT_LEN)]


@pytest.fixture(scope="module")
def lora_dir(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_lora")
    _, path = make_peft_adapter(tiny_llama, root / "pc", seed=3, target_modules=SEVEN, r=8, lora_alpha=16)
    return path


@pytest.fixture(scope="module")
def daemon(tiny_llama, lora_dir):
    with Daemon(tiny_llama, "--lora", f"pc={lora_dir}") as d:
        yield d


def complete(d: Daemon, ids: list[int], model: str | None = None, n: int = 1) -> list[str]:
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "n": n}
    if model is not None:
        body["model"] = model
    r = httpx.post(f"{d.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


def prefix_counters(d: Daemon) -> tuple[float, float]:
    m = d.metrics()
    return m["deltaserve_prefix_cache_queried_tokens_total"], m["deltaserve_prefix_cache_hit_tokens_total"]


def test_a_repeated_prompt_hits_whole_pages_and_gives_the_same_tokens(daemon):
    ids = prompt(1)
    q0, h0 = prefix_counters(daemon)
    miss = complete(daemon, ids)
    q1, h1 = prefix_counters(daemon)
    assert (q1 - q0, h1 - h0) == (PROMPT_LEN, 0)
    hit = complete(daemon, ids)
    q2, h2 = prefix_counters(daemon)
    assert (q2 - q1, h2 - h1) == (PROMPT_LEN, HIT)
    assert hit == miss
    assert daemon.metrics()["deltaserve_prefix_cache_cached_pages"] >= HIT // BLOCK


def test_a_lora_variant_never_hits_base_pages_and_hits_its_own(daemon):
    ids = prompt(2)
    base = complete(daemon, ids)
    _, h0 = prefix_counters(daemon)
    miss = complete(daemon, ids, model="pc")
    _, h1 = prefix_counters(daemon)
    assert h1 - h0 == 0, "the base model's pages are not the variant's"
    hit = complete(daemon, ids, model="pc")
    _, h2 = prefix_counters(daemon)
    assert h2 - h1 == HIT
    assert hit == miss
    assert miss != base, "the adapter changes the tokens (else this test shows nothing)"


def test_n_greedy_choices_are_identical_and_share_one_prefill(daemon):
    ids = prompt(3)
    q0, h0 = prefix_counters(daemon)
    texts = complete(daemon, ids, n=3)
    q1, h1 = prefix_counters(daemon)
    assert len(texts) == 3 and len(set(texts)) == 1, texts
    assert q1 - q0 == 3 * PROMPT_LEN
    assert h1 - h0 == 2 * HIT, "the second and third choices reused the first one's prompt pages"
    assert texts[0] == complete(daemon, ids)[0]


def test_with_prefix_caching_off_nothing_is_cached_and_tokens_are_the_same(tiny_llama, daemon):
    ids = prompt(1)
    cached = complete(daemon, ids)
    with Daemon(tiny_llama, "--no-enable-prefix-caching") as off:
        first = complete(off, ids)
        second = complete(off, ids, n=2)
        m = off.metrics()
    assert first == cached and second == [cached[0]] * 2
    assert m["deltaserve_prefix_cache_queried_tokens_total"] == 0
    assert m["deltaserve_prefix_cache_hit_tokens_total"] == 0
    assert m["deltaserve_prefix_cache_cached_pages"] == 0
