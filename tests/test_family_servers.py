"""Each family end to end: a real ``prefixserve serve`` of a tiny random checkpoint whose
tokenizer carries the family's real chat template (``tests/families.py``), with that family's
``--tool-call-parser`` (and ``--reasoning-parser``), driven by the official ``openai`` client.

Checked per family: a forced call comes back as ``tool_calls`` in the family's syntax, streamed
and not the same for the same seed; and the next turn, rendered by the family's template, hits the
prefix cache through the call (every full block of the tokens the two turns share). Mistral's
9-character call id is free text: the random model may split it into other tokens than the
tokenizer would, so there the shared tokens may stop inside the id."""

from __future__ import annotations

import json

import openai
import pytest
from families import FIXED, PICK, TOOL_FAMILIES, USER_TEXT, family_server

BLOCK = 16
TOOLS = [
    {"type": "function", "function": {"name": "pick", "parameters": PICK}},
    {"type": "function", "function": {"name": "fixed", "parameters": FIXED}},
]
USER = [{"role": "user", "content": USER_TEXT}]


@pytest.fixture(scope="module", params=TOOL_FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    with family_server(name, tmp_path_factory.mktemp(name)) as base:
        yield name, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _calls(message_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message_calls]


def _streamed_calls(client, **kwargs) -> list[tuple[str, dict]]:
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content  # forced: nothing but the calls
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forced_calls_stream_as_they_return(family, seed):
    _, client = family
    kwargs = dict(model="m", messages=USER, tools=TOOLS[:1], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = _calls(whole.message.tool_calls)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert len(calls) == 1 and calls[0][0] == "pick"
    assert calls[0][1]["n"] in (1, 2, 3) and isinstance(calls[0][1]["exact"], bool)
    assert _streamed_calls(client, **kwargs) == calls


def test_the_next_turn_hits_the_cache_through_a_forced_call(family):
    name, client = family
    first = client.chat.completions.create(
        model="m", messages=USER, tools=TOOLS, max_tokens=120, temperature=1.0, seed=5,
        tool_choice={"type": "function", "function": {"name": "fixed"}},
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = first.choices[0]
    call = choice.message.tool_calls[0]
    assert _calls([call]) == [("fixed", {"unit": 7})]
    turn1 = first.prompt_token_ids + choice.token_ids
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "done"}]  # fmt: skip
    second = client.chat.completions.create(
        model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=1,
        temperature=0.0, extra_body={"return_token_ids": True},
    )  # fmt: skip
    shared = 0
    for a, b in zip(turn1, second.prompt_token_ids):
        if a != b:
            break
        shared += 1
    if name == "mistral":  # the generated id is free text: up to it the tokens are the same
        assert shared >= len(turn1) - 8
    else:  # the whole call, and the EOS the template writes after it
        assert shared == len(turn1)
    computed = min(shared, len(turn1) - 1)  # the last sampled token never had its KV computed
    assert second.usage.prompt_tokens_details.cached_tokens >= computed // BLOCK * BLOCK
