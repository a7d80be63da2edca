"""Direct tests of the tool-call and request edge cases of issue 19: cut-off forced calls, one
tool-call entry per streamed chunk, tools without parameters, refused beam-search options."""

from __future__ import annotations

import json

import pytest
from prefixserve.api.protocol import APIError, ChatCompletionRequest
from prefixserve.api.serving_base import BaseServing
from prefixserve.api.tool_parsers import ForcedToolCallDeltas, parse_forced_tool_calls

from prefixserve.structured_outputs.tool_calls import tool_call_params

CALL_A = '<tool_call>\n{"name": "a", "arguments": {"x": "}\\n</tool_call>"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
TWO = CALL_A + "\n" + CALL_B


def _calls(tool_calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in tool_calls]


def test_a_call_cut_off_is_dropped_and_nothing_becomes_content():
    assert _calls(parse_forced_tool_calls(TWO)) == [("a", '{"x": "}\\n</tool_call>"}'), ("b", "{}")]
    for cut in (5, len(CALL_A) - 1, len(CALL_A) + 4, len(TWO) - 1):
        whole = parse_forced_tool_calls(TWO[:cut])
        assert len(whole) == (1 if cut > len(CALL_A) else 0), cut


def _stream(text: str, size: int) -> list[list[dict]]:
    deltas = ForcedToolCallDeltas()
    return [deltas.feed(text[i : i + size]) for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
@pytest.mark.parametrize("cut", [None, 7, len(CALL_A), len(CALL_A) + 10, len(TWO) - 3])
def test_streamed_forced_calls_are_the_non_streamed_ones(size, cut):
    text = TWO[:cut]
    entries = [e for fed in _stream(text, size) for e in fed]
    names = [e for e in entries if "id" in e]
    arguments = [e for e in entries if "id" not in e]
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in names] == [
        (i, n, "") for i, (n, _) in enumerate(_calls(parse_forced_tool_calls(text)))
    ]
    streamed = [(names[e["index"]]["function"]["name"], e["function"]["arguments"])
                for e in arguments]  # fmt: skip
    assert streamed == _calls(parse_forced_tool_calls(text))
    # a call's id and name come before its arguments, each call after the one before
    assert [e["index"] for e in entries] == sorted(e["index"] for e in entries)


def test_a_call_is_streamed_only_once_complete():
    deltas = ForcedToolCallDeltas()
    assert deltas.feed(CALL_A[:-1]) == [] and not deltas.has_calls
    entries = deltas.feed(CALL_A[-1])
    assert [sorted(e) for e in entries] == [
        ["function", "id", "index", "type"],
        ["function", "index"],
    ]
    assert json.loads(entries[1]["function"]["arguments"]) == {"x": "}\n</tool_call>"}
    assert deltas.feed("\n" + CALL_B[:20]) == [] and deltas.has_calls


@pytest.mark.parametrize("function", [{"name": "ping"}, {"name": "ping", "parameters": {}}])
def test_a_tool_without_parameters_takes_none(function):
    spec = tool_call_params([{"type": "function", "function": function}], None, False).tool_calls
    assert spec is not None and spec.functions == (("ping", None),)


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 use_beam_search=True, n=2, **fields)  # fmt: skip


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"min_p": 0.1}, "min_p"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -0.5}, "frequency_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"bad_words": ["x"]}, "bad_words"),
    ],
)
def test_beam_search_refuses_sampling_controls_it_would_ignore(fields, param):
    with pytest.raises(APIError) as info:
        BaseServing._check_beam_search(_request(**fields), None, None)
    assert info.value.param == param and info.value.status == 400


def test_beam_search_accepts_neutral_values_and_a_seed():
    neutral = {"temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 7,
               "presence_penalty": 0.0, "repetition_penalty": 1.0}  # fmt: skip
    BaseServing._check_beam_search(_request(**neutral), None, None)
