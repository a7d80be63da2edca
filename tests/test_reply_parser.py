"""The one reply parser (``api/parsing/reply.py``): for every tool-call syntax, every tool mode
and with or without a reasoning block, any split of a reply into deltas gives the same parts,
folded, as the whole reply fed once (the non-streamed path); plus the rules it applies for every
protocol (content around calls, cut-off calls, ``parallel_tool_calls: false``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.api.parsing.reasoning import ThinkReasoningParser
from prefixserve.api.parsing.reply import (
    Finish,
    ReplyParser,
    TextDelta,
    ToolCallDelta,
    ToolMode,
    fold,
)
from prefixserve.api.parsing.tool_calls import TOOL_CALL_PARSERS
from prefixserve.structured_outputs.tool_call_syntaxes import SYNTAXES

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "g", "parameters": {}}}]  # fmt: skip
# per syntax: two calls, f(a=1, b="x") and g(), as the family's model writes them
CALLS = {
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "x </tool_call>"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "f", "parameters": {"a": 1, "b": "x"}}; {"name": "g", "parameters": {}}',
    "mistral": '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1, "b": "x"}, "id": "abcDEF123"}, '
    '{"name": "g", "arguments": {}, "id": "ZYX987wvu"}]',
    "pythonic": '[f(a=1, b="x"), g()]',
    "qwen3_coder": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n"
    "x\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n"
    "</tool_call>",
}
CONTENT_FIRST = {"hermes", "mistral", "qwen3_coder"}  # content may come before the calls
MODES = [ToolMode.NONE, ToolMode.AUTO, ToolMode.REQUIRED]


def test_every_registered_syntax_is_tested():
    assert set(CALLS) == set(TOOL_CALL_PARSERS) == set(SYNTAXES)


def _parser(syntax: str, mode: ToolMode, reasoning: bool, parallel: bool) -> ReplyParser:
    reasoner = ThinkReasoningParser(starts_in_reasoning=False) if reasoning else None
    return ReplyParser(mode, syntax, TOOLS, reasoner, parallel)


def _run(parser: ReplyParser, text: str, cuts: list[int]) -> list:
    bounds = [0, *sorted(set(cuts)), len(text)]
    parts = []
    for start, end in itertools.pairwise(bounds):
        parts += parser.feed(text[start:end])
    return parts + parser.feed("", Finish("stop"))


def _key(parts: list, syntax: str) -> tuple:
    reply = fold(parts)
    calls = [(c.name, c.arguments, c.id if syntax == "mistral" else "") for c in reply.calls]
    return reply.reasoning, reply.text, calls, reply.finish


@st.composite
def replies(draw):
    syntax = draw(st.sampled_from(sorted(CALLS)))
    text = CALLS[syntax]
    if syntax in CONTENT_FIRST and draw(st.booleans()):
        text = draw(st.sampled_from(["Sure.\n", " \n", "ok "])) + text
    text = text[: draw(st.integers(1, len(text)))] if draw(st.booleans()) else text  # cut off
    text += draw(st.sampled_from(["", "\n", " trailing words"]))
    reasoning = draw(st.booleans())
    if reasoning:
        text = draw(st.sampled_from(["<think>\nhm, f?\n</think>\n\n", "<think>cut"])) + text
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    return syntax, text, reasoning, cuts


@settings(max_examples=400, deadline=None)
@given(replies(), st.sampled_from(MODES), st.booleans())
def test_any_split_gives_the_whole_replys_parts(reply, mode, parallel):
    syntax, text, reasoning, cuts = reply
    whole = _run(_parser(syntax, mode, reasoning, parallel), text, [])
    split = _run(_parser(syntax, mode, reasoning, parallel), text, cuts)
    assert _key(split, syntax) == _key(whole, syntax)


@pytest.mark.parametrize("syntax", sorted(CALLS))
def test_each_syntax_reads_both_calls_in_both_modes(syntax):
    for mode in (ToolMode.AUTO, ToolMode.REQUIRED):
        reply = fold(_run(_parser(syntax, mode, False, True), CALLS[syntax], []))
        assert [c.name for c in reply.calls] == ["f", "g"] and reply.text == ""
        assert reply.finish == Finish("stop", None, called=True)


def test_a_cut_off_second_call_keeps_the_first_and_shows_the_rest_in_auto():
    """Issue 30, bug 1, at the parser: every protocol reads hermes this way, streamed or not."""
    text = CALLS["hermes"][: CALLS["hermes"].index('"g"')]
    for cuts in ([], list(range(len(text)))):
        auto = fold(_run(_parser("hermes", ToolMode.AUTO, False, True), text, cuts))
        assert [c.name for c in auto.calls] == ["f"]
        assert auto.text == '\n<tool_call>\n{"name": '
        forced = fold(_run(_parser("hermes", ToolMode.REQUIRED, False, True), text, cuts))
        assert [c.name for c in forced.calls] == ["f"] and forced.text == ""


def test_hermes_arguments_keep_the_text_the_model_wrote():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1.50, "b": "\\u00e9"}}\n</tool_call>'
    reply = fold(_run(_parser("hermes", ToolMode.AUTO, False, True), text, []))
    assert reply.calls[0].arguments == '{"a": 1.50, "b": "\\u00e9"}'


def test_without_parallel_only_the_first_call_is_kept():
    """Issue 30, bug 2: the cut to one call is the parser's, so every encoder has it."""
    for syntax in CALLS:
        parts = _run(_parser(syntax, ToolMode.AUTO, False, False), CALLS[syntax], [3])
        assert [c.name for c in fold(parts).calls] == ["f"], syntax


def test_parts_come_in_order_and_whitespace_before_a_call_is_dropped():
    parts = _run(_parser("qwen3_coder", ToolMode.AUTO, False, True),
                 "Sure.\n" + CALLS["qwen3_coder"] + "\nand more", [2, 6, 7])  # fmt: skip
    assert [type(p).__name__ for p in parts] == ["TextDelta", "TextDelta", "ToolCallDelta",
                                                 "ToolCallDelta", "TextDelta", "Finish"]  # fmt: skip
    assert parts[2] == ToolCallDelta(0, '{"a": 1, "b": "x"}', parts[2].call_id, "f", done=True)
    assert parts[3].index == 1 and parts[3].arguments == "{}" and parts[3].done
    assert parts[-2] == TextDelta("\nand more")
    only_space = fold(_run(_parser("hermes", ToolMode.AUTO, False, True), " \n" + CALLS["hermes"],
                           [1]))  # fmt: skip
    assert only_space.text == ""
    no_call = fold(_run(_parser("hermes", ToolMode.AUTO, False, True), " \n", [1]))
    assert no_call.text == " \n" and no_call.finish == Finish("stop")


def test_reasoning_comes_first_and_is_marked_in_the_finish():
    parser = _parser("hermes", ToolMode.NONE, True, True)
    reply = fold(_run(parser, "<think>\nwhy\n</think>\n\nanswer", [4, 9]))
    assert (reply.reasoning, reply.text) == ("\nwhy\n", "answer")
    assert reply.finish == Finish("stop", reasoned=True)
    assert fold(_run(_parser("hermes", ToolMode.NONE, True, True), "plain", [])).reasoning is None
