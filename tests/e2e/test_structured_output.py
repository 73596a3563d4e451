"""Structured output and tools through the daemon (tiny random Llama, CPU), with the official
`openai` client: the grammar, not the model, makes a random model's answer parse and validate
against the JSON schema; a required or named tool call comes back as a parsed `tool_calls` entry
(streamed as OpenAI's deltas too); constrained and unconstrained requests share a batch without
changing the unconstrained ones; bad formats, tools and tool choices are 400s naming the field,
and a schema only the worker can refuse is a 400 too while the daemon serves on."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.json_schemas import PERSON

from .wsclient import ws_generate

pytestmark = pytest.mark.gpu_e2e  # `make test-gpu-e2e` also runs it on a GPU (masks on the CUDA sampler)

PROMPT = "once upon a time there was a small model that"
SCHEMA = PERSON
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(url: str):
    openai = pytest.importorskip("openai")  # a test extra; the GPU machine has none
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused")


def valid_person(value: dict) -> None:
    assert set(value) == {"name", "age", "pet"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 2
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99
    assert value["pet"] in ("cat", "dog")


def valid_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"} and value["city"] in ("Paris", "Oslo"), value
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7


@pytest.fixture(scope="module")
def model(tiny_daemon) -> str:
    return httpx.get(f"{tiny_daemon.url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_json_schema_answers_parse_and_validate_in_both_endpoints(tiny_daemon, tiny_llama, model):
    oa = client(tiny_daemon.url)
    chat = oa.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=60, response_format=RESPONSE_FORMAT
    )
    assert chat.choices[0].finish_reason == "stop"
    valid_person(json.loads(chat.choices[0].message.content))
    seeded = oa.completions.create(
        model=model,
        prompt=PROMPT,
        temperature=1.0,
        seed=3,
        max_tokens=60,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    assert seeded.choices[0].finish_reason == "stop"
    valid_person(json.loads(seeded.choices[0].text))
    # json_object: any object; a bias towards `}` makes the random model close it at once.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    close = tok.token_to_id("}")
    obj = oa.completions.create(
        model=model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=20,
        logit_bias={str(close): 50},
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert json.loads(obj.choices[0].text) == {} and obj.choices[0].finish_reason == "stop"


def test_constrained_and_unconstrained_requests_share_a_batch(tiny_daemon):
    plain = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    alone = ws_generate(tiny_daemon.url, {"plain": plain})["plain"]
    got = ws_generate(
        tiny_daemon.url,
        {
            "plain": plain,
            "json": {**plain, "max_tokens": 60, "ignore_eos": False, "response_format": RESPONSE_FORMAT},
            "plain2": plain,
        },
    )
    assert all(r["error"] is None for r in got.values()), got
    assert got["plain"]["token_ids"] == alone["token_ids"] == got["plain2"]["token_ids"]
    valid_person(json.loads(got["json"]["text"]))


def test_required_and_named_tool_calls_stream_and_not(tiny_daemon, model):
    oa = client(tiny_daemon.url)
    ask = dict(model=model, messages=MESSAGES, tools=[WEATHER, NOOP], temperature=0, max_tokens=60)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = oa.chat.completions.create(**ask, tool_choice=named)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call")
    valid_weather(call.function.arguments)
    named_arguments = call.function.arguments

    r = oa.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "noop")
    if call.function.name == "get_weather":
        valid_weather(call.function.arguments)
    else:
        assert json.loads(call.function.arguments) == {}

    for choice_ in (named, "required"):
        calls: dict[int, dict] = {}
        finish = None
        stream = oa.chat.completions.create(**ask, tool_choice=choice_, parallel_tool_calls=False, stream=True)
        for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    entry["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and calls, calls
        assert calls[0]["id"] and calls[0]["name"] in ("get_weather", "noop")
        if choice_ is named:  # greedy: the streamed arguments are the non-streamed ones
            assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == named_arguments


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_formats_and_tools_are_400s_naming_the_field(tiny_daemon, fields, param):
    body = {"messages": MESSAGES, "max_tokens": 4, **fields}
    r = httpx.post(f"{tiny_daemon.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_schema_the_worker_refuses_is_a_400_and_the_daemon_serves_on(tiny_daemon):
    broken = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}
    for stream in (False, True):
        body = {"prompt": PROMPT, "max_tokens": 4, "response_format": broken, "stream": stream}
        r = httpx.post(f"{tiny_daemon.url}/v1/completions", json=body, timeout=60)
        if not stream:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "response_format" and "nowhere" in r.text
        else:
            assert "nowhere" in r.text and "response_format" in r.text, r.text
    ok = httpx.post(f"{tiny_daemon.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_tools_are_refused_over_the_websocket_which_carries_tokens(tiny_daemon):
    got = ws_generate(tiny_daemon.url, {"t": {"messages": MESSAGES, "max_tokens": 4, "tools": [WEATHER]}})["t"]
    assert got["error"]["error"]["param"] == "request.tools", got
