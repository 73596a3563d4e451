"""What clients of vLLM and LoRAX expect, through the running daemon: adapters resolved at request
time from ``--lora-dir`` and the hub cache (``--adapters-from-hub-cache``), vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, ``GET /v1/models/{id}``,
``/tokenize``, ``/detokenize`` and ``/version``, with the official ``openai`` client where it
applies; chat templates from ``--chat-template``, from a variant's own directory and with
``chat_template_kwargs``. One daemon for the module; the adapters are made by ``peft``."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers.peft_adapters import make_peft_adapter

from .daemon import Daemon

PROMPT = [5, 6, 7, 8]

# The --chat-template file: every message's content, then an optional kwarg and the header.
FILE_TEMPLATE = (
    "file:{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
    "{% if greeting is defined %}greeting={{ greeting }};{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """A daemon with an (initially empty) --lora-dir and --delta-dir and a hub cache; the
    adapters to copy in; the base model's name."""
    root = tmp_path_factory.mktemp("compat")
    made = root / "made"
    _, a = make_peft_adapter(tiny_llama, made / "a", seed=3, target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8)
    _, b = make_peft_adapter(tiny_llama, made / "b", seed=4, target_modules=["o_proj"], r=2, lora_alpha=4)
    lora_dir, delta_dir, cache = root / "loras", root / "deltas", root / "hub"
    lora_dir.mkdir()
    delta_dir.mkdir()
    shutil.copytree(b, cache / "models--org--ad" / "snapshots" / "0123abc")
    template = root / "chat.jinja"
    template.write_text(FILE_TEMPLATE)
    extra = ("--lora-dir", str(lora_dir), "--delta-dir", str(delta_dir), "--adapters-from-hub-cache")
    extra += ("--chat-template", str(template))
    with Daemon(tiny_llama, *extra, env={"HF_HUB_CACHE": str(cache)}) as d:
        base = httpx.get(f"{d.url}/v1/models").json()["data"][0]["id"]
        yield d, base, lora_dir, a, b


def _complete(url, model, timeout=120):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _adapters(url):
    return {a["id"]: a for a in httpx.get(f"{url}/v1/adapters").json()["data"]}


