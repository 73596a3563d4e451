"""The adapter admin API through the running daemon: POST /v1/adapters registers a PEFT adapter
while serving, GET lists, DELETE waits for the adapter's in-flight requests and frees it; every
refused adapter is a 4xx naming the problem, and serving goes on unchanged.

Adapters are made by the `peft` library itself; the reference is transformers generating with the
adapter merged into the base."""

from __future__ import annotations

import copy
import json
import shutil
import threading
import time

import httpx
import pytest
import torch

from helpers.peft_adapters import SEVEN, make_peft_adapter

from .daemon import Daemon

N = 12


@pytest.fixture(scope="module")
def made(tiny_llama, tmp_path_factory):
    """One good adapter (peft model, dir), and a scratch root for broken copies."""
    root = tmp_path_factory.mktemp("admin-loras")
    good = make_peft_adapter(tiny_llama, root / "good", seed=5, target_modules=SEVEN, r=4, lora_alpha=8)
    return good, root


@pytest.fixture(scope="module")
def daemon(tiny_llama):
    with Daemon(tiny_llama) as d:
        yield d


@pytest.fixture(scope="module")
def base_name(daemon):
    return httpx.get(f"{daemon.url}/v1/models").json()["data"][0]["id"]


def _post(daemon, body):
    return httpx.post(f"{daemon.url}/v1/adapters", json=body, timeout=120)


def _complete(daemon, model, prompt=None, n=N):
    body = {"model": model, "prompt": prompt or [5, 6, 7, 8], "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=120)
    return r


def _greedy(model, prompt_ids, n):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def _tokens(daemon, model, prompt, n=N):
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_register_serve_and_list_at_run_time(daemon, base_name, made, tiny_llama):
    (peft_model, path), _ = made
    r = _post(daemon, {"name": "live", "path": str(path)})
    assert r.status_code == 201, r.text
    card = r.json()
    assert card["id"] == "live" and card["model"] == f"{base_name}:live" and card["status"] == "active"
    assert card["max_rank"] == 4 and sorted(card["target_modules"]) == sorted(SEVEN)
    assert card["num_blocks"] >= 1 and card["host_bytes"] > 0

    listed = httpx.get(f"{daemon.url}/v1/adapters").json()["data"]
    assert [a["id"] for a in listed] == ["live"]
    models = [m["id"] for m in httpx.get(f"{daemon.url}/v1/models").json()["data"]]
    assert f"{base_name}:live" in models

    # Served tokens equal peft's merged model, and differ from the base's.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    ids = tok.encode("adapters at run time", add_special_tokens=False).ids
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    want = _greedy(merged, ids, N)
    body = {"model": "live", "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    from .wsclient import ws_generate

    got = ws_generate(daemon.url, {"a": body, "b": {**body, "model": base_name}})
    assert got["a"]["token_ids"] == want
    assert got["b"]["token_ids"] != want


def _broken(root, good_dir, name, edit):
    d = root / name
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(good_dir, d)
    edit(d)
    return d


def _set_cfg(**kv):
    def edit(d):
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(kv)
        (d / "adapter_config.json").write_text(json.dumps(cfg))

    return edit


def _pickle_only(d):
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")


def _truncate(d):
    data = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])


def _nan(d):
    from safetensors.torch import load_file, save_file

    t = load_file(d / "adapter_model.safetensors")
    k = next(iter(t))
    t[k][0, 0] = float("nan")
    save_file(t, d / "adapter_model.safetensors")


def _wrong_shape(d):
    from safetensors.torch import load_file, save_file

    t = load_file(d / "adapter_model.safetensors")
    k = next(k for k in t if "lora_A" in k)
    t[k] = torch.zeros(t[k].shape[0], t[k].shape[1] + 3)
    save_file(t, d / "adapter_model.safetensors")


REFUSED = [
    ("dora", _set_cfg(use_dora=True), "use_dora"),
    ("modules-to-save", _set_cfg(modules_to_save=["lm_head"]), "modules_to_save"),
    ("embedding-target", _set_cfg(target_modules=["embed_tokens"]), "embed_tokens"),
    ("pickle", _pickle_only, "adapter_model"),
    ("truncated", _truncate, "adapter_model.safetensors"),
    ("nan", _nan, "finite"),
    ("wrong-shape", _wrong_shape, "lora_A"),
]


