"""Substitution under load through the daemon (``deltaserve --zoo DIR --substitute-above F``).

``ft3`` opted in (``conftest.sub_zoo``): while more than F of the capacity (--max-queued-per-worker x
workers) is queued or running, its requests run ``ft3.substitute`` (layer 1 as the base's) and the
response says ``x-deltaserve-substituted: true``; its tokens count in
``deltaserve_zoo_substituted_tokens_total``. Alone, it runs itself. ``ft1`` did not opt in: never
substituted. Tokens of ``ft3`` and of its substitute equal transformers on what their blocks hold.
A zoo variant the worker refuses and a corrupt substitution entry are logged naming file and field,
and the rest is served.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from e2e.daemon import Daemon
from e2e.wsclient import ws_generate

from deltaserve.compress import materialize
from helpers.executors import hf_greedy

from .conftest import SubZooFixture

PROMPT = "once upon a time there was"
N = 6
ABOVE = 0.2
"""With --max-queued-per-worker 4 and one worker: substituted while more than 0.8 requests are in."""


@pytest.fixture(scope="module")
def served(sub_zoo: SubZooFixture, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("substitution")
    zoo = root / "zoo"
    shutil.copytree(sub_zoo.zoo, zoo)
    bad = zoo / "variants" / "bad"  # a variant directory the worker refuses
    shutil.copytree(zoo / "variants" / "ft1", bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    m = json.loads((zoo / "manifest.json").read_text())  # a substitution entry the router refuses
    m["variants"]["ft2"]["substitution"] = {"min_similarity": 5, "components": ["layers.0.attn"], "delta_dir": None}
    (zoo / "manifest.json").write_text(json.dumps(m))
    refs = {
        "ft1": materialize(zoo / "variants" / "ft1", sub_zoo.base, root / "ref-ft1"),
        "ft3": materialize(zoo / "variants" / "ft3", sub_zoo.base, root / "ref-ft3"),
        "ft3.substitute": materialize(zoo / "substitutes" / "ft3", sub_zoo.base, root / "ref-ft3-sub"),
    }
    args = ["--zoo", str(zoo), "--max-deltas", "4", "--max-queued-per-worker", "4", "--substitute-above", str(ABOVE)]
    with Daemon(sub_zoo.base, *args) as d:
        base_name = httpx.get(f"{d.url}/v1/models").json()["data"][0]["id"]
        yield d, base_name, refs


def test_bad_zoo_entries_are_refused_by_file_and_field_and_the_rest_served(served) -> None:
    d, base_name, _ = served
    ids = [c["id"] for c in httpx.get(f"{d.url}/v1/models").json()["data"]]
    assert ids == [base_name] + [f"{base_name}:{n}" for n in ("ft1", "ft2", "ft3")]  # the substitute is internal
    admin = [c["id"] for c in httpx.get(f"{d.url}/v1/adapters").json()["data"]]
    assert sorted(admin) == ["ft1", "ft2", "ft3", "ft3.substitute"]
    logs = d.logs()
    assert "bad/manifest.json" in logs and "format_version" in logs
    assert "field 'variants.ft2.substitution.min_similarity'" in logs


def test_substitution_only_under_load_and_only_for_the_opted_in(served, sub_zoo: SubZooFixture) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    d, base_name, refs = served
    ids = Tokenizer.from_file(str(sub_zoo.base / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids
    body = {"prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    alone = {}
    for name, ref in refs.items():  # each alone: nothing else in, never substituted
        want = hf_greedy(AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval(), ids, N)
        got = ws_generate(d.url, {name: {**body, "model": f"{base_name}:{name}"}})[name]
        assert got["error"] is None and got["token_ids"] == want, name
        alone[name] = got["text"]

    def complete(name: str) -> httpx.Response:
        r = httpx.post(f"{d.url}/v1/completions", json={**body, "model": f"{base_name}:{name}"}, timeout=120)
        assert r.status_code == 200, r.text
        return r

    r = complete("ft3")
    assert "x-deltaserve-substituted" not in r.headers and r.json()["choices"][0]["text"] == alone["ft3"]
    assert not any("zoo_substituted" in k for k in d.metrics())

    long = {"model": base_name, "prompt": ids, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{d.url}/v1/completions", json=long) as s:
        lines = s.iter_lines()  # kept: a closed line iterator would close the stream (cancel it)
        assert any(line.startswith("data:") for line in lines)  # running: 1 of 4 in, more than 0.2
        r = complete("ft3")
        assert r.headers["x-deltaserve-substituted"] == "true"
        assert r.json()["choices"][0]["text"] == alone["ft3.substitute"]
        assert r.json()["model"] == f"{base_name}:ft3"  # the name asked for
        r = complete("ft1")  # did not opt in
        assert "x-deltaserve-substituted" not in r.headers and r.json()["choices"][0]["text"] == alone["ft1"]
    counted = {k: v for k, v in d.metrics().items() if "zoo_substituted" in k}
    assert counted == {f'deltaserve_zoo_substituted_tokens_total{{variant="{base_name}:ft3"}}': len(ids) + N}
