"""The hermes tool-call parser on fixed texts, whole and streamed in pieces."""

from __future__ import annotations

import json

import pytest
from prefixserve.api.tool_parsers import HermesStreamParser, parse_tool_calls

ONE = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = (
    '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
    '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>'
)


def test_one_call_with_content():
    content, calls = parse_tool_calls(ONE)
    assert content == "Let me check."
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_") and calls[0].type == "function"


def test_two_calls_and_string_arguments():
    content, calls = parse_tool_calls(TWO)
    assert content is None
    assert [c.function.name for c in calls] == ["a", "b"]
    assert json.loads(calls[1].function.arguments) == {"y": [1, 2]}


@pytest.mark.parametrize(
    "text",
    [
        "no tools here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
    ],
)
def test_not_calls_stay_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_unclosed_call_at_the_end():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert content is None and calls[0].function.name == "f"


def _stream(text: str, size: int) -> tuple[str, list]:
    parser, content, calls = HermesStreamParser(), "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        c, new = parser.feed(piece, final=k == len(pieces) - 1)
        content += c
        calls += new
    return content, calls


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", [ONE, TWO, "plain <tool text with < signs", "ends with <tool_ca"])
def test_streaming_matches_whole(text, size):
    content, calls = _stream(text, size)
    whole_content, whole_calls = parse_tool_calls(text)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole_calls
    ]
    assert content.strip() == (whole_content or "").strip()


def test_stream_holds_back_a_partial_tag():
    parser = HermesStreamParser()
    assert parser.feed("hello <tool") == ("hello ", [])
    content, calls = parser.feed('_call>{"name": "f", "arguments": {"k": 2}}</tool_call>')
    assert content == "" and calls[0].function.name == "f"
