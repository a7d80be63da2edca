"""Responses items -> chat messages, and which tools are accepted."""

from __future__ import annotations

import pytest

from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.openai.responses.items import normalize_input, to_messages


def test_string_input_is_one_user_message_with_an_id():
    (item,) = normalize_input("hi")
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "hi"}]
    assert to_messages([item]) == [{"role": "user", "content": "hi"}]


def test_items_become_messages_calls_join_the_assistant_turn():
    items = normalize_input([
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": "weather?", "id": "msg_mine"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ])  # fmt: skip
    assert items[1]["id"] == "msg_mine"
    assert to_messages(items) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "think",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}},
         ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ([{"type": "item_reference", "id": "x"}], "item_reference"),
        ([{"role": "tool", "content": "x"}], "role"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "text only"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "call_id"),
        ([{"type": "function_call_output", "call_id": "c"}], "output"),
        (["hi"], "object"),
    ],
)
def test_bad_items_are_refused_by_index(raw, match):
    with pytest.raises(APIError, match=match) as err:
        normalize_input(raw)
    assert err.value.status == 400 and err.value.param == "input"
    assert "input[0]" in err.value.message


def test_reasoning_that_nothing_follows_is_an_assistant_turn_of_its_own():
    """An output that only reasoned (cut off inside its reasoning) stays in its own turn when
    the conversation goes on, instead of moving into a later assistant message."""
    items = normalize_input([
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"role": "user", "content": "well?"},
        {"role": "assistant", "content": "yes"},
    ])  # fmt: skip
    assert to_messages(items) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm"},
        {"role": "user", "content": "well?"},
        {"role": "assistant", "content": "yes"},
    ]
