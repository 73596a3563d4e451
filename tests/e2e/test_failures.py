"""Failure behaviour through the running daemon (issue 28): nothing a client sends can stop the
worker. Each adapter config that crashed or froze the worker (an invalid regex in
``exclude_modules`` / ``layers_pattern`` / ``rank_pattern`` / ``alpha_pattern``,
``layers_pattern: 5``, a catastrophic-backtracking ``target_modules``) is a 400 naming the field,
while another client's request completes and the worker never restarts.

Graceful shutdown (the module's last test): SIGTERM with requests in flight answers new ones with
503 + ``Retry-After`` while it drains, ends what ``--drain-timeout`` did not let finish with an
error, and leaves no worker process and no ``/dev/shm`` file. Also: the ``/dev/shm`` rings a SIGKILLed daemon left behind (named after its dead pid) are
removed when the next daemon starts.

One daemon on the tiny model for the module; the adapter is made by ``peft`` once."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.peft_adapters import make_peft_adapter

from .daemon import Daemon


@pytest.fixture(scope="module")
def good_adapter(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("failure-loras")
    _, path = make_peft_adapter(tiny_llama, root / "good", seed=3, target_modules=["q_proj", "v_proj"], r=4)
    return path


@pytest.fixture(scope="module")
def stale_ipc_dir():
    """An IPC directory as a SIGKILLed daemon leaves it: named after a pid that has exited."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    exited = subprocess.Popen(["true"])
    exited.wait()
    d = shm / f"deltaserve-{exited.pid}-w0-stale"
    d.mkdir()
    (d / "to_worker.ring").write_bytes(b"\0" * 64)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(tiny_llama, stale_ipc_dir):
    with Daemon(tiny_llama, "--drain-timeout", "1") as d:
        yield d


def test_ipc_files_of_a_dead_daemon_are_removed_at_start(daemon, stale_ipc_dir):
    assert not stale_ipc_dir.exists()
    own = list(Path("/dev/shm").glob(f"deltaserve-{daemon.proc.pid}-w0-*"))
    assert len(own) == 1, own  # the running daemon's own rings are kept


def _restarts(daemon) -> float:
    return sum(v for k, v in daemon.metrics().items() if k.startswith("deltaserve_worker_restarts_total"))


