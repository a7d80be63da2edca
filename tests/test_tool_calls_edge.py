"""Direct tests of the tool-call and request edge cases of issue 19: cut-off forced calls, one
tool-call entry per streamed chunk, tools without parameters, refused beam-search options."""

from __future__ import annotations

import json

import pytest

from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.frontend.serving import BaseServing
from prefixserve.api.openai.chat import _message_deltas
from prefixserve.api.openai.protocol import ChatCompletionRequest
from prefixserve.api.parsing.reply import Finish, ReplyParser, ToolMode
from prefixserve.structured_outputs.tool_calls import tool_call_params

CALL_A = '<tool_call>\n{"name": "a", "arguments": {"x": "}\\n</tool_call>"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
TWO = CALL_A + "\n" + CALL_B


def _entries(text: str, size: int, final: bool = True) -> list[dict]:
    """The ``delta.tool_calls`` entries of a forced reply streamed in pieces of ``size``."""
    parser, entries = ReplyParser(ToolMode.REQUIRED), []
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        last = final and k == len(pieces) - 1
        for delta in _message_deltas(parser.feed(piece, Finish("length") if last else None), ""):
            entries += delta["tool_calls"]
    return entries


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
@pytest.mark.parametrize("cut, num_complete", [(None, 2), (7, 0), (len(CALL_A), 1),
                                               (len(CALL_A) + 10, 1), (len(TWO) - 3, 1)])
def test_streamed_forced_calls_are_the_complete_calls_one_entry_per_chunk(size, cut, num_complete):
    """A call's id and name, then its raw arguments: two entries, only once it is complete, so a
    call cut off (``max_tokens``) is never streamed, and nothing becomes content."""
    entries = _entries(TWO[:cut], size)
    complete = [("a", '{"x": "}\\n</tool_call>"}'), ("b", "{}")][:num_complete]
    names = [e for e in entries if "id" in e]
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in names] == [
        (i, name, "") for i, (name, _) in enumerate(complete)]  # fmt: skip
    arguments = [(names[e["index"]]["function"]["name"], e["function"]["arguments"])
                 for e in entries if "id" not in e]  # fmt: skip
    assert arguments == complete
    assert [e["index"] for e in entries] == sorted(e["index"] for e in entries)


def test_a_call_is_streamed_only_once_complete():
    assert _entries(CALL_A[:-1], 1000, final=False) == []
    entries = _entries(CALL_A, 1000, final=False)
    assert [sorted(e) for e in entries] == [["function", "id", "index", "type"],
                                            ["function", "index"]]  # fmt: skip
    assert json.loads(entries[1]["function"]["arguments"]) == {"x": "}\n</tool_call>"}


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
        BaseServing._check_beam_search(_request(**fields).sampling_options(), None, None)
    assert info.value.param == param and info.value.status == 400


def test_beam_search_accepts_neutral_values_and_a_seed():
    neutral = {"temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 7,
               "presence_penalty": 0.0, "repetition_penalty": 1.0}  # fmt: skip
    BaseServing._check_beam_search(_request(**neutral).sampling_options(), None, None)
