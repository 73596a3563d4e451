"""``Client`` and ``AsyncClient`` against a running daemon (tiny model, CPU): typed answers equal
the raw HTTP ones, streams (WebSocket and SSE, sync and async) concatenate to the non-streamed
greedy text, closing a stream cancels its request, variant admin round-trips, metrics parse,
errors carry status, type and message, and the CLI prints what it printed before it used Client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from deltaserve.client import APIConnectionError, APIError, AsyncClient, Client, run
from helpers.peft_adapters import make_peft_adapter

N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


def raw_post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def client(daemon):
    with Client(daemon.url, timeout=120) as c:
        yield c


def test_completion_and_chat_equal_the_raw_http_answer(daemon, client):
    raw = raw_post(daemon.url, "/v1/completions", {"prompt": PROMPT, "logprobs": 2, **GREEDY})
    got = client.completions(PROMPT, logprobs=2, **GREEDY)
    choice = raw["choices"][0]
    assert (got.text, got.finish_reason, got.model) == (choice["text"], "length", raw["model"])
    assert got.usage.__dict__ == raw["usage"] and got.id.startswith("cmpl-") and got.token_ids is None
    assert [t.token for t in got.logprobs] == choice["logprobs"]["tokens"]
    assert [t.logprob for t in got.logprobs] == choice["logprobs"]["token_logprobs"]
    assert [{a.token: a.logprob for a in t.top_logprobs} for t in got.logprobs] == choice["logprobs"]["top_logprobs"]

    raw = raw_post(daemon.url, "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, **GREEDY})
    got = client.chat(MESSAGES, logprobs=True, **GREEDY)
    choice = raw["choices"][0]
    assert (got.text, got.finish_reason, got.usage.__dict__) == (
        choice["message"]["content"], "length", raw["usage"]
    )  # fmt: skip
    assert [(t.token, t.logprob) for t in got.logprobs] == [
        (e["token"], e["logprob"]) for e in choice["logprobs"]["content"]
    ]
    # A string is one user turn; token ids are a prompt too.
    assert client.chat(MESSAGES[0]["content"], **GREEDY).text == got.text
    ids = [5, 6, 7, 8]
    assert (
        client.completions(ids, **GREEDY).text
        == raw_post(daemon.url, "/v1/completions", {"prompt": ids, **GREEDY})["choices"][0]["text"]
    )


def test_streams_concatenate_to_the_greedy_text(daemon, client):
    whole = client.completions(PROMPT, **GREEDY)
    stream = client.stream_completions(PROMPT, **GREEDY)
    events = list(stream)
    assert len(events) == N and all(e.token_id is not None for e in events)  # one event per token
    assert "".join(e.text for e in events) == whole.text
    done = stream.result()
    assert (done.text, done.finish_reason, done.usage) == (whole.text, "length", whole.usage)
    assert done.token_ids == [e.token_id for e in events]

    chat = client.chat(MESSAGES, **GREEDY)
    assert client.stream_chat(MESSAGES, **GREEDY).result().text == chat.text
    with Client(daemon.url, transport="sse") as sse:
        got = sse.stream_completions(PROMPT, **GREEDY).result()
        assert (got.text, got.usage, got.token_ids) == (whole.text, whole.usage, None)
        assert "".join(e.text for e in sse.stream_chat(MESSAGES, **GREEDY)) == chat.text


def test_async_client_streams_concatenate_to_the_greedy_text(daemon, client):
    whole = client.completions(PROMPT, **GREEDY)
    chat = client.chat(MESSAGES, **GREEDY)

    async def main():
        async with AsyncClient(daemon.url, timeout=120) as ac:
            assert (await ac.completions(PROMPT, **GREEDY)).text == whole.text
            assert (await ac.chat(MESSAGES, **GREEDY)).text == chat.text
            # Three generations at once on the client's one socket.
            streams = [ac.stream_completions(PROMPT, **GREEDY) for _ in range(2)] + [ac.stream_chat(MESSAGES, **GREEDY)]
            texts = await asyncio.gather(*(concat(s) for s in streams))
            assert texts == [whole.text, whole.text, chat.text]
            assert (await streams[0].result()).token_ids is not None
        async with AsyncClient(daemon.url, transport="sse") as sse:
            assert await concat(sse.stream_completions(PROMPT, **GREEDY)) == whole.text
            assert (await sse.stream_chat(MESSAGES, **GREEDY).result()).text == chat.text
        return type(asyncio.get_running_loop()).__module__

    loop_module = run(main())
    uvloop_installed = importable("uvloop")
    assert loop_module.startswith("uvloop") == uvloop_installed, loop_module


async def concat(stream) -> str:
    return "".join([e.text async for e in stream])


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


def wait_idle(client: Client) -> dict[str, float]:
    deadline = time.monotonic() + 60
    while True:
        m = client.metrics()
        if m["deltaserve_requests_running"] == 0 and m["deltaserve_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_closing_a_stream_early_cancels_its_request(daemon, client):
    before = wait_idle(client)
    for transport in ("ws", "sse"):
        with Client(daemon.url, transport=transport) as c, c.stream_completions(PROMPT, **LONG) as stream:
            next(stream)

    async def main():
        async with AsyncClient(daemon.url) as ac:
            async with ac.stream_completions(PROMPT, **LONG) as stream:
                await anext(stream)
            # The socket stays open for the next generation.
            assert (await ac.stream_completions(PROMPT, max_tokens=2).result()).usage.completion_tokens == 2

    run(main())
    after = wait_idle(client)
    assert after["deltaserve_requests_aborted_total"] - before["deltaserve_requests_aborted_total"] == 3
    assert after["deltaserve_tokens_generated_total"] - before["deltaserve_tokens_generated_total"] < LONG["max_tokens"]


def test_variant_admin_round_trip(client, tiny_llama, tmp_path):
    _, path = make_peft_adapter(tiny_llama, tmp_path / "sql", seed=3, target_modules=["q_proj", "v_proj"], r=4)
    base = client.models()[0].id
    variant = client.register("sql", path, kind="lora")
    assert (variant.name, variant.model, variant.parent, variant.kind) == ("sql", f"{base}:sql", base, "lora")
    assert variant.status == "active" and variant.max_rank == 4 and variant.path == str(path)
    assert [v.name for v in client.variants()] == ["sql"]
    listed = {m.id: m for m in client.models()}
    assert listed[f"{base}:sql"].parent == base and listed[f"{base}:sql"].kind == "lora"
    served = client.completions(PROMPT, variant="sql", **GREEDY)
    assert served.model == f"{base}:sql"
    assert client.stream_completions(PROMPT, model=base, variant="sql", **GREEDY).result().text == served.text

    with pytest.raises(APIError) as taken:
        client.register("sql", path)
    assert (taken.value.status, taken.value.type) == (409, "conflict_error")
    with pytest.raises(APIError) as wrong_kind:
        client.register("other", path, kind="delta")
    assert wrong_kind.value.status == 400 and "holds a LoRA adapter" in wrong_kind.value.message

    client.unregister("sql")
    assert client.variants() == [] and [m.id for m in client.models()] == [base]
    with pytest.raises(APIError) as gone:
        client.unregister("sql")
    assert (gone.value.status, gone.value.code) == (404, "adapter_not_found")


def test_metrics_parse(daemon, client):
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    metrics = client.metrics()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(metrics) == len(samples) > 10
    assert metrics["deltaserve_requests_finished_total"] >= 1
    assert metrics['deltaserve_api_errors_total{type="not_found_error"}'] >= 0
    assert any(k.startswith("deltaserve_time_to_first_token_seconds_bucket{le=") for k in metrics)


def test_errors_carry_status_type_and_message(daemon, client):
    needle = "The model `nope` does not exist"
    with pytest.raises(APIError) as e:
        client.completions(PROMPT, model="nope")
    assert (e.value.status, e.value.type, e.value.param) == (404, "not_found_error", "model")
    assert needle in e.value.message and needle in str(e.value)
    for transport in ("ws", "sse"):  # inside a stream too, with the status its type has
        with Client(daemon.url, transport=transport) as c, pytest.raises(APIError) as e:
            list(c.stream_chat(MESSAGES, model="nope"))
        assert (e.value.status, e.value.type) == (404, "not_found_error") and needle in e.value.message
    with pytest.raises(APIError) as e:
        client.completions(PROMPT, max_tokens=0)
    assert (e.value.status, e.value.type, e.value.param) == (400, "invalid_request_error", "max_tokens")

    async def main():
        async with AsyncClient(daemon.url) as ac:
            for call in (ac.chat(MESSAGES, model="nope"), ac.stream_completions(PROMPT, model="nope").result()):
                with pytest.raises(APIError) as e:
                    await call
                assert e.value.status == 404 and needle in e.value.message
        async with AsyncClient("http://127.0.0.1:1") as dead:
            assert not await dead.ready()
            with pytest.raises(APIConnectionError):
                await dead.models()

    run(main())
    dead = Client("http://127.0.0.1:1")
    assert not dead.health() and not dead.ready()
    with pytest.raises(APIConnectionError) as e:
        dead.completions(PROMPT)
    assert e.value.status is None and "127.0.0.1:1" in str(e.value)
    assert client.health() and client.ready()
    client.wait_ready(timeout=5)


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve.client", "--url", url, *args], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_cli_prints_what_it_printed(daemon, client):
    model = client.models()[0].id
    out = run_cli(daemon.url, "--wait", "5", "complete", PROMPT, "--max-tokens", "6")
    text = client.completions(PROMPT, max_tokens=6, temperature=0).text
    assert (out.returncode, out.stdout, out.stderr) == (0, f"{PROMPT}{text}\n", "")
    out = run_cli(daemon.url, "chat", "hi", "--max-tokens", "6")
    text = client.chat("hi", max_tokens=6, temperature=0).text
    assert (out.returncode, out.stdout) == (0, f"[{model}] user: hi\n[{model}] assistant: {text}\n"), out.stderr
    out = run_cli(daemon.url, "--model", "nope", "chat", "hi")
    assert out.returncode == 1 and "error: 404 not_found_error: The model `nope` does not exist" in out.stderr
    out = run_cli("http://127.0.0.1:1", "complete", "x")
    assert out.returncode == 1 and out.stderr.startswith("error: no deltaserve daemon answers at http://127.0.0.1:1")


def test_the_official_openai_client_completes_and_streams_chat(daemon, client):
    from openai import OpenAI

    oai = OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    assert model == client.models()[0].id
    extra = {"ignore_eos": True}
    got = oai.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body=extra)
    assert got.choices[0].text == client.completions(PROMPT, **GREEDY).text
    assert (got.choices[0].finish_reason, got.usage.completion_tokens) == ("length", N)
    chunks = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=extra)  # fmt: skip
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == client.chat(MESSAGES, **GREEDY).text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == N
