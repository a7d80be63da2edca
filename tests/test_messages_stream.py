"""Messages replies without a server: content blocks streamed (``BlockEvents``) and not
(``content_blocks``) agree, usage splits the prompt by the cache, stop reasons, error shapes."""

from __future__ import annotations

import json

import pytest
from prefixserve.api.messages_stream import BlockEvents
from prefixserve.api.protocol import APIError
from prefixserve.api.protocol_messages import anthropic_error, is_messages_path
from prefixserve.api.serving_messages import content_blocks, stop_reason_of, usage_of
from prefixserve.api.tool_call_streams import ToolMode
from prefixserve.api.tool_parsers import parse_forced_tool_calls, parse_tool_calls

from prefixserve.outputs import CompletionOutput, RequestOutput

CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hi"}}\n</tool_call>'
FORCED = (
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hi"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "Read", "arguments": {"path": "a}\\"b"}}\n</tool_call>'
)


def replay(events: list[tuple[str, dict]]) -> list[dict]:
    """Rebuild the content from block events, checking their order and indexes."""
    blocks: list[dict] = []
    open_index = None
    for kind, body in events:
        if kind == "content_block_start":
            assert open_index is None and body["index"] == len(blocks)
            blocks.append(dict(body["content_block"], _json=""))
            open_index = body["index"]
        elif kind == "content_block_delta":
            assert body["index"] == open_index
            delta, block = body["delta"], blocks[open_index]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["_json"] += delta["partial_json"]
        else:
            assert kind == "content_block_stop" and body["index"] == open_index
            open_index = None
    assert open_index is None
    for block in blocks:
        raw = block.pop("_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(raw)
    return blocks


def stream(text: str, mode: ToolMode, piece: int) -> tuple[list[dict], bool]:
    blocks = BlockEvents(mode)
    events = []
    for i in range(0, len(text), piece):
        events += blocks.feed(text[i : i + piece])
    events += blocks.feed("", final=True)
    return replay(events), blocks.has_calls


def without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize(
    "text, mode",
    [
        ("Hello there.", ToolMode.NONE),
        ("  ", ToolMode.NONE),
        ("", ToolMode.NONE),
        ("Let me run it." + "\n" + CALL, ToolMode.AUTO),
        ("\n" + CALL + "\n" + CALL.replace("echo hi", "ls"), ToolMode.AUTO),
        ("no call here", ToolMode.AUTO),
        ('<tool_call>\n{"name": "f", "arguments": "[1]"}\n</tool_call>', ToolMode.AUTO),
        (FORCED, ToolMode.REQUIRED),
        (FORCED.split("\n<tool_call>")[0] + "\n", ToolMode.NAMED),
    ],
)
def test_streamed_blocks_equal_non_streamed(text, mode, piece):
    streamed, called = stream(text, mode, piece)
    if mode is ToolMode.AUTO:
        content, calls = parse_tool_calls(text)
    elif mode is ToolMode.NONE:
        content, calls = text, []
    else:
        content, calls = None, parse_forced_tool_calls(text)
    whole = content_blocks(content, calls)
    strip = [{**b, "text": b["text"].strip()} if b["type"] == "text" else b for b in streamed]
    assert without_ids(strip if mode is ToolMode.AUTO else streamed) == without_ids(whole)
    assert called == any(b["type"] == "tool_use" for b in whole)


def test_forced_arguments_stream_as_generated():
    events = BlockEvents(ToolMode.REQUIRED).feed(FORCED, final=True)
    fragments = [b["delta"]["partial_json"] for k, b in events if k == "content_block_delta"]
    assert fragments == ['{"command": "echo hi"}', '{"path": "a}\\"b"}']
    starts = [b["content_block"] for k, b in events if k == "content_block_start"]
    assert [(s["type"], s["name"], s["input"]) for s in starts] == [
        ("tool_use", "Bash", {}), ("tool_use", "Read", {})]  # fmt: skip


def test_whitespace_before_a_call_is_dropped_and_text_is_held_until_it_is_more():
    blocks = BlockEvents(ToolMode.AUTO)
    assert blocks.feed("\n") == []
    assert [k for k, _ in blocks.feed(CALL, final=True)] == [
        "content_block_start", "content_block_delta", "content_block_stop"]  # fmt: skip
    text = BlockEvents(ToolMode.NONE)
    assert text.feed(" ") == []
    assert text.feed("a")[1] == ("content_block_delta",
        {"index": 0, "delta": {"type": "text_delta", "text": " a"}})  # fmt: skip


def output(prompt: int, cached: int, generated: int = 2, **finish) -> RequestOutput:
    c = CompletionOutput(0, "x", list(range(generated)), **finish)
    return RequestOutput("r", None, list(range(prompt)), [c], True, cached)


@pytest.mark.parametrize(
    "prompt, cached, block_size, expected",
    [
        (40, 0, 16, (8, 32, 0)),  # two full blocks written, 8 tokens in the partial one
        (40, 32, 16, (8, 0, 32)),  # both full blocks read from the cache
        (40, 16, 16, (8, 16, 16)),
        (32, 16, 16, (0, 16, 16)),  # the last full block is written too
        (10, 0, 16, (10, 0, 0)),
        (40, 0, None, (40, 0, 0)),  # prefix caching off: nothing is cacheable
    ],
)
def test_usage_splits_the_prompt(prompt, cached, block_size, expected):
    usage = usage_of(output(prompt, cached, 3), block_size)
    assert (usage.input_tokens, usage.cache_creation_input_tokens,
            usage.cache_read_input_tokens) == expected  # fmt: skip
    assert sum(expected) == prompt and usage.output_tokens == 3


@pytest.mark.parametrize(
    "finish, called, expected",
    [
        ({"finish_reason": "stop"}, False, ("end_turn", None)),
        ({"finish_reason": "stop", "stop_reason": 7}, False, ("end_turn", None)),
        ({"finish_reason": "stop", "stop_reason": "END"}, False, ("stop_sequence", "END")),
        ({"finish_reason": "length"}, False, ("max_tokens", None)),
        ({"finish_reason": "stop"}, True, ("tool_use", None)),
        ({"finish_reason": None}, False, (None, None)),
    ],
)
def test_stop_reason(finish, called, expected):
    assert stop_reason_of(CompletionOutput(0, **finish), called) == expected


@pytest.mark.parametrize(
    "status, expected_status, err_type",
    [(400, 400, "invalid_request_error"), (401, 401, "authentication_error"),
     (404, 404, "not_found_error"), (413, 413, "request_too_large"),
     (503, 529, "overloaded_error"), (500, 500, "api_error")],
)  # fmt: skip
def test_anthropic_error_shape(status, expected_status, err_type):
    assert anthropic_error(APIError("why", status)) == (
        expected_status, {"type": "error", "error": {"type": err_type, "message": "why"}})  # fmt: skip


def test_messages_paths():
    assert is_messages_path("/v1/messages") and is_messages_path("/v1/messages/count_tokens")
    assert not is_messages_path("/v1/messagesx") and not is_messages_path("/v1/chat/completions")


@pytest.mark.parametrize("piece", [1, 4, 1000])
@pytest.mark.parametrize(
    "text, mode",
    [
        ("<think>check the host</think>\n\nIt is up.", ToolMode.NONE),
        ("<think>run it</think>\n" + FORCED, ToolMode.REQUIRED),
        ("<think>unfinished", ToolMode.NONE),
    ],
)
def test_reasoning_is_a_thinking_block_streamed_and_not(text, mode, piece):
    from prefixserve.api.reasoning_parsers import reasoning_parser

    events, blocks = [], BlockEvents(mode, reasoning_parser("qwen3", "<|im_start|>assistant\n"))
    for i in range(0, len(text), piece):
        events += blocks.feed(text[i : i + piece])
    events += blocks.feed("", final=True)
    thinking = "".join(
        b["delta"]["thinking"] for k, b in events
        if k == "content_block_delta" and b["delta"]["type"] == "thinking_delta"
    )  # fmt: skip
    reasoning, rest = reasoning_parser("qwen3", "<|im_start|>assistant\n").extract(text)
    assert thinking == reasoning
    streamed = replay([(k, b) for k, b in events if b.get("delta", {}).get("type") != "thinking_delta"])
    forced = mode is ToolMode.REQUIRED
    calls = parse_forced_tool_calls(rest or "") if forced else []
    whole = content_blocks(None if forced else rest, calls, reasoning)
    assert whole[0] == {"type": "thinking", "thinking": reasoning, "signature": ""}
    assert [b["type"] for b in streamed] == [b["type"] for b in whole]
    assert without_ids(streamed[1:]) == without_ids(whole[1:])
