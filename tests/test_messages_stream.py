"""Messages replies without a server: content blocks streamed (``BlockEvents``) and their
non-streamed content (``content_of`` the same events) agree for any split, usage splits the
prompt by the cache, stop reasons, error shapes."""

from __future__ import annotations

import pytest

from prefixserve.api.anthropic.blocks import BlockEvents, content_of
from prefixserve.api.anthropic.messages import stop_reason_of, usage_of
from prefixserve.api.anthropic.protocol import anthropic_error, is_messages_path
from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.parsing.reasoning import reasoning_parser
from prefixserve.api.parsing.reply import Finish, ReplyParser, ToolMode
from prefixserve.core.outputs import CompletionOutput, RequestOutput

CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hi"}}\n</tool_call>'
FORCED = (
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hi"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "Read", "arguments": {"path": "a}\\"b"}}\n</tool_call>'
)


def check_order(events: list[tuple[str, dict]]) -> None:
    """Blocks start in index order, one open at a time, deltas go to the open one."""
    open_index, count = None, 0
    for kind, body in events:
        if kind == "content_block_start":
            assert open_index is None and body["index"] == count
            open_index, count = body["index"], count + 1
        elif kind == "content_block_delta":
            assert body["index"] == open_index
        else:
            assert kind == "content_block_stop" and body["index"] == open_index
            open_index = None
    assert open_index is None


def blocks_of(text: str, mode: ToolMode, piece: int, reasoning: bool = False
              ) -> tuple[list[dict], bool]:  # fmt: skip
    reasoner = reasoning_parser("qwen3", "<|im_start|>assistant\n") if reasoning else None
    blocks = BlockEvents(ReplyParser(mode, "hermes", None, reasoner))
    events = [e for i in range(0, len(text), piece) for e in blocks.feed(text[i : i + piece])]
    events += blocks.feed("", Finish("stop"))
    check_order(events)
    return content_of(events), blocks.has_calls


def without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize(
    "text, mode, expected",
    [
        ("Hello there.", ToolMode.NONE, [("text", "Hello there.")]),
        ("  ", ToolMode.NONE, [("text", "  ")]),
        ("", ToolMode.NONE, []),
        ("Let me run it.\n" + CALL, ToolMode.AUTO,
         [("text", "Let me run it.\n"), ("tool_use", {"command": "echo hi"})]),
        ("\n" + CALL + "\n" + CALL.replace("echo hi", "ls"), ToolMode.AUTO,
         [("tool_use", {"command": "echo hi"}), ("tool_use", {"command": "ls"})]),
        ("no call here", ToolMode.AUTO, [("text", "no call here")]),
        ('<tool_call>\n{"name": "f", "arguments": "[1]"}\n</tool_call>', ToolMode.AUTO,
         [("text", '{"name": "f", "arguments": "[1]"}')]),  # arguments that are no object
        (FORCED, ToolMode.REQUIRED, [("tool_use", {"command": "echo hi"}),
                                     ("tool_use", {"path": 'a}"b'})]),
        (FORCED.split("\n<tool_call>")[0] + "\n", ToolMode.NAMED,
         [("tool_use", {"command": "echo hi"})]),
    ],
)  # fmt: skip
def test_streamed_blocks_equal_non_streamed(text, mode, expected, piece):
    streamed, called = blocks_of(text, mode, piece)
    whole, _ = blocks_of(text, mode, len(text) or 1)
    assert without_ids(streamed) == without_ids(whole)
    assert [(b["type"], b.get("text", b.get("input"))) for b in whole] == expected
    assert called == any(b["type"] == "tool_use" for b in whole)


def test_forced_arguments_stream_as_generated():
    events = BlockEvents(ReplyParser(ToolMode.REQUIRED)).feed(FORCED, Finish("stop"))
    fragments = [b["delta"]["partial_json"] for k, b in events if k == "content_block_delta"]
    assert fragments == ['{"command": "echo hi"}', '{"path": "a}\\"b"}']
    starts = [b["content_block"] for k, b in events if k == "content_block_start"]
    assert [(s["type"], s["name"], s["input"]) for s in starts] == [
        ("tool_use", "Bash", {}), ("tool_use", "Read", {})]  # fmt: skip


def test_whitespace_before_a_call_is_dropped():
    blocks = BlockEvents(ReplyParser(ToolMode.AUTO, "hermes"))
    assert blocks.feed("\n") == []
    assert [k for k, _ in blocks.feed(CALL, Finish("stop"))] == [
        "content_block_start", "content_block_delta", "content_block_stop"]  # fmt: skip


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
    "text, mode, expected",
    [
        ("<think>check the host</think>\n\nIt is up.", ToolMode.NONE,
         [("thinking", "check the host"), ("text", "It is up.")]),
        ("<think>run it</think>\n" + FORCED, ToolMode.REQUIRED,
         [("thinking", "run it"), ("tool_use", {"command": "echo hi"}),
          ("tool_use", {"path": 'a}"b'})]),
        ("<think>unfinished", ToolMode.NONE, [("thinking", "unfinished")]),
    ],
)  # fmt: skip
def test_reasoning_is_a_thinking_block_streamed_and_not(text, mode, expected, piece):
    streamed, _ = blocks_of(text, mode, piece, reasoning=True)
    whole, _ = blocks_of(text, mode, len(text), reasoning=True)
    assert without_ids(streamed) == without_ids(whole)
    assert whole[0]["signature"] == ""
    assert [(b["type"], b.get("thinking", b.get("text", b.get("input")))) for b in whole] == (
        expected
    )
