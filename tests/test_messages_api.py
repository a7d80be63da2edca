"""The Anthropic Messages API end to end: a real ``prefixserve serve`` and the official
``anthropic`` SDK, unchanged (plus raw HTTP where the SDK hides the wire: event order, pings)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import pytest
from servers import MODEL, launch_server

KEY = "sekret"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER,
     "cache_control": {"type": "ephemeral"}},
    {"name": "ping", "description": "Ping a host", "defer_loading": True,
     "input_schema": {"type": "object", "properties": {"host": {"type": "string", "maxLength": 8}},
                      "required": ["host"]}},
]  # fmt: skip
GREEDY = {"temperature": 0}  # this SDK has no temperature argument: it goes in the body


@pytest.fixture(scope="module")
def server():
    with launch_server("--tool-call-parser", "hermes", "--api-key", KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_create_and_stream_agree(client):
    kw = dict(model=MODEL, max_tokens=12, messages=USER, system="Answer briefly.",
              extra_body=GREEDY)  # fmt: skip
    full = client.messages.create(**kw)
    assert full.type == "message" and full.role == "assistant" and full.id.startswith("msg_")
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 12
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == full.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    prompt = lambda u: u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens  # noqa: E731
    assert prompt(final.usage) == prompt(full.usage)
    assert final.usage.cache_read_input_tokens == prompt(full.usage) // 16 * 16  # the same prompt


def test_stream_events_in_anthropic_order(server):
    body = {"model": MODEL, "max_tokens": 5, "messages": USER, "stream": True, **GREEDY}
    r = httpx.post(f"{server}/v1/messages?beta=true", json=body, timeout=60,
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                            "anthropic-beta": "interleaved-thinking-2025-05-14"})  # fmt: skip
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert all(body["type"] == kind for kind, body in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert set(start["usage"]) == {"input_tokens", "output_tokens",
                                   "cache_creation_input_tokens", "cache_read_input_tokens",
                                   "cache_creation"}  # fmt: skip
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5


def test_stop_sequence(client):
    kw = dict(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text
    stop = text[5:8]
    cut = client.messages.create(stop_sequences=[stop], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("seed", [0, 1])
def test_tool_choice_any_and_tool(client, seed):
    kw = dict(model=MODEL, max_tokens=120, messages=USER, tools=TOOLS,
              extra_body={"seed": seed})  # fmt: skip
    r = client.messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    assert r.content[0].name in ("get_weather", "ping")
    with client.messages.stream(tool_choice={"type": "tool", "name": "get_weather"}, **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and len(final.content) == 1
    call = final.content[0]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)
    again = client.messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    assert again.content[0].input == call.input  # streamed and not: the same call


def test_tool_result_round_trip_hits_the_cache(client):
    kw = dict(model=MODEL, tools=TOOLS, extra_body={"seed": 3})
    first = client.messages.create(
        max_tokens=120, messages=USER, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    )
    call = first.content[0]
    history = [*USER, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
                   {"type": "text", "text": "Thanks. Summarize."}]}]  # fmt: skip
    second = client.messages.create(max_tokens=4, messages=history, **kw)
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    u1, u2 = first.usage, second.usage
    prompt1 = u1.input_tokens + u1.cache_creation_input_tokens + u1.cache_read_input_tokens
    # the cache reaches through the first prompt and into the generated call, sent back as input
    assert u2.cache_read_input_tokens > prompt1 // 16 * 16
    assert u2.cache_read_input_tokens <= prompt1 + u1.output_tokens


def test_count_tokens_matches_usage(client):
    kw = dict(model=MODEL, messages=USER, system=[{"type": "text", "text": "Be kind."}],
              tools=TOOLS)  # fmt: skip
    count = client.messages.count_tokens(**kw).input_tokens
    u = client.messages.create(max_tokens=1, **kw).usage
    assert count == u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


def test_models_list_and_retrieve(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).display_name == MODEL
    openai_shape = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert openai_shape.json()["object"] == "list"


def test_errors_are_the_sdks_typed_exceptions(client, server):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=USER
        )
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=1, messages=USER).usage.output_tokens
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=USER)
    assert err.value.body["error"]["type"] == "not_found_error"
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "user", "content": [image]}])  # fmt: skip
    assert "text only" in err.value.message
    r = httpx.post(f"{server}/v1/messages", json={"model": MODEL, "messages": USER},
                   headers={"x-api-key": KEY})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    big = httpx.post(f"{server}/v1/messages", content=b"x" * (5 << 20), headers={"x-api-key": KEY})
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    lost = httpx.get(f"{server}/v1/messages/nowhere", headers={"x-api-key": KEY})
    assert lost.status_code == 404 and lost.json()["type"] == "error"
    assert httpx.post(f"{server}/v1/chat/completions", json={}).json()["error"]["code"] == 401


def test_overloaded_is_529():
    with launch_server("--max-waiting-requests", "1", "--max-num-seqs", "1") as base:
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)

        def call(_: int) -> str:
            try:
                client.messages.create(model=MODEL, max_tokens=8, messages=USER,
                                       extra_body={"ignore_eos": True})  # fmt: skip
                return "ok"
            except anthropic.OverloadedError as exc:
                assert exc.status_code == 529
                assert exc.body["error"]["type"] == "overloaded_error"
                return "overloaded"

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(call, range(12)))
    assert "overloaded" in results and "ok" in results


def test_output_config_format_constrains_the_reply(client):
    r = client.messages.create(
        model=MODEL, max_tokens=80, messages=USER, extra_body={"seed": 0},
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": WEATHER}},
        thinking={"type": "disabled"}, metadata={"user_id": "u1"},
    )  # fmt: skip
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), WEATHER)
