"""Output items and typed stream events built from the model's text, per tool mode and for
every family's tool-call syntax."""

from __future__ import annotations

import json

import pytest

from prefixserve.api.openai.responses.output import ResponseOutput
from prefixserve.api.parsing.reasoning import reasoning_parser
from prefixserve.api.parsing.reply import Finish, ReplyParser, ToolMode

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "g", "parameters": {}}}]  # fmt: skip
CALLS = ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>\n'
         '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')  # fmt: skip


def output(mode: ToolMode, syntax: str | None = None, reasoner=None, **options) -> ResponseOutput:
    return ResponseOutput(ReplyParser(mode, syntax, TOOLS, reasoner), **options)


def run(mode: ToolMode, pieces: list[str], status: str = "completed") -> tuple[ResponseOutput, list]:
    out = output(mode)
    events = []
    for i, piece in enumerate(pieces):
        events += out.feed(piece, finish=Finish("stop") if i == len(pieces) - 1 else None)
    return out, events + out.finish(status)


def strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_text_events_in_openai_order():
    out, events = run(ToolMode.NONE, ["Hel", "lo", " there"])
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert "".join(e["delta"] for e in events if e.get("delta") is not None) == "Hello there"
    (item,) = out.items
    assert item["status"] == "completed" and item["content"][0]["text"] == "Hello there"
    assert events[-1]["item"] == item and out.text == "Hello there"
    assert {e["output_index"] for e in events} == {0}


def test_forced_calls_stream_arguments_and_match_the_whole_text():
    pieces = [CALLS[i : i + 7] for i in range(0, len(CALLS), 7)]
    out, events = run(ToolMode.REQUIRED, pieces)
    whole, _ = run(ToolMode.REQUIRED, [CALLS])
    assert strip_ids(out.items) == strip_ids(whole.items) == [
        {"type": "function_call", "status": "completed", "name": "f", "arguments": '{"a": [1, 2]}'},
        {"type": "function_call", "status": "completed", "name": "g", "arguments": "{}"},
    ]  # fmt: skip
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
    assert kinds.count("response.function_call_arguments.done") == 2
    for index in (0, 1):
        mine = [e for e in events if e["output_index"] == index]
        deltas = "".join(e["delta"] for e in mine if "delta" in e)
        assert deltas == out.items[index]["arguments"]
        assert [e["type"] for e in mine][-2:] == [
            "response.function_call_arguments.done", "response.output_item.done"]  # fmt: skip
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["name"] for e in done] == ["f", "g"]


def test_a_call_cut_short_is_neither_streamed_nor_returned():
    """As chat completions (and OpenAI): a forced call cut off by the token limit gives no
    item; the complete calls before it stay."""
    out, events = run(ToolMode.NAMED, [CALLS[:40]], status="incomplete")
    assert out.items == [] and events == []
    cut = CALLS.index("<tool_call>", 10) + 20
    out, events = run(ToolMode.REQUIRED, [CALLS[:cut]], status="incomplete")
    assert [item["name"] for item in out.items] == ["f"]
    assert out.items[0]["status"] == "completed"


def test_auto_mode_text_then_parsed_calls():
    out, events = run(ToolMode.AUTO, ["Sure. <tool", "_call>", '{"name": "f", "arguments": {}}',
                                      "</tool_call>"])  # fmt: skip
    assert [item["type"] for item in out.items] == ["message", "function_call"]
    assert out.items[0]["content"][0]["text"] == "Sure. "
    assert out.items[1]["name"] == "f" and out.items[1]["arguments"] == "{}"
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1]


def test_logprobs_ride_on_deltas_and_the_part():
    out = output(ToolMode.NONE, with_logprobs=True)
    lp = [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}]
    events = out.feed("a", lp) + out.finish("completed")
    assert events[2]["logprobs"] == lp and out.items[0]["content"][0]["logprobs"] == lp
    assert events[1]["part"]["logprobs"] == []  # the part as it was when added


def test_a_namespaced_function_call_names_its_namespace():
    out = output(ToolMode.REQUIRED, namespaces={"g": "tools"})
    out.feed(CALLS, finish=Finish("stop"))
    out.finish("completed")
    assert "namespace" not in out.items[0] and out.items[1]["namespace"] == "tools"


def _reasoned(text: str, piece: int, mode: ToolMode = ToolMode.NONE, status: str = "completed"):
    out = output(mode, reasoner=reasoning_parser("qwen3", "<|im_start|>assistant\n"))
    events = []
    for i in range(0, len(text), piece):
        events += out.feed(text[i : i + piece])
    return out, events + out.feed("", finish=Finish("stop")) + out.finish(status)


