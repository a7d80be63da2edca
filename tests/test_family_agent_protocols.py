"""Responses and Messages in each family's tool-call syntax, end to end: a real ``prefixserve
serve`` of a tiny random checkpoint carrying the family's real chat template
(``tests/families.py``) with that family's ``--tool-call-parser``, driven by the official
``openai`` and ``anthropic`` clients.

Checked per family: a forced call comes back as a ``function_call`` item (Responses) or a
``tool_use`` block (Messages), streamed and not the same for the same seed; and a Responses
continuation through a forced call is spliced token-exact and hits the cache for every full block
of the previous prompt and output."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from families import FIXED, PICK, TOOL_FAMILIES, USER_TEXT, family_server

BLOCK = 16
TOOLS = [
    {"type": "function", "name": "pick", "parameters": PICK},
    {"type": "function", "name": "fixed", "parameters": FIXED},
]
USER = USER_TEXT


@pytest.fixture(scope="module", params=TOOL_FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    with family_server(name, tmp_path_factory.mktemp(name)) as base:
        yield name, base


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("seed", [1, 2])
def test_responses_forced_calls_stream_as_they_return(family, seed):
    _, base = family
    client = _openai(base)
    kwargs = dict(model="m", input=USER, tools=TOOLS[:1], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=120, temperature=1.0,
                  extra_body={"seed": seed})  # fmt: skip
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed" and [i.type for i in whole.output] == ["function_call"]
    call = whole.output[0]
    args = json.loads(call.arguments)
    assert call.name == "pick" and args["n"] in (1, 2, 3) and isinstance(args["exact"], bool)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    streamed = final.output[0]
    assert [i.type for i in final.output] == ["function_call"]
    assert (streamed.name, json.loads(streamed.arguments)) == ("pick", args)
    assert deltas == streamed.arguments


def test_responses_continue_token_exact_through_a_forced_call(family):
    name, base = family
    client = _openai(base)
    before = httpx.get(f"{base}/stats").json()
    first = client.responses.create(
        model="m", input=USER, tools=TOOLS, tool_choice={"type": "function", "name": "fixed"},
        max_output_tokens=120, temperature=1.0, extra_body={"seed": 5},
    )  # fmt: skip
    (call,) = first.output
    assert (call.name, json.loads(call.arguments)) == ("fixed", {"unit": 7})
    if name == "mistral":  # the id the model wrote, the only form Mistral's template renders
        assert len(call.call_id) == 9 and call.call_id.isalnum()
    second = client.responses.create(
        model="m", previous_response_id=first.id, tools=TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "done"}],
        max_output_tokens=1, temperature=0.0,
    )  # fmt: skip
    after = httpx.get(f"{base}/stats").json()
    exact = "responses_continuations_token_exact"
    assert after[exact] == before[exact] + 1
    previous = first.usage.input_tokens + first.usage.output_tokens - 1  # last token: no KV
    assert second.usage.input_tokens_details.cached_tokens >= previous // BLOCK * BLOCK


@pytest.mark.parametrize("seed", [1, 2])
def test_messages_forced_tool_use_streamed_and_not(family, seed):
    _, base = family
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    tools = [{"name": t["name"], "input_schema": t["parameters"]} for t in TOOLS]
    kwargs = dict(model="m", max_tokens=120, tools=tools,
                  messages=[{"role": "user", "content": USER}],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  extra_body={"seed": seed})  # fmt: skip
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    block = whole.content[0]
    assert block.name in ("pick", "fixed") and block.id
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert (final.content[0].name, final.content[0].input) == (block.name, block.input)
