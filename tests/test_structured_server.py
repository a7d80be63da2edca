"""Structured outputs and forced tool calls over HTTP, with the official ``openai`` client against
a real ``prefixserve serve`` (built-in random-weight model, temperature 1, several seeds)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from servers import MODEL, launch_server, metric, scrape
from tool_schemas import ADD, city_schema, weather_and_add_tools

CITY = city_schema(8)
TOOLS = weather_and_add_tools(CITY)
SCHEMAS = {"get_weather": CITY, "add": ADD}
USER = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def server():
    with launch_server() as base:  # no --tool-call-parser: forced calls need none
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_response_format_json_schema_streamed_and_not(client):
    for seed in (0, 1, 2):
        kw = dict(model=MODEL, messages=USER, max_tokens=120, temperature=1.0, seed=seed)
        full = client.chat.completions.create(response_format=_json_schema(CITY), n=2, **kw)
        for choice in full.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), CITY)
        stream = client.chat.completions.create(
            response_format=_json_schema(CITY), stream=True, **kw
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == full.choices[0].message.content  # seeded: sample 0 is the same


def test_json_object_and_vllm_fields(client, server):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, temperature=1.0, seed=1, n=4,
        response_format={"type": "json_object"},
    )  # fmt: skip
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(c.message.content), dict) for c in done)
    assert all(c.message.content.startswith("{") for c in r.choices)  # any key: may run long
    cases = [
        ({"structured_outputs": {"regex": "[a-d]{3}-[0-9]{2}"}}, r"[a-d]{3}-[0-9]{2}"),
        ({"structured_outputs": {"choice": ["red", "green"]}}, r"red|green"),
        ({"guided_regex": "x+y"}, r"x+y"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
        ({"structured_outputs": {"grammar": 'root ::= "<" [a-c]+ ">"'}}, r"<[a-c]+>"),
    ]
    for body, pattern in cases:
        for endpoint, extra in (("completions", {"prompt": "Say: "}), ("chat/completions",
                                {"messages": USER})):  # fmt: skip
            out = httpx.post(f"{server}/v1/{endpoint}", json={
                "model": MODEL, "max_tokens": 60, "temperature": 1.0, "seed": 4, "n": 3,
                **extra, **body,
            }, timeout=60).json()  # fmt: skip
            for choice in out["choices"]:
                text = choice["text"] if "text" in choice else choice["message"]["content"]
                assert re.fullmatch(pattern, text), (body, text)
    r = client.completions.create(model=MODEL, prompt="JSON: ", max_tokens=120, temperature=1.0,
                                  extra_body={"guided_json": CITY})  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), CITY)


def _check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_always_calls(client, seed):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=seed,
    )  # fmt: skip
    choice = r.choices[0]
    _check_calls(choice.message.tool_calls, {"get_weather", "add"})
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    one = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=seed, parallel_tool_calls=False,
    )  # fmt: skip
    assert len(one.choices[0].message.tool_calls) == 1


def test_named_tool_choice_streams_name_then_arguments(client):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, temperature=1.0, seed=5,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    full = client.chat.completions.create(**kw)
    _check_calls(full.choices[0].message.tool_calls, {"get_weather"})
    assert len(full.choices[0].message.tool_calls) == 1
    assert full.choices[0].finish_reason == "stop"  # as OpenAI ends a named call
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw)
              if c.choices]  # fmt: skip
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    assert parts[0].function.name == "get_weather" and parts[0].id
    assert all(p.function.name is None for p in parts[1:])
    arguments = "".join(p.function.arguments or "" for p in parts)
    assert arguments == full.choices[0].message.tool_calls[0].function.arguments


def test_forced_call_lets_the_next_turn_hit_the_cache(client):
    first = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=11, parallel_tool_calls=False,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4,
        temperature=0.0,
    )  # fmt: skip
    turn1 = first.usage.prompt_tokens + first.usage.completion_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16  # the cache reaches the first turn
    assert cached <= turn1


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        (
            {"response_format": _json_schema({"type": "object", "properties": {"a": {"type": 7}}})},
            "response_format",
            "JSON schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regular"),
        (
            {"structured_outputs": {"grammar": "root ::= missing_rule"}},
            "structured_outputs",
            "missing_rule",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "unknown field"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "not several",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "not supported"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined",
        ),
    ],
)
def test_bad_constraints_are_400s_that_say_what_to_change(server, body, param, says):
    r = httpx.post(f"{server}/v1/chat/completions",
                   json={"model": MODEL, "messages": USER, "max_tokens": 4, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert httpx.get(f"{server}/health").status_code == 200


def test_metrics_count_kinds_and_compiles(server, client):
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40,
                                   extra_body={"guided_choice": ["a", "b"]})  # fmt: skip
    samples = scrape(server)
    assert metric(samples, "prefixserve_structured_output_requests_total", kind="choice") >= 1
    assert metric(samples, "prefixserve_structured_output_requests_total", kind="tool_calls") >= 1
    assert metric(samples, "prefixserve_grammar_compile_seconds_count") >= 3
    assert metric(samples, "prefixserve_grammar_compiles_total") >= 3
    assert metric(samples, "prefixserve_grammar_cache_hits_total") >= 1


def test_each_request_looks_its_grammar_up_once(server, client):
    """The grammar is compiled (or found compiled) once per request, when it is prepared:
    two requests with a new schema are one compile and one cache hit."""
    schema = {"type": "object", "properties": {"once": {"type": "integer"}}, "required": ["once"]}
    before = scrape(server)
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20,
                                       response_format=_json_schema(schema))  # fmt: skip
    after = scrape(server)

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert grew("prefixserve_grammar_compiles_total") == 1
    assert grew("prefixserve_grammar_cache_hits_total") == 1