def _broken_copy(good, tmp_path, name, **changes):
    d = tmp_path / name
    shutil.copytree(good, d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


CRASH_CONFIGS = {
    "exclude_bad_regex": ({"exclude_modules": "("}, "'exclude_modules'"),
    "layers_pattern_bad_regex": ({"layers_to_transform": [0], "layers_pattern": "["}, "'layers_pattern'"),
    "layers_pattern_int": ({"layers_to_transform": [0], "layers_pattern": 5}, "'layers_pattern'"),
    "rank_pattern_bad_regex": ({"rank_pattern": {"(": 4}}, "'rank_pattern'"),
    "alpha_pattern_bad_regex": ({"alpha_pattern": {"a[": 4}}, "'alpha_pattern'"),
    "target_lookaround": ({"target_modules": "(?=.*q).*q_proj"}, "'target_modules'"),
}


def test_crash_configs_are_400s_and_the_worker_serves_on(daemon, good_adapter, tmp_path):
    before = _restarts(daemon)
    done: dict[str, httpx.Response] = {}
    body = {"prompt": [5, 6, 7], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    other = threading.Thread(
        target=lambda: done.setdefault("r", httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=60))
    )
    other.start()  # another client's request, in flight while the bad configs arrive
    for name, (changes, field) in CRASH_CONFIGS.items():
        path = _broken_copy(good_adapter, tmp_path, name, **changes)
        r = httpx.post(f"{daemon.url}/v1/adapters", json={"name": name, "path": str(path)}, timeout=60)
        assert r.status_code == 400, (name, r.text)
        assert field in r.json()["error"]["message"], (name, r.text)
    # Linear time: accepted by the router's engine, matched by the worker's, never backtracking.
    path = _broken_copy(good_adapter, tmp_path, "backtracking", target_modules=r"(.*)*\.zzz")
    r = httpx.post(f"{daemon.url}/v1/adapters", json={"name": "backtracking", "path": str(path)}, timeout=60)
    assert r.status_code == 400 and "matches none" in r.text, r.text
    other.join(60)
    assert done["r"].status_code == 200 and done["r"].json()["usage"]["completion_tokens"] == 24
    assert _restarts(daemon) == before
    ok = httpx.post(f"{daemon.url}/v1/adapters", json={"name": "good", "path": str(good_adapter)}, timeout=60)
    assert ok.status_code == 201, ok.text
    r = httpx.post(f"{daemon.url}/v1/completions", json={**body, "model": "good"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_variant_whose_files_break_after_registration_fails_alone(daemon, good_adapter, tmp_path):
    """Issue 28: a request for an adapter whose weights file changed on disk after registration
    made the worker fatal (every client's request failed, a traceback in the body). Now only that
    variant's requests fail, with an error naming it; it is unavailable until registered again."""
    fragile = tmp_path / "fragile"
    shutil.copytree(good_adapter, fragile)
    r = httpx.post(f"{daemon.url}/v1/adapters", json={"name": "fragile", "path": str(fragile)}, timeout=60)
    assert r.status_code == 201, r.text
    before = _restarts(daemon)
    weights = fragile / "adapter_model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{corrupt")  # changed after registration

    body = {"prompt": [5, 6, 7], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    done: dict[str, httpx.Response] = {}
    other = threading.Thread(
        target=lambda: done.setdefault("r", httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=60))
    )
    other.start()  # another client's request, in flight while the variant fails
    r = httpx.post(f"{daemon.url}/v1/completions", json={**body, "model": "fragile"}, timeout=60)
    assert r.status_code >= 500, r.text
    message = r.json()["error"]["message"]
    assert "`fragile`" in message and "Traceback" not in message and str(tmp_path) not in message, message
    other.join(60)
    assert done["r"].status_code == 200 and done["r"].json()["usage"]["completion_tokens"] == 24
    assert _restarts(daemon) == before and httpx.get(f"{daemon.url}/ready").status_code == 200

    # Unavailable until registered again: refused at once, naming it.
    r = httpx.post(f"{daemon.url}/v1/completions", json={**body, "model": "fragile"}, timeout=60)
    assert r.status_code == 503 and "`fragile`" in r.json()["error"]["message"], r.text
    shutil.rmtree(fragile)
    shutil.copytree(good_adapter, fragile)
    assert httpx.delete(f"{daemon.url}/v1/adapters/fragile", timeout=60).status_code == 200
    r = httpx.post(f"{daemon.url}/v1/adapters", json={"name": "fragile", "path": str(fragile)}, timeout=60)
    assert r.status_code == 201, r.text
    r = httpx.post(f"{daemon.url}/v1/completions", json={**body, "model": "fragile"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24, r.text
    assert _restarts(daemon) == before


def _streams_until_done(url, body, first, results, i):
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    first[i].set()
                    break
            results[i] = [line for line in lines if line.startswith("data:")]
    except httpx.HTTPError as e:  # the connection closed: recorded, then asserted on
        results[i] = e
    finally:
        first[i].set()


def test_sigterm_drains_then_ends_what_is_left_and_leaves_nothing(daemon):
    """Last in the module: it stops the daemon."""
    n = 48
    body = {"prompt": [5, 6, 7], "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    first = [threading.Event() for _ in range(n)]
    results: list = [None] * n
    threads = [
        threading.Thread(target=_streams_until_done, args=(daemon.url, body, first, results, i)) for i in range(n)
    ]
    for t in threads:
        t.start()
    for e in first:
        assert e.wait(60)
    pid = daemon.proc.pid
    assert list(Path("/dev/shm").glob(f"deltaserve-{pid}-w*"))
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    while httpx.get(f"{daemon.url}/ready", timeout=5).status_code != 503:
        assert time.monotonic() - started < 5, "never started draining"
    refused = httpx.post(f"{daemon.url}/v1/completions", json={**body, "stream": False}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert httpx.get(f"{daemon.url}/health", timeout=5).status_code == 200
    assert daemon.wait_exit(30) == 0
    for t in threads:
        t.join(10)
    ended = [r[-1] for r in results if isinstance(r, list) and r]
    assert len(ended) == n, results  # every stream got its last event
    assert all(e == "data: [DONE]" or "shutting down" in e for e in ended), ended
    assert not list(Path("/dev/shm").glob(f"deltaserve-{pid}-w*"))
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            assert f"deltaserve-{pid}-w".encode() not in cmdline, f"worker {proc.name} outlived the daemon"
