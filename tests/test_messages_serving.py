"""``MessagesServing`` on a scripted engine: the event stream's order, pings while waiting, usage in
``message_start`` and ``message_delta``, the error event, and the forced-tool-call testing aid."""

from __future__ import annotations

import asyncio
import json

import pytest
from scripted_engine import ScriptedEngine

import prefixserve.api.anthropic.messages as serving_messages
from prefixserve.api.anthropic.messages import MessagesServing
from prefixserve.api.anthropic.prompt import to_chat_prompt
from prefixserve.api.anthropic.protocol import MessagesRequest
from prefixserve.api.engine_client import Generation
from prefixserve.api.frontend.inputs import EngineInputs
from prefixserve.api.frontend.protocol import APIError, ToolRequest
from prefixserve.api.parsing.reply import ToolMode
from prefixserve.core.outputs import CompletionOutput, RequestOutput
from prefixserve.core.sampling_params import RequestOutputKind

PROMPT = list(range(40))


def serving(**options) -> MessagesServing:
    return MessagesServing(ScriptedEngine(), ["m"], **options)


class FakeStream:
    """DELTA outputs, each after ``delay`` seconds; an exception item is raised."""

    output_kind = RequestOutputKind.DELTA

    def __init__(self, items: list, delay: float) -> None:
        self.items, self.delay = items, delay
        self.request_id, self.finished = "r", False

    async def __aiter__(self):
        for item in self.items:
            await asyncio.sleep(self.delay)
            if isinstance(item, BaseException):
                raise item
            self.finished = item.finished
            yield item


def out(text: str, n: int, finish: str | None = None) -> RequestOutput:
    c = CompletionOutput(0, text, list(range(n)), finish_reason=finish)
    return RequestOutput("r", None, PROMPT, [c], finish is not None, num_cached_tokens=16)


def run_stream(items: list, delay: float) -> tuple[list[tuple[str, dict]], MessagesServing]:
    messages = serving()
    stream = FakeStream(items, delay)
    inputs = EngineInputs(PROMPT, None, ToolMode.NONE, ToolRequest(), "")

    async def main() -> list[str]:
        generation = Generation(messages.engine, [stream])
        return [e async for e in messages._stream("msg_1", "m", generation, inputs)]

    events = []
    for raw in asyncio.run(main()):
        head, data = raw.strip().split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events, messages


def test_stream_order_and_usage_split_in_message_start():
    events, _ = run_stream([out("Hel", 1), out("lo", 1, "stop")], delay=0.0)
    kinds = [k for k, _ in events]
    # deltas that arrived together come as one: the order, not the count, is the contract
    deltas = [b["delta"]["text"] for k, b in events if k == "content_block_delta"]
    assert "".join(deltas) == "Hello" and 1 <= len(deltas) <= 2
    assert [k for i, k in enumerate(kinds) if k != "content_block_delta" or
            kinds[i - 1] != "content_block_delta"] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    usage = events[0][1]["message"]["usage"]
    assert usage == {"input_tokens": 8, "output_tokens": 0, "cache_creation_input_tokens": 16,
                     "cache_read_input_tokens": 16,
                     "cache_creation": {"ephemeral_5m_input_tokens": 16,
                                        "ephemeral_1h_input_tokens": 0}}  # fmt: skip
    assert events[kinds.index("message_delta")][1] == {"type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {**usage, "output_tokens": 2}}  # fmt: skip


def test_pings_while_waiting(monkeypatch):
    monkeypatch.setattr(serving_messages, "FIRST_OUTPUT_WAIT_S", 0.05)
    monkeypatch.setattr(serving_messages, "PING_INTERVAL_S", 0.05)
    events, _ = run_stream([out("Hi", 1, "length")], delay=0.3)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds.count("ping") >= 3
    assert kinds[-2:] == ["message_delta", "message_stop"]
    # the first output came late: message_start counted the whole prompt, message_delta splits it
    assert events[0][1]["message"]["usage"]["input_tokens"] == 40
    assert events[-2][1]["usage"]["cache_read_input_tokens"] == 16
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_a_failure_midway_ends_with_an_error_event():
    events, messages = run_stream([out("Hi", 1), APIError("queue full", 503)], delay=0.0)
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "queue full"}})  # fmt: skip
    assert "message_stop" not in [k for k, _ in events]
    assert messages.engine.aborted == ["r"]  # the handler lets go of its engine request


FORCE = {"name": "Bash", "input_schema": {"type": "object", "properties": {
    "command": {"const": "echo hi"}}}}  # fmt: skip
TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}},
         {"name": "Read", "input_schema": {"type": "object"}}]  # fmt: skip


@pytest.mark.parametrize(
    "messages, tools, forced",
    [
        ([{"role": "user", "content": "run it"}], TOOLS, True),
        ([{"role": "user", "content": "run it"}, {"role": "system", "content": "env"}], TOOLS,
         True),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
           "content": "hi"}]}], TOOLS, False),
        ([{"role": "user", "content": "run it"}], TOOLS[1:], False),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], TOOLS, False),
    ],
)  # fmt: skip
def test_force_tool_call_applies_to_the_users_own_turn(messages, tools, forced):
    req = MessagesRequest(model="m", max_tokens=8, messages=messages, tools=tools)
    tools = to_chat_prompt(req, True, True).tools
    got = serving(force_tool_call=FORCE)._force(req, tools)
    if forced:
        assert (got.choice, got.name) == ("named", "Bash")
        assert got.grammar_tools == [{"type": "function", "function": {
            "name": "Bash", "parameters": FORCE["input_schema"]}}]  # fmt: skip
        assert got.tools[0]["function"]["parameters"] == {"type": "object"}  # the prompt's own
    else:
        assert got == tools and got.grammar_tools is None


def test_no_forcing_without_the_option():
    req = MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                          tools=TOOLS)  # fmt: skip
    tools = to_chat_prompt(req, True, True).tools
    assert serving()._force(req, tools) is tools and tools.choice == "auto"


def test_cli_options():
    from prefixserve.entrypoints.cli import build_parser

    parse = build_parser().parse_args
    args = parse(["serve", "--messages-force-tool-call", json.dumps(FORCE)])
    assert args.messages_force_tool_call == FORCE and args.drop_attribution_header is True
    assert parse(["serve", "--keep-attribution-header"]).drop_attribution_header is False
    for bad in ("{", '{"name": "Bash"}', '["Bash"]'):
        with pytest.raises(SystemExit):
            parse(["serve", "--messages-force-tool-call", bad])
