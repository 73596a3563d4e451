"""``deltaserve.Server`` on the tiny Llama (CPU): the official ``openai`` client gets a completion
from its URL, the same tokens as ``LLM``-style greedy through the admin-registered variant;
registration and metrics go through the engine, not HTTP; an exception inside the ``with`` block
(``KeyboardInterrupt``) stops it and leaves no worker process (checked by pid)."""

from __future__ import annotations

import httpx
import pytest

import deltaserve

from .conftest import SMALL, child_pids


@pytest.fixture(scope="module")
def served(tiny_llama, variant_dirs):
    """(the running server, the pids of the worker processes it started)."""
    before = child_pids()
    srv = deltaserve.Server(tiny_llama, loras={"sql": variant_dirs["sql"][0]}, **SMALL)
    workers = child_pids() - before
    yield srv, workers
    srv.stop()


def test_openai_client_completion_and_admin_without_http(served, variant_dirs):
    openai = pytest.importorskip("openai")
    srv, workers = served
    assert srv.url.startswith("http://127.0.0.1:") and len(workers) == 1
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    base = client.completions.create(model=model, prompt="hello world", max_tokens=5, temperature=0)
    assert base.choices[0].finish_reason in ("stop", "length") and base.usage.completion_tokens >= 1

    entry = srv.register("ft", variant_dirs["ft"][0], kind="delta")
    assert entry["name"] == "ft" and entry["footprint"]["kind"] == "delta"
    ids = [m.id for m in client.models.list().data]
    assert ids == [model, f"{model}:sql", f"{model}:ft"]
    ft = client.completions.create(model="ft", prompt="hello world", max_tokens=5, temperature=0)
    assert ft.choices[0].text != base.choices[0].text
    with pytest.raises(ValueError, match="already taken"):
        srv.register("ft", variant_dirs["ft"][0])
    assert srv.unregister("ft")["name"] == "ft"
    assert "ft" not in [m.id.split(":")[-1] for m in client.models.list().data]

    metrics = srv.metrics()
    assert metrics["deltaserve_requests_finished_total"] == 2
    assert metrics["deltaserve_adapters_registered"] == 1
    assert srv.metrics_text().startswith("# HELP")
    client.close()


def test_keyboard_interrupt_in_the_with_block_stops_every_worker(served):
    srv, workers = served
    url = srv.url
    with pytest.raises(KeyboardInterrupt), srv:
        raise KeyboardInterrupt
    assert not srv.running and not (workers & child_pids()), "a worker outlived the with block"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
    with pytest.raises(RuntimeError, match="stopped"):
        srv.metrics()
    srv.stop()  # idempotent


def test_bad_flags_raise_value_error_naming_them(tiny_llama):
    with pytest.raises(ValueError, match="--no-such-flag"):
        deltaserve.Server(tiny_llama, no_such_flag=1)
    with pytest.raises(RuntimeError, match="--model"):
        deltaserve.Server(tiny_llama / "missing")
