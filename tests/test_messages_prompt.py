"""Anthropic Messages requests -> the chat prompt the template renders (``api/anthropic/prompt.py``):
each block and field maps as documented, refused ones are 400s, and the attribution rule drops
only its exact shape."""

from __future__ import annotations

import pytest

from prefixserve.api.anthropic.prompt import is_attribution_block, to_chat_prompt
from prefixserve.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from prefixserve.api.frontend.protocol import APIError, ToolRequest

ATTRIBUTION = "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli;"
TOOL = {"name": "Bash", "description": "run", "input_schema": {"type": "object"}}


def chat(drop: bool = True, parser: bool = True, **fields):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return to_chat_prompt(MessagesRequest(**{**body, **fields}), drop, parser)


@pytest.mark.parametrize(
    "text, expected",
    [
        (ATTRIBUTION, True),
        ("x-anthropic-billing-header: cc_version=2.1.37.fff; cc_entrypoint=cli; cch=00000;", True),
        (ATTRIBUTION + " ", False),  # exact shape only
        ("Note: " + ATTRIBUTION, False),
        (ATTRIBUTION + "\nYou are Claude Code.", False),  # never a block with more text in it
        ("x-anthropic-billing-header: cc_entrypoint=cli;", False),
    ],
)
def test_attribution_shape(text, expected):
    assert is_attribution_block({"type": "text", "text": text}) is expected


def test_attribution_dropped_only_as_first_system_block():
    system = [{"type": "text", "text": ATTRIBUTION}, {"type": "text", "text": "You are helpful."}]
    on = chat(system=system).messages[0]
    assert on == {"role": "system", "content": [{"type": "text", "text": "You are helpful."}]}
    off = chat(drop=False, system=system).messages[0]
    assert [p["text"] for p in off["content"]] == [ATTRIBUTION, "You are helpful."]
    later = chat(system=[system[1], system[0]]).messages[0]
    assert [p["text"] for p in later["content"]] == ["You are helpful.", ATTRIBUTION]
    only = chat(system=[system[0]]).messages  # nothing left: no system message at all
    assert only == [{"role": "user", "content": "hi"}]


def test_blocks_map_to_chat_messages():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "list files", "cache_control": {}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use ls", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Running it."},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls", "n": 1}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "boom"}]},
            {"type": "text", "text": "and now?"},
        ]},
        {"role": "system", "content": "# Environment"},
    ]  # fmt: skip
    req = chat(system="Be brief.", messages=messages, tools=[TOOL])
    assert req.messages == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "list files"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Running it."}],
         "reasoning_content": "use ls",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "Bash", "arguments": '{"command": "ls", "n": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
        {"role": "system", "content": "# Environment"},
    ]  # fmt: skip
    assert req.add_generation_prompt and not req.continue_final_message


def test_a_final_assistant_message_is_a_prefill():
    req = chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{"}])
    assert req.continue_final_message and not req.add_generation_prompt


def test_tools_and_tool_choice():
    tool = {**TOOL, "cache_control": {"type": "ephemeral"}, "defer_loading": True}
    functions = [{"type": "function", "function": {"name": "Bash", "description": "run",
                                                   "parameters": {"type": "object"}}}]  # fmt: skip
    assert chat(tools=[tool]).tools == ToolRequest(functions, "auto")
    assert chat(tools=[tool], parser=False).tools.choice == "none"  # shown, calls not parsed
    forced = chat(tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert (forced.tools.choice, forced.tools.parallel) == ("required", False)
    named = chat(tools=[tool], tool_choice={"type": "tool", "name": "Bash"})
    assert (named.tools.choice, named.tools.name) == ("named", "Bash")
    one = chat(tools=[tool], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert (one.tools.choice, one.tools.parallel) == ("auto", False)
    assert chat(tools=[tool], tool_choice={"type": "none"}).tools.choice == "none"
    assert chat().tools == ToolRequest()


def test_sampling_and_config_fields():
    fields = dict(stop_sequences=["END"], temperature=0.2, top_p=0.9, top_k=5, stream=True,
                  metadata={"user_id": "u"}, output_config={"effort": "high"},
                  context_management={"edits": [{"type": "clear_thinking_20251015"}]})  # fmt: skip
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    options = MessagesRequest(**body, **fields).sampling_options().params
    assert (options.stop, options.temperature, options.top_p, options.top_k) == (
        ["END"], 0.2, 0.9, 5)  # fmt: skip
    req = chat(**fields)
    assert req.structured is None and req.chat_template_kwargs is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    structured = chat(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert structured.structured.json == schema
    assert chat(thinking={"type": "adaptive"}).chat_template_kwargs == {"enable_thinking": True}
    assert chat(thinking={"type": "disabled"}).chat_template_kwargs == {"enable_thinking": False}
    enabled = chat(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 1024})
    assert enabled.chat_template_kwargs == {"enable_thinking": True}


def test_count_tokens_request_renders_the_same_prompt():
    req = to_chat_prompt(
        CountTokensRequest(model="m", messages=[{"role": "user", "content": "hi"}]), True, True
    )
    assert req.messages == [{"role": "user", "content": "hi"}] and req.add_generation_prompt


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
          "content": [{"type": "image", "source": {}}]}]}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
          "name": "f", "input": [1]}]}]}, "messages"),
        ({"system": [{"type": "image", "source": {}}]}, "system"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"tools": [{"name": "f"}]}, "tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking"),
        ({"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking"),
        ({"thinking": {"type": "always"}}, "thinking"),
        ({"output_config": {"format": {"type": "regex"}}}, "output_config"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"container": "c1"}, "container"),
    ],
)  # fmt: skip
def test_refused_fields_are_400(fields, param):
    with pytest.raises(APIError) as err:
        chat(**fields)
    assert err.value.status == 400 and err.value.param == param