@pytest.mark.parametrize("name,edit,needle", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_adapters_get_a_4xx_naming_the_problem_and_serving_goes_on(daemon, base_name, made, name, edit, needle):
    (_, good_dir), root = made
    before = httpx.get(f"{daemon.url}/v1/adapters").json()["data"]
    bad = _broken(root, good_dir, name, edit)
    r = _post(daemon, {"name": f"bad-{name}", "path": str(bad)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["param"] == "path"
    assert httpx.get(f"{daemon.url}/v1/adapters").json()["data"] == before, "a refusal changes nothing"
    assert _complete(daemon, base_name).status_code == 200, "serving goes on"


def test_request_level_refusals(daemon, base_name, made):
    (_, good_dir), root = made
    assert _post(daemon, {"name": "dup", "path": str(good_dir)}).status_code == 201
    cases = [
        ({"name": "dup", "path": str(good_dir)}, 409, "already taken"),
        ({"name": base_name, "path": str(good_dir)}, 409, "already taken"),
        ({"name": "a:b", "path": str(good_dir)}, 400, "invalid"),
        ({"name": "nowhere", "path": str(root / "does-not-exist")}, 400, "does-not-exist"),
        ({"name": "empty", "path": str(root)}, 400, "adapter_config.json"),
        ({"name": "x"}, 400, "path"),
    ]
    for body, status, needle in cases:
        r = _post(daemon, body)
        assert r.status_code == status, (body, r.text)
        assert needle in r.json()["error"]["message"], (body, r.text)
    r = httpx.delete(f"{daemon.url}/v1/adapters/never-registered", timeout=30)
    assert r.status_code == 404 and "GET /v1/adapters" in r.json()["error"]["message"]
    assert httpx.delete(f"{daemon.url}/v1/adapters/dup", timeout=60).status_code == 200


def test_delete_waits_for_in_flight_requests_then_frees(daemon, base_name, made):
    (_, good_dir), _ = made
    r = _post(daemon, {"name": "doomed", "path": str(good_dir)})
    assert r.status_code == 201
    doomed_blocks = r.json()["num_blocks"]
    n = 120  # long enough on the CPU worker that the delete arrives mid-generation
    result = {}

    def generate():
        r = _complete(daemon, f"{base_name}:doomed", n=n)
        result["status"], result["body"], result["end"] = r.status_code, r.json(), time.monotonic()

    th = threading.Thread(target=generate)
    th.start()
    deadline = time.monotonic() + 60
    while daemon.metrics().get("deltaserve_requests_running", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    during = daemon.metrics()
    assert during["deltaserve_adapter_blocks"] >= doomed_blocks, "the running request's adapter is on the GPU"
    r = httpx.delete(f"{daemon.url}/v1/adapters/doomed", timeout=300)
    delete_end = time.monotonic()
    th.join(300)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "doomed", "object": "adapter", "deleted": True}
    assert result["status"] == 200, result
    assert result["body"]["usage"]["completion_tokens"] == n, "the in-flight request ran to its end"
    assert delete_end >= result["end"] - 0.25, "DELETE returned before the in-flight request finished"
    # Gone: requests 404, the list and models no longer show it, its pages are free.
    assert _complete(daemon, "doomed").status_code == 404
    assert "doomed" not in [a["id"] for a in httpx.get(f"{daemon.url}/v1/adapters").json()["data"]]
    after = daemon.metrics()
    assert after["deltaserve_adapters_registered"] == during["deltaserve_adapters_registered"] - 1
    assert after["deltaserve_adapter_blocks"] == during["deltaserve_adapter_blocks"] - doomed_blocks
    # The name is free again.
    assert _post(daemon, {"name": "doomed", "path": str(good_dir)}).status_code == 201
    assert httpx.delete(f"{daemon.url}/v1/adapters/doomed", timeout=60).status_code == 200