def test_reasoning_is_an_item_before_the_message_in_openai_order():
    text = "<think>is 7 prime?</think>\n\nYes."
    for piece in (1, 4, 1000):
        out, events = _reasoned(text, piece)
        reasoning, message = out.items
        assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "is 7 prime?"}]
        assert reasoning["status"] == "completed" and out.reasoning == "is 7 prime?"
        assert message["content"][0]["text"] == "Yes." and out.text == "Yes."
        kinds = [e["type"] for e in events if e["output_index"] == 0]
        assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
        assert set(kinds[2:-3]) == {"response.reasoning_text.delta"}
        assert kinds[-3:] == ["response.reasoning_text.done", "response.content_part.done",
                              "response.output_item.done"]  # fmt: skip
        deltas = "".join(e["delta"] for e in events if e["type"].endswith("reasoning_text.delta"))
        assert deltas == "is 7 prime?"
        first_message = min(i for i, e in enumerate(events) if e["output_index"] == 1)
        assert first_message > max(i for i, e in enumerate(events) if e["output_index"] == 0)


def test_reasoning_then_a_forced_call_and_unfinished_reasoning():
    out, _ = _reasoned("<think>call it</think>\n" + CALLS, 3, ToolMode.REQUIRED)
    assert [i["type"] for i in out.items] == ["reasoning", "function_call", "function_call"]
    out, events = _reasoned("<think>still thinking", 2, status="incomplete")
    (item,) = out.items
    assert item["status"] == "incomplete" and out.reasoning == "still thinking"
    assert events[-1]["type"] == "response.output_item.done"
    out, _ = _reasoned("No tags here.", 5)
    assert [i["type"] for i in out.items] == ["message"] and out.reasoning is None


def test_logprobs_of_reasoning_tokens_make_no_message():
    out = output(ToolMode.NONE, reasoner=reasoning_parser("deepseek_r1", "<think>\n"),
                 with_logprobs=True)  # fmt: skip
    lp = [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}]
    out.feed("thinking", lp)
    assert [i["type"] for i in out.items] == ["reasoning"]
    out.feed("</think>Hi", lp, finish=Finish("stop"))
    assert out.items[1]["content"][0]["logprobs"] == lp


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
FAMILY_CALLS = [("f", {"a": 1, "b": "x"}), ("g", {})]


def _family_items(mode: ToolMode, syntax: str, text: str, piece: int) -> tuple[list, list]:
    out = output(mode, syntax)
    events = []
    for i in range(0, len(text), piece):
        events += out.feed(text[i : i + piece])
    return out.items, events + out.feed("", finish=Finish("stop")) + out.finish("completed")


def _shape(items: list[dict]) -> list:
    return [(i["type"], i["content"][0]["text"].strip()) if i["type"] == "message"
            else (i["name"], json.loads(i["arguments"])) for i in items]  # fmt: skip


@pytest.mark.parametrize("piece", [1, 5, 10_000])
@pytest.mark.parametrize("syntax", list(FAMILIES))
def test_each_familys_calls_are_items_with_their_arguments_deltas(syntax, piece):
    auto, forced = FAMILIES[syntax]
    for mode, text in ((ToolMode.REQUIRED, forced), (ToolMode.AUTO, auto or forced)):
        items, events = _family_items(mode, syntax, text, piece)
        expected = FAMILY_CALLS if mode is ToolMode.REQUIRED or auto is None else [
            ("message", "Sure."), *FAMILY_CALLS]  # fmt: skip
        assert _shape(items) == expected
        for item in items:  # each item's deltas add up to it
            if item["type"] == "function_call":
                deltas = [e["delta"] for e in events if e.get("item_id") == item["id"]
                          and e["type"] == "response.function_call_arguments.delta"]  # fmt: skip
                assert "".join(deltas) == item["arguments"]
        if syntax == "mistral":  # the model's ids: the template re-renders them
            calls = [i for i in items if i["type"] == "function_call"]
            assert [i["call_id"] for i in calls] == ["abcDEF123", "ZYX987wvu"]


def test_whitespace_before_a_call_is_no_message():
    items, _ = _family_items(ToolMode.AUTO, "qwen3_coder", "\n" + FAMILIES["qwen3_coder"][1], 1)
    assert [i["type"] for i in items] == ["function_call", "function_call"]
    items, _ = _family_items(ToolMode.AUTO, "qwen3_coder", "  ", 1)
    assert [(i["type"], i["content"][0]["text"]) for i in items] == [("message", "  ")]