def test_adapters_are_resolved_at_request_time(setup):
    d, base, lora_dir, a, b = setup
    # The reference: the same adapter registered explicitly.
    r = httpx.post(f"{d.url}/v1/adapters", json={"name": "ref-a", "path": str(a)}, timeout=120)
    assert r.status_code == 201, r.text
    want = _complete(d.url, f"{base}:ref-a").json()["choices"][0]["text"]

    shutil.copytree(a, lora_dir / "late")  # added after start-up
    # Concurrent first requests: all served, the adapter registered once (a second registration
    # of the name would have been a 409 for one of them).
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _complete(d.url, f"{base}:late"), range(6)))
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert {r.json()["choices"][0]["text"] for r in answers} == {want}
    assert answers[0].json()["model"] == f"{base}:late"
    assert _adapters(d.url)["late"]["path"].endswith("late")

    # The official client, by bare name too, from the hub cache by org/name.
    openai = pytest.importorskip("openai")  # a test extra; the GPU machine has none
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="unused")
    got = client.completions.create(
        model="late", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want
    hub = client.completions.create(model=f"{base}:org/ad", prompt=PROMPT, max_tokens=6, temperature=0)
    assert hub.model == f"{base}:org/ad"
    assert "org/ad" in _adapters(d.url)


def test_missing_and_bad_adapters_change_nothing(setup):
    d, base, lora_dir, a, _ = setup
    before = set(_adapters(d.url))
    r = _complete(d.url, f"{base}:nowhere")
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "--lora-dir" in err["message"] and "--delta-dir" in err["message"]
    assert _complete(d.url, f"{base}:org/missing").status_code == 404

    broken = lora_dir / "broken"
    shutil.copytree(a, broken)
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": "four"}')
    r = _complete(d.url, f"{base}:broken")
    assert r.status_code == 400, r.text
    assert set(_adapters(d.url)) == before
    for name in ("..", "a/../late", "%2e%2e"):
        assert _complete(d.url, f"{base}:{name}").status_code == 404, name
    assert _complete(d.url, base).status_code == 200, "serving goes on"


def test_vllm_adapter_routes_models_and_tokenizer(setup):
    d, base, _, _, b = setup
    r = httpx.post(f"{d.url}/v1/load_lora_adapter", json={"lora_name": "vl", "lora_path": str(b)}, timeout=120)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'vl' added successfully.", r.text
    card = httpx.get(f"{d.url}/v1/models/{base}:vl").json()
    assert card["id"] == f"{base}:vl" and card["parent"] == base and card["kind"] == "lora"
    assert _complete(d.url, "vl").status_code == 200
    r = httpx.post(f"{d.url}/v1/unload_lora_adapter", json={"lora_name": "vl"}, timeout=120)
    assert r.status_code == 200 and "removed" in r.text, r.text
    assert httpx.get(f"{d.url}/v1/models/{base}:vl").status_code == 404
    assert httpx.get(f"{d.url}/v1/models/{base}").json()["id"] == base

    tok = httpx.post(f"{d.url}/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0
    back = httpx.post(f"{d.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"].strip() == "hello world"
    assert httpx.get(f"{d.url}/version").json()["version"]


def test_lorax_generate_routes(setup):
    d, base, lora_dir, a, _ = setup
    shutil.copytree(a, lora_dir / "lx")
    params = {"adapter_id": "lx", "max_new_tokens": 5, "details": True, "ignore_eos_token": True}
    r = httpx.post(f"{d.url}/generate", json={"inputs": "hello world", "parameters": params}, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    body = {"model": f"{base}:lx", "prompt": "hello world", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    want = httpx.post(f"{d.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert got["generated_text"] == want
    assert got["details"]["finish_reason"] == "length" and got["details"]["generated_tokens"] == 5
    with httpx.stream("POST", f"{d.url}/generate_stream", json={"inputs": "hello world", "parameters": params}) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1]["generated_text"] == want and len(events) == 5
    assert "".join(e["token"]["text"] for e in events) == want


def _rendered(url, model, **fields):
    """The prompt text /tokenize renders for one user message (or the error response)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}
    r = httpx.post(f"{url}/tokenize", json=body, timeout=60)
    if r.status_code != 200:
        return r
    return httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


def test_chat_templates_from_the_flag_the_variant_and_kwargs(setup):
    d, base, _, a, _ = setup
    # --chat-template replaces the model's ChatML template for the base and for variants
    # without their own.
    assert _rendered(d.url, base, add_generation_prompt=False) == "file:user=hi;"
    kwargs = {"chat_template_kwargs": {"greeting": "hey"}, "add_generation_prompt": False}
    assert _rendered(d.url, base, **kwargs) == "file:user=hi;greeting=hey;"
    r = _rendered(d.url, base, chat_template_kwargs={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    chat = {"model": base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    got = httpx.post(f"{d.url}/v1/chat/completions", json={**chat, "chat_template_kwargs": {"greeting": "hey"}})
    assert got.status_code == 200, got.text
    same = {"model": base, "messages": chat["messages"], "chat_template_kwargs": {"greeting": "hey"}}
    assert got.json()["usage"]["prompt_tokens"] == httpx.post(f"{d.url}/tokenize", json=same).json()["count"]

    # A fine-tune saved with its own template uses it; a broken one is refused by file name
    # and registers nothing.
    own = a.parent / "own"
    shutil.copytree(a, own)
    (own / "chat_template.jinja").write_text("own:{% for m in messages %}{{ m.content }}{% endfor %}")
    r = httpx.post(f"{d.url}/v1/adapters", json={"name": "own", "path": str(own)}, timeout=120)
    assert r.status_code == 201, r.text
    assert _rendered(d.url, f"{base}:own") == "own:hi"
    broken = a.parent / "broken-template"
    shutil.copytree(a, broken)
    (broken / "chat_template.jinja").write_text("{% for %}")
    before = set(_adapters(d.url))
    r = httpx.post(f"{d.url}/v1/adapters", json={"name": "bt", "path": str(broken)}, timeout=120)
    assert r.status_code == 400 and "chat_template.jinja" in r.json()["error"]["message"], r.text
    assert set(_adapters(d.url)) == before
