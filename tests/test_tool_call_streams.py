"""``tool_call_streams``: which reader each mode and parser gets, and that Responses output items
and Messages content blocks read every family's calls the same streamed and whole."""

from __future__ import annotations

import json

import pytest
from prefixserve.api.messages_stream import BlockEvents
from prefixserve.api.responses_output import ResponseOutput
from prefixserve.api.tool_call_parsers import ToolCallStream
from prefixserve.api.tool_call_streams import (
    ContentDropped,
    ForcedHermesStream,
    ToolMode,
    call_stream,
    forced_syntax,
)
from prefixserve.api.tool_parsers import HermesStreamParser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "g", "parameters": {}}}]  # fmt: skip
# per family: (text with content and two calls, forced text of two calls); the calls f(a=1, b="x")
# and g() in the syntax the family's model writes (and a grammar forces)
FAMILIES = {
    "hermes": (
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    ),
    "llama3_json": (
        None,  # calls open the output: no content before them
        '{"name": "f", "parameters": {"a": 1, "b": "x"}}; {"name": "g", "parameters": {}}',
    ),
    "mistral": (
        'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1, "b": "x"}, "id": "abcDEF123"}, '
        '{"name": "g", "arguments": {}, "id": "ZYX987wvu"}]',
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1, "b": "x"}, "id": "abcDEF123"}, '
        '{"name": "g", "arguments": {}, "id": "ZYX987wvu"}]',
    ),
    "pythonic": (None, '[f(a=1, b="x"), g()]'),
    "qwen3_coder": (
        "Sure.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nx\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n"
        "</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nx\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n"
        "</tool_call>",
    ),
}
CALLS = [("f", {"a": 1, "b": "x"}), ("g", {})]


def test_each_mode_gets_its_reader():
    assert call_stream(ToolMode.NONE, "mistral", TOOLS) is None
    assert isinstance(call_stream(ToolMode.AUTO, None, TOOLS), HermesStreamParser)
    assert isinstance(call_stream(ToolMode.AUTO, "pythonic", TOOLS), ToolCallStream)
    assert isinstance(call_stream(ToolMode.REQUIRED, "hermes", TOOLS), ForcedHermesStream)
    assert isinstance(call_stream(ToolMode.NAMED, None, TOOLS), ForcedHermesStream)
    assert isinstance(call_stream(ToolMode.REQUIRED, "qwen3_coder", TOOLS), ContentDropped)
    assert forced_syntax(None) == forced_syntax("hermes") == "hermes"
    assert forced_syntax("mistral") == "mistral"


def test_forced_readers_drop_content_and_keep_only_complete_calls():
    text = FAMILIES["qwen3_coder"][1]
    stream = call_stream(ToolMode.REQUIRED, "qwen3_coder", TOOLS)
    cut = text.index("<tool_call>", 5) + 12  # the second call cut off
    assert stream.feed("junk " + text[:cut], final=True)[0] == ""
    assert [c.function.name for c in stream.stream.calls] == ["f"]
    hermes = ForcedHermesStream()
    first, second = hermes.feed(FAMILIES["hermes"][1][:60]), hermes.feed(FAMILIES["hermes"][1][60:])
    assert first == ("", []) and [c.function.name for c in second[1]] == ["f", "g"]
    assert hermes.has_calls


def _run_output(mode: ToolMode, parser: str, text: str, piece: int) -> tuple[list, list]:
    out = ResponseOutput(mode, tool_parser=parser, tools=TOOLS)
    events = []
    for i in range(0, len(text), piece):
        events += out.feed(text[i : i + piece])
    events += out.feed("", final=True) + out.finish("completed")
    return out.items, events


def _shape(items: list[dict]) -> list:
    return [(i["type"], i["content"][0]["text"].strip()) if i["type"] == "message"
            else (i["name"], json.loads(i["arguments"])) for i in items]  # fmt: skip


@pytest.mark.parametrize("piece", [1, 5, 10_000])
@pytest.mark.parametrize("parser", list(FAMILIES))
def test_responses_read_each_familys_calls_streamed_as_whole(parser, piece):
    auto, forced = FAMILIES[parser]
    for mode, text in ((ToolMode.REQUIRED, forced), (ToolMode.AUTO, auto or forced)):
        items, events = _run_output(mode, parser, text, piece)
        whole, _ = _run_output(mode, parser, text, 10_000)
        expected = CALLS if mode is ToolMode.REQUIRED or auto is None else [
            ("message", "Sure."), *CALLS]  # fmt: skip
        assert _shape(items) == _shape(whole) == expected
        for item in items:  # each item's deltas add up to it
            if item["type"] == "function_call":
                deltas = [e["delta"] for e in events if e.get("item_id") == item["id"]
                          and e["type"] == "response.function_call_arguments.delta"]  # fmt: skip
                assert "".join(deltas) == item["arguments"]
        if parser == "mistral":  # the model's ids: the template re-renders them
            calls = [i for i in items if i["type"] == "function_call"]
            assert [i["call_id"] for i in calls] == ["abcDEF123", "ZYX987wvu"]


def test_whitespace_before_a_call_is_no_message():
    text = "\n" + FAMILIES["qwen3_coder"][1]
    items, _ = _run_output(ToolMode.AUTO, "qwen3_coder", text, 1)
    assert [i["type"] for i in items] == ["function_call", "function_call"]
    items, _ = _run_output(ToolMode.AUTO, "qwen3_coder", "  ", 1)
    assert [(i["type"], i["content"][0]["text"]) for i in items] == [("message", "  ")]


def _blocks(mode: ToolMode, parser: str, text: str, piece: int, parallel: bool = True) -> list:
    blocks = BlockEvents(mode, None, parser, TOOLS, parallel)
    events = []
    for i in range(0, len(text), piece):
        events += blocks.feed(text[i : i + piece])
    events += blocks.feed("", final=True)
    out: list[dict] = []
    for kind, body in events:
        if kind == "content_block_start":
            out.append(dict(body["content_block"], raw=""))
        elif kind == "content_block_delta":
            delta = body["delta"]
            out[-1]["raw"] += delta.get("text", delta.get("partial_json", ""))
    return [(b["type"], b["raw"].strip()) if b["type"] == "text"
            else (b["name"], json.loads(b["raw"])) for b in out]  # fmt: skip


@pytest.mark.parametrize("piece", [1, 7, 10_000])
@pytest.mark.parametrize("parser", list(FAMILIES))
def test_messages_read_each_familys_calls_streamed_as_whole(parser, piece):
    auto, forced = FAMILIES[parser]
    assert _blocks(ToolMode.REQUIRED, parser, forced, piece) == CALLS
    expected = CALLS if auto is None else [("text", "Sure."), *CALLS]
    assert _blocks(ToolMode.AUTO, parser, auto or forced, piece) == expected
    assert _blocks(ToolMode.AUTO, parser, auto or forced, piece, parallel=False) == expected[:-1]
