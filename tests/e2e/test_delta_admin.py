"""Compressed deltas through the adapter admin API of a running daemon: POST /v1/adapters tells a
delta directory (`manifest.json`) from a LoRA one (`adapter_config.json`), an optional `kind`
is asserted, the card and /v1/models say the kind, DELETE frees it, and /metrics reports the delta
slots and the scheduler's skip-the-line counters.

The daemon runs with `--max-deltas 1`, so a batch over two deltas has to take turns for the slot.
"""

from __future__ import annotations

import httpx
import pytest

from helpers.deltas import make_delta
from helpers.peft_adapters import make_peft_adapter

from .daemon import Daemon
from .wsclient import ws_generate


@pytest.fixture(scope="module")
def dirs(tiny_llama, tmp_path_factory):
    """Two delta directories and one LoRA directory."""
    root = tmp_path_factory.mktemp("delta_admin")
    return {
        "da": make_delta(tiny_llama, root / "da", seed=7, bits=4)[0],
        "db": make_delta(tiny_llama, root / "db", seed=8, bits=4)[0],
        "lora": make_peft_adapter(tiny_llama, root / "lora", seed=3, target_modules=["q_proj"], r=4, lora_alpha=8)[1],
    }


@pytest.fixture(scope="module")
def daemon(tiny_llama):
    with Daemon(tiny_llama, "--max-deltas", "1") as d:
        yield d


@pytest.fixture(scope="module")
def base_name(daemon):
    return httpx.get(f"{daemon.url}/v1/models").json()["data"][0]["id"]


def _post(daemon, body):
    return httpx.post(f"{daemon.url}/v1/adapters", json=body, timeout=120)


def _names(daemon):
    return [c["id"] for c in httpx.get(f"{daemon.url}/v1/adapters").json()["data"]]


def test_a_delta_registers_by_its_files_and_says_its_kind(daemon, base_name, dirs):
    r = _post(daemon, {"name": "da", "path": str(dirs["da"])})
    assert r.status_code == 201, r.text
    card = r.json()
    assert card["kind"] == "delta" and card["summary"].startswith("4-bit 2:4"), card
    assert card["num_blocks"] == 0 and card["host_bytes"] > 0 and card["model"] == f"{base_name}:da"
    r = _post(daemon, {"name": "db", "path": str(dirs["db"]), "kind": "delta"})
    assert r.status_code == 201, r.text
    r = _post(daemon, {"name": "lo", "path": str(dirs["lora"]), "kind": "lora"})
    assert r.status_code == 201, r.text
    assert r.json()["kind"] == "lora"

    models = {m["id"]: m for m in httpx.get(f"{daemon.url}/v1/models").json()["data"]}
    assert models[f"{base_name}:da"]["kind"] == "delta" and models[f"{base_name}:da"]["parent"] == base_name
    assert models[f"{base_name}:lo"]["kind"] == "lora"
    assert "kind" not in models[base_name]


@pytest.mark.parametrize(
    "body, words, param",
    [
        ({"name": "x", "path": "{da}", "kind": "lora"}, "not a LoRA adapter", "kind"),
        ({"name": "x", "path": "{lora}", "kind": "delta"}, "not a compressed delta", "kind"),
        ({"name": "x", "path": "{da}", "kind": "full"}, "kind", None),
        ({"name": "x", "path": "{root}"}, "manifest.json", "path"),
    ],
)
def test_a_wrong_kind_or_directory_is_a_400_and_changes_nothing(daemon, dirs, body, words, param):
    before = _names(daemon)
    paths = {"da": dirs["da"], "lora": dirs["lora"], "root": dirs["da"].parent}
    body = {**body, "path": body["path"].format(**{k: str(v) for k, v in paths.items()})}
    r = _post(daemon, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    assert _names(daemon) == before


def test_two_deltas_take_turns_for_one_slot_and_the_metrics_show_it(daemon, base_name):
    reqs = {
        f"r{i}": {
            "model": f"{base_name}:{('da', 'db')[i % 2]}",
            "prompt": "take turns " * (1 + i % 3),
            "max_tokens": 5 + i % 4,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(8)
    }
    got = ws_generate(daemon.url, reqs)
    for rid, body in reqs.items():
        assert got[rid]["error"] is None, got[rid]
        assert len(got[rid]["token_ids"]) == body["max_tokens"], rid
    m = daemon.metrics()
    assert m["deltaserve_deltas_on_gpu"] <= 1
    assert m["deltaserve_adapter_gpu_evictions_total"] >= 1, "two deltas shared one slot"
    for name in ("deltaserve_delta_skips_total", "deltaserve_delta_skip_preemptions_total"):
        assert name in m


def test_deleting_a_delta_frees_its_name(daemon, base_name, dirs):
    r = httpx.delete(f"{daemon.url}/v1/adapters/db", timeout=120)
    assert r.status_code == 200, r.text
    assert "db" not in _names(daemon)
    body = {"model": f"{base_name}:db", "prompt": "gone", "max_tokens": 2}
    assert httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=60).status_code == 404
    r = _post(daemon, {"name": "db", "path": str(dirs["db"])})
    assert r.status_code == 201, r.text
