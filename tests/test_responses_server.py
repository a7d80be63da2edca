"""/v1/responses end to end: a real ``prefixserve serve`` and the official clients, unchanged
(the openai SDK's ``responses`` API, the OpenAI Agents SDK's default Responses model)."""

from __future__ import annotations

import asyncio
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from servers import MODEL, launch_server, metric, scrape

BLOCK = 16  # the server's default block size
MAX_ENTRIES = 12
WEATHER = [{"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}]  # fmt: skip


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server():
    with launch_server("--tool-call-parser", "hermes", "--responses-store-max-entries",
                       str(MAX_ENTRIES)) as base:  # fmt: skip
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def continuations(server: str) -> dict[str, float]:
    samples = scrape(server)
    return {kind: metric(samples, "prefixserve_responses_continuations_total", kind=kind)
            for kind in ("token_exact", "rerendered")}  # fmt: skip


def test_string_and_item_input_give_the_same_response(client):
    common = dict(model=MODEL, max_output_tokens=8, temperature=0)
    a = client.responses.create(input="Tell me about prefix caching.", **common)
    b = client.responses.create(input=[{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Tell me about prefix caching."}]}], **common)  # fmt: skip
    assert a.id.startswith("resp_") and a.object == "response" and a.id != b.id
    assert a.status == "incomplete" and a.incomplete_details.reason == "max_output_tokens"
    assert a.output_text == b.output_text and a.output[0].type == "message"
    assert a.usage.output_tokens == 8 and a.usage.input_tokens == b.usage.input_tokens
    assert a.usage.total_tokens == a.usage.input_tokens + 8
    assert a.usage.output_tokens_details.reasoning_tokens == 0
    assert b.usage.input_tokens_details.cached_tokens >= BLOCK  # b reused a's prompt blocks


def test_stream_sends_typed_events_in_order(client):
    common = dict(model=MODEL, input="Hello", max_output_tokens=6, temperature=0)
    full = client.responses.create(**common)
    events = list(client.responses.create(stream=True, **common))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == full.output_text
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.output[0].id == events[2].item.id


def test_forced_tool_call_then_token_exact_continuation(server, client):
    before = continuations(server)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=WEATHER,
                                    tool_choice="required", temperature=0)  # fmt: skip
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.arguments in ('{"city": "Paris"}',
                                                                   '{"city": "Oslo"}')
    tail_tokens = metric(scrape(server), "prefixserve_prefix_cache_tail_hit_tokens_total")
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=WEATHER, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    after = continuations(server)
    assert after["token_exact"] == before["token_exact"] + 1
    assert after["rerendered"] == before["rerendered"]
    # every token of the previous prompt and output is hit but the last (never run): the full
    # blocks and the partial tail after them
    previous = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens == previous
    tail_after = metric(scrape(server), "prefixserve_prefix_cache_tail_hit_tokens_total")
    assert tail_after - tail_tokens == previous % BLOCK
    assert second.previous_response_id == first.id


def test_streamed_forced_call_arguments(client):
    with client.responses.stream(model=MODEL, input="Weather?", tools=WEATHER,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == final.output[0].arguments and done.name == "get_weather"
    assert events[-1].type == "response.completed"


def test_parse_with_a_pydantic_model(client):
    parsed = client.responses.parse(model=MODEL, input="Invent a person.", text_format=Person)
    assert isinstance(parsed.output_parsed, Person)


def test_retrieve_input_items_delete(client):
    created = client.responses.create(
        model=MODEL, instructions="Be brief.", max_output_tokens=4, metadata={"k": "v"},
        input=[{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
               {"role": "user", "content": "three"}],
    )  # fmt: skip
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump() and got.metadata == {"k": "v"}
    page = client.responses.input_items.list(created.id)
    texts = [item.content[0].text for item in page.data]
    assert texts == ["three", "two", "one"]  # newest first, OpenAI's default
    asc = client.responses.input_items.list(created.id, order="asc", limit=2)
    assert [i.content[0].text for i in asc.data] == ["one", "two"] and asc.has_more
    assert client.responses.delete(created.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=created.id)
    assert err.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_store_is_isolated_per_tenant(server):
    def create(key: str, salt: str, **extra) -> httpx.Response:
        return httpx.post(f"{server}/v1/responses", headers={"Authorization": f"Bearer {key}"},
                          json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                "cache_salt": salt, **extra}, timeout=60)  # fmt: skip

    rid = create("alice", "a").json()["id"]
    get = f"{server}/v1/responses/{rid}"
    assert httpx.get(get, params={"cache_salt": "a"},
                     headers={"Authorization": "Bearer alice"}).status_code == 200
    for key, salt in (("bob", "a"), ("alice", "b"), ("alice", "")):
        assert httpx.get(get, params={"cache_salt": salt},
                         headers={"Authorization": f"Bearer {key}"}).status_code == 404
        assert create(key, salt, previous_response_id=rid).status_code == 404
        assert httpx.delete(get, params={"cache_salt": salt},
                            headers={"Authorization": f"Bearer {key}"}).status_code == 404
    assert create("alice", "a", previous_response_id=rid).status_code == 200


def test_evicted_response_is_a_404(client):
    first = client.responses.create(model=MODEL, input="first", max_output_tokens=1)
    for _ in range(MAX_ENTRIES):
        client.responses.create(model=MODEL, input="later", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(first.id)
    assert err.value.body["type"] == "NotFoundError" and first.id in err.value.body["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "extreme", "summary": "auto"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tools": [{"type": "local_shell"}]}, "tools"),
        ({"tools": [{"type": "custom", "name": "x", "format": {"type": "regex"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"input": [{"type": "input_image"}]}, "input"),
        ({"model": "other"}, "model"),
        ({"input": []}, "input"),
        ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata"),
    ],
)
def test_refusals_name_the_field(server, extra, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_multi_turn_chain(client):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="one",
                                max_output_tokens=5, temperature=0)  # fmt: skip
    for text in ("two", "three"):
        prev = r
        r = client.responses.create(model=MODEL, instructions="Be brief.", input=text,
                                    previous_response_id=prev.id, max_output_tokens=5,
                                    temperature=0)  # fmt: skip
        assert r.usage.input_tokens > prev.usage.input_tokens + prev.usage.output_tokens
        assert r.usage.input_tokens_details.cached_tokens >= BLOCK
    items = client.responses.input_items.list(r.id, order="asc").data
    assert [i.type for i in items] == ["message"] * 5  # one, reply, two, reply, three


def test_openai_agents_sdk_tools_and_output_type(server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace export: the machine is offline
    calls: list[str] = []

    @function_tool
    def lookup_age(name: Literal["Ada", "Bob"]) -> int:
        """The age of a person."""
        calls.append("lookup_age")
        return 42

    @function_tool
    def lookup_city(name: Literal["Ada", "Bob"]) -> str:
        """Where a person lives."""
        calls.append("lookup_city")
        return "Paris"

    model = OpenAIResponsesModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")
    )
    agent = Agent(name="people", instructions="Find the person.", model=model,
                  tools=[lookup_age, lookup_city], output_type=Person,
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=200))  # fmt: skip
    result = asyncio.run(Runner.run(agent, "Who is Ada?", max_turns=4))
    assert isinstance(result.final_output, Person)
    assert calls  # a first turn called a tool, a later one answered


def test_namespace_tool_call_names_its_namespace_and_reasoning_summary_is_accepted(client):
    grouped = [{"type": "namespace", "name": "weather", "description": "Weather tools.",
                "tools": WEATHER}]  # fmt: skip
    r = client.responses.create(model=MODEL, input="Weather?", tools=grouped,
                                tool_choice="required", reasoning={"summary": "auto"},
                                temperature=0)  # fmt: skip
    (call,) = r.output
    assert call.name == "get_weather" and call.namespace == "weather"
    assert r.reasoning.summary == "auto" and r.usage.output_tokens_details.reasoning_tokens == 0


def test_logprobs_on_output_text(client):
    common = dict(model=MODEL, input="Hello", max_output_tokens=4, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])  # fmt: skip
    r = client.responses.create(**common)
    part = r.output[0].content[0]
    assert len(part.logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text
    events = list(client.responses.create(stream=True, **common))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in part.logprobs])


def test_stats_and_dashboard_card_show_the_responses_figures(server):
    samples = scrape(server)
    stats = httpx.get(f"{server}/stats").json()
    assert stats["responses_store_entries"] == metric(samples, "prefixserve_responses_store_entries")
    assert stats["responses_store_bytes"] == metric(samples, "prefixserve_responses_store_bytes")
    assert stats["responses_continuations_token_exact"] == metric(
        samples, "prefixserve_responses_continuations_total", kind="token_exact")  # fmt: skip
    assert stats["responses_store_evictions"] == metric(
        samples, "prefixserve_responses_store_evictions_total")  # fmt: skip
    page = httpx.get(f"{server}/dashboard").text
    for figure in ("token-exact", "rerendered", "store-entries", "store-bytes", "store-evictions"):
        assert f'id="responses-{figure}"' in page


def test_auto_with_strict_tools_constrains_the_calls(server, client):
    def constrained() -> float:
        return metric(scrape(server), "prefixserve_structured_output_requests_total",
                      kind="tool_calls")  # fmt: skip

    before = constrained()
    loose = [{**WEATHER[0], "strict": False}]
    for tools in (WEATHER, loose):
        r = client.responses.create(model=MODEL, input="Weather?", tools=tools, tool_choice="auto",
                                    max_output_tokens=4, temperature=0)  # fmt: skip
        assert r.tool_choice == "auto" and r.tools[0].strict is tools[0]["strict"]
    assert constrained() == before + 1  # the strict request only


def test_a_warmup_over_http_writes_nothing_and_is_continued_exactly(server, client):
    before = continuations(server)
    warm = client.responses.create(model=MODEL, instructions="You are terse. " * 20, input=[],
                                   extra_body={"generate": False})  # fmt: skip
    assert warm.status == "completed" and warm.output == [] and warm.usage.output_tokens == 0
    r = client.responses.create(model=MODEL, instructions="You are terse. " * 20, input="hi",
                                previous_response_id=warm.id, max_output_tokens=2)  # fmt: skip
    assert r.usage.input_tokens_details.cached_tokens >= warm.usage.input_tokens // BLOCK * BLOCK
    assert continuations(server)["token_exact"] == before["token_exact"] + 1


def test_truncation_auto_drops_the_oldest_turns(server, client):
    """A conversation over the context (1024 here) is refused, or with ``truncation: "auto"``
    loses its oldest whole turns; the response keeps the items it rendered, so the next
    continuation that fits is token-exact again."""
    turns = []
    for k in range(4):
        turns += [{"role": "user", "content": f"question {k}: " + "lorem ipsum " * 16},
                  {"role": "assistant", "content": f"answer {k}: " + "dolor sit " * 16}]  # fmt: skip
    turns.append({"role": "user", "content": "last question"})
    body = dict(model=MODEL, input=turns, max_output_tokens=8, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**body)
    before = httpx.get(f"{server}/stats").json()
    first = client.responses.create(truncation="auto", **body)
    assert first.truncation == "auto" and first.usage.input_tokens + 8 <= 1024
    items = client.responses.input_items.list(first.id, order="asc", limit=100).data
    texts = [item.content[0].text for item in items]
    assert 0 < len(texts) < len(turns) and items[0].role == "user"
    assert texts == [t["content"] for t in turns[-len(texts) :]]
    assert len(texts) == len(turns) - 2  # only the first turn had to go
    more = client.responses.create(model=MODEL, previous_response_id=first.id, truncation="auto",
                                   input="next: " + "lorem ipsum " * 30, max_output_tokens=8,
                                   temperature=0)  # fmt: skip
    assert more.usage.input_tokens + 8 <= 1024
    last = client.responses.create(model=MODEL, previous_response_id=more.id, truncation="auto",
                                   input="ok?", max_output_tokens=4, temperature=0)  # fmt: skip
    after = httpx.get(f"{server}/stats").json()
    assert after["responses_truncations"] == before["responses_truncations"] + 2
    for kind in ("truncated", "token_exact"):  # more was cut; last, which fits, spliced
        key = f"responses_continuations_{kind}"
        assert after[key] == before[key] + 1
    previous = more.usage.input_tokens + more.usage.output_tokens - 1
    assert last.usage.input_tokens_details.cached_tokens >= previous // BLOCK * BLOCK
