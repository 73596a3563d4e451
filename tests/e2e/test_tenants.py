"""The router's trust layer through one real daemon (tiny model, CPU) started with a key file and an
adapter root: API keys (401), variants per tenant (a forbidden one is a 404 like a missing one, and
the model list is filtered), admin routes (403), quotas (429 with Retry-After and the limit),
usage in /metrics, adapter-root escapes, file contents never echoed, variant names, request ids,
WebSocket authentication and SIGHUP reloads.

Generations are a token or two; only the quota tests hit a limit, by construction."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time

import httpx
import pytest
import websockets

from helpers.peft_adapters import make_peft_adapter

from .daemon import Daemon

ADMIN = "sk-admin-0001"
KEYS = {
    "tenants": [
        {"name": "acme", "keys": ["sk-acme-0001"], "variants": ["BASE", "BASE:acme-*"]},
        {"name": "beta", "keys": ["sk-beta-0001"], "variants": ["BASE:beta-*"]},
        {"name": "slow", "keys": ["sk-slow-0001"], "variants": ["*"], "requests_per_minute": 2},
        {"name": "tok", "keys": ["sk-tok-00001"], "variants": ["*"], "tokens_per_minute": 30},
    ],
    "admin_keys": [ADMIN],
}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """(daemon, base name, adapter root, scratch dir outside the root, keys file)."""
    tmp = tmp_path_factory.mktemp("tenants")
    root, outside = tmp / "root", tmp / "outside"
    root.mkdir()
    outside.mkdir()
    _, good = make_peft_adapter(tiny_llama, root / "acme-sql", seed=1, target_modules=["q_proj"], r=2, lora_alpha=2)
    shutil.copytree(good, root / "beta-x")
    base = tiny_llama.name
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS).replace("BASE", base))
    d = Daemon(
        tiny_llama,
        "--api-keys", str(keys),
        "--adapter-root", str(root),
        "--lora", f"acme-sql={root / 'acme-sql'}",
        "--lora", f"beta-x={root / 'beta-x'}",
        "--max-model-len", "128",
    )  # fmt: skip
    with d:
        yield d, base, root, outside, keys


def complete(d, key, model, **extra):
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(f"{d.url}/v1/completions", json=body, headers=auth(key) if key else {}, timeout=60)


def register(d, key, name, path, **kw):
    return httpx.post(
        f"{d.url}/v1/adapters", json={"name": name, "path": str(path)}, headers=auth(key), timeout=60, **kw
    )


def test_keys_are_required_except_for_health(setup):
    d, base, *_ = setup
    for key in (None, "sk-wrong-key-1"):
        r = complete(d, key, base)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert "sk-wrong" not in r.text
    r = httpx.post(f"{d.url}/v1/completions", json={}, headers={"authorization": "Basic abc"})
    assert r.status_code == 401
    assert httpx.get(f"{d.url}/v1/models").status_code == 401
    assert httpx.get(f"{d.url}/health").status_code == 200
    assert httpx.get(f"{d.url}/ready").status_code == 200
    assert "API keys required" in d.logs()


def test_each_tenant_sees_and_uses_only_its_variants(setup):
    d, base, *_ = setup

    def models(key):
        return [m["id"] for m in httpx.get(f"{d.url}/v1/models", headers=auth(key)).json()["data"]]

    assert models("sk-acme-0001") == [base, f"{base}:acme-sql"]
    assert models("sk-beta-0001") == [f"{base}:beta-x"]
    assert models(ADMIN) == [base, f"{base}:acme-sql", f"{base}:beta-x"]
    assert complete(d, "sk-acme-0001", f"{base}:acme-sql").status_code == 200
    assert complete(d, "sk-acme-0001", "acme-sql").status_code == 200, "the bare variant name too"
    assert complete(d, "sk-beta-0001", f"{base}:beta-x").status_code == 200
    # A variant the tenant may not use is answered exactly as one that does not exist, even when
    # another field is wrong too.
    for extra in ({}, {"temperature": 9}):
        forbidden = complete(d, "sk-beta-0001", f"{base}:acme-sql", **extra)
        missing = complete(d, "sk-beta-0001", f"{base}:acme-nope", **extra)
        assert forbidden.status_code == missing.status_code == 404
        f, m = forbidden.json()["error"], missing.json()["error"]
        assert f["message"].replace("acme-sql", "X") == m["message"].replace("acme-nope", "X")
        assert (f["code"], f["param"]) == (m["code"], m["param"]) == ("model_not_found", "model")
    assert complete(d, "sk-beta-0001", base).status_code == 404, "the base is not in beta's list"


def test_admin_routes_need_an_admin_key(setup):
    d, base, root, *_ = setup
    shutil.copytree(root / "acme-sql", root / "acme-new")
    assert register(d, "sk-acme-0001", "acme-new", root / "acme-new").status_code == 403
    r = httpx.post(f"{d.url}/v1/adapters", json={"name": "acme-new", "path": str(root / "acme-new")})
    assert r.status_code == 401
    for method, path in [("GET", "/v1/adapters"), ("DELETE", "/v1/adapters/acme-sql"), ("GET", "/metrics")]:
        r = httpx.request(method, f"{d.url}{path}", headers=auth("sk-acme-0001"))
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["type"] == "permission_error"
    r = register(d, ADMIN, "acme-new", root / "acme-new")
    assert r.status_code == 201, r.text
    assert complete(d, "sk-acme-0001", f"{base}:acme-new").status_code == 200, "acme-* covers it"
    assert httpx.delete(f"{d.url}/v1/adapters/acme-new", headers=auth(ADMIN), timeout=60).status_code == 200
    # A cross-site form post (no CORS preflight) is refused before anything is parsed.
    r = httpx.post(
        f"{d.url}/v1/adapters",
        content=json.dumps({"name": "x", "path": str(root / "beta-x")}),
        headers={**auth(ADMIN), "content-type": "text/plain"},
    )
    assert r.status_code == 415, r.text


def test_quotas_answer_429_with_retry_after_and_the_limit(setup):
    d, base, *_ = setup
    assert [complete(d, "sk-slow-0001", base).status_code for _ in range(2)] == [200, 200]
    r = complete(d, "sk-slow-0001", base)
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "quota_exceeded", "requests_per_minute")
    # 30 tokens a minute: a 40-token prompt can never pass, and says so.
    r = complete(d, "sk-tok-00001", base, prompt=list(range(5, 45)))
    assert r.status_code == 429 and r.json()["error"]["param"] == "tokens_per_minute", r.text
    # 20 prompt + 2 completion tokens pass; the next 20 do not fit what is left.
    assert complete(d, "sk-tok-00001", base, prompt=list(range(5, 25))).status_code == 200
    r = complete(d, "sk-tok-00001", base, prompt=list(range(5, 25)))
    assert r.status_code == 429 and r.json()["error"]["param"] == "tokens_per_minute", r.text


def test_usage_is_metered_per_tenant_and_variant(setup):
    d, base, *_ = setup
    assert complete(d, "sk-acme-0001", f"{base}:acme-sql").status_code == 200
    text = httpx.get(f"{d.url}/metrics", headers=auth(ADMIN)).text
    pair = f'tenant="acme",variant="{base}:acme-sql"'
    lines = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines() if pair in line}
    assert lines[f"deltaserve_tenant_requests_total{{{pair}}}"] >= 1
    assert lines[f"deltaserve_tenant_prompt_tokens_total{{{pair}}}"] >= 3
    assert lines[f"deltaserve_tenant_completion_tokens_total{{{pair}}}"] >= 2
    assert 'deltaserve_tenant_quota_refusals_total{limit="requests_per_minute",tenant="slow"' in text
    assert 'deltaserve_api_errors_total{type="authentication_error"}' in text


def test_adapter_paths_are_confined_to_the_root(setup):
    d, _, root, outside, _ = setup
    (outside / "secret.txt").write_text('{"peft_type": "sk-SECRET-42"}')
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    sneaky = root / "sneaky"
    shutil.copytree(root / "acme-sql", sneaky)
    (sneaky / "adapter_config.json").unlink()
    (sneaky / "adapter_config.json").symlink_to(outside / "secret.txt")
    cases = [
        (root / ".." / "outside", "`..`"),
        ("/etc", "outside every --adapter-root"),
        (root / "link-out", "through a symlink"),
        ("/proc/self/cwd", "/proc"),
        (sneaky, "adapter_config.json: the adapter path resolves (through a symlink) outside"),
    ]
    for path, rule in cases:
        r = register(d, ADMIN, "escape", path)
        assert r.status_code == 400, (path, r.text)
        assert rule in r.json()["error"]["message"], (path, r.text)
        assert "SECRET" not in r.text
    # Outside the root, a missing path and an existing one get the same answer.
    a, b = register(d, ADMIN, "escape", "/nonexistent/dir"), register(d, ADMIN, "escape", "/etc")
    assert a.json()["error"]["message"] == b.json()["error"]["message"]


def test_file_contents_are_never_echoed(setup):
    d, _, root, *_ = setup
    bad = root / "secret-type"
    shutil.copytree(root / "acme-sql", bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "sk-SECRET-42"}))
    r = register(d, ADMIN, "secret-type", bad)
    assert r.status_code == 400, r.text
    assert "peft_type" in r.json()["error"]["message"] and "SECRET" not in r.text


def test_variant_names_are_url_safe(setup):
    d, _, root, *_ = setup
    # One slash is allowed: `org/repo`, as a hub repo id (request-time resolution); no more.
    for name in [".", "..", "%2e%2e", "a\x00b", "a b", "a/b/c", "/a", "a/..", "é", "x" * 129]:
        r = register(d, ADMIN, name, root / "beta-x")
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == "name"


def test_request_ids(setup):
    d, base, *_ = setup
    r = complete(d, "sk-acme-0001", base)
    assert r.headers["x-request-id"].startswith("req-")
    given = {"x-request-id": "client-id-7", **auth("sk-acme-0001")}
    r = httpx.post(f"{d.url}/v1/completions", json={"model": base, "prompt": [5], "max_tokens": 1}, headers=given)
    assert r.headers["x-request-id"] == "client-id-7"
    r = httpx.post(f"{d.url}/v1/completions", json={"prompt": [5]}, headers={"x-request-id": "bad id"})
    assert r.status_code == 401 and r.headers["x-request-id"].startswith("req-")
    assert r.json()["error"]["request_id"] == r.headers["x-request-id"]
    logs = d.logs()
    line = next(li for li in logs.splitlines() if "client-id-7" in li and "request finished" in li)
    for field in ["tenant=acme", f"variant={base}", "prompt_tokens=1", "completion_tokens=1", "finish_reason=length"]:
        assert field in line, line


async def _ws(url, headers, first=None, model=None):
    """Sends `first` (if any) then one generation; returns every message up to its end or an error."""
    got = []
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/ws", additional_headers=headers) as ws:
        if first is not None:
            await ws.send(json.dumps(first))
        await ws.send(
            json.dumps({"type": "generate", "id": "g", "request": {"model": model, "prompt": [5], "max_tokens": 1}})
        )
        async with asyncio.timeout(30):
            try:
                while True:
                    got.append(json.loads(await ws.recv()))
                    if got[-1]["type"] in ("done", "error"):
                        return got
            except websockets.ConnectionClosed:
                return got


def test_websocket_authenticates_by_header_or_first_message(setup):
    d, base, *_ = setup
    with pytest.raises(websockets.InvalidStatus):
        asyncio.run(_ws(d.url, auth("sk-wrong-key-1"), model=base))
    by_header = asyncio.run(_ws(d.url, auth("sk-acme-0001"), model=base))
    assert by_header[-1]["type"] == "done", by_header
    in_band = asyncio.run(_ws(d.url, {}, first={"type": "auth", "key": "sk-acme-0001"}, model=base))
    assert in_band[0] == {"type": "authenticated", "tenant": "acme"} and in_band[-1]["type"] == "done", in_band
    forbidden = asyncio.run(_ws(d.url, {}, first={"type": "auth", "key": "sk-beta-0001"}, model=base))
    assert forbidden[-1]["type"] == "error" and forbidden[-1]["error"]["code"] == "model_not_found"
    refused = asyncio.run(_ws(d.url, {}, first={"type": "auth", "key": "sk-wrong-key-1"}, model=base))
    assert refused == [refused[0]] and refused[0]["error"]["type"] == "authentication_error", refused
    unauthenticated = asyncio.run(_ws(d.url, {}, model=base))
    assert unauthenticated[0]["error"]["type"] == "authentication_error", unauthenticated


def test_sighup_rereads_the_key_file(setup):
    d, base, _, _, keys = setup
    spec = json.loads(keys.read_text())
    spec["tenants"].append({"name": "late", "keys": ["sk-late-0001"], "variants": [base]})
    keys.write_text(json.dumps(spec))
    assert complete(d, "sk-late-0001", base).status_code == 401
    os.kill(d.proc.pid, signal.SIGHUP)
    for _ in range(100):
        if "SIGHUP: key file reread" in d.logs():
            break
        time.sleep(0.05)
    assert complete(d, "sk-late-0001", base).status_code == 200
    keys.write_text("{ not json")
    os.kill(d.proc.pid, signal.SIGHUP)
    for _ in range(100):
        if "the key file was not reread" in d.logs():
            break
        time.sleep(0.05)
    assert complete(d, "sk-late-0001", base).status_code == 200, "a bad file keeps the keys in force"
    assert d.proc.poll() is None
