"""Optional tool calls (``tool_choice`` "auto" with strict tools): free text is allowed, and a
call, once ``<tool_call>`` is written, must name a listed function with arguments that match its
schema (strict tools) or any object (the others)."""

from __future__ import annotations

import json

import pytest

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.models.builtin import builtin_model_config, builtin_tokenizer
from prefixserve.structured_outputs.manager import StructuredOutputManager
from prefixserve.structured_outputs.tool_calls import optional_tool_call_params, tool_call_params

TOK = builtin_tokenizer()
EOS = builtin_model_config().eos_token_ids
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}  # fmt: skip


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def manager():
    m = StructuredOutputManager(TOK, len(TOK) + 20, stop_token_ids=EOS)
    yield m
    m.shutdown()


def grammar(manager, parallel: bool = True, strict: frozenset = frozenset({"get_weather"})):
    params = optional_tool_call_params([WEATHER, NOTE], set(strict), parallel)
    return manager.new_grammar(manager.submit(params).result())


def accepts(g, text: str) -> bool:
    return all(g.accept_token(t) for t in TOK.encode(text, add_special_tokens=False))


def test_free_text_alone_may_end(manager):
    g = grammar(manager)
    assert accepts(g, "Just an answer, no call.") and g.accept_token(EOS[1])


def test_calls_after_text_must_match_strict_schemas(manager):
    text = "Let me check. " + call("get_weather", {"city": "Oslo"})
    g = grammar(manager)
    assert accepts(g, text) and g.accept_token(EOS[1])
    assert not accepts(grammar(manager), call("get_weather", {"city": 5}))
    assert not accepts(grammar(manager), call("get_weather", {"town": "Oslo"}))
    assert not accepts(grammar(manager), call("unknown", {}))


def test_non_strict_tools_take_any_object(manager):
    assert accepts(grammar(manager), call("note", {"anything": [1, "x"]}))
    strict_note = grammar(manager, strict=frozenset({"get_weather", "note"}))
    assert not accepts(strict_note, call("note", {"anything": [1, "x"]}))


def test_without_parallel_only_eos_follows_the_first_call(manager):
    g = grammar(manager, parallel=False)
    assert accepts(g, call("note", {"n": 1}))
    assert not accepts(g, " more")
    g = grammar(manager, parallel=True)
    assert accepts(g, call("note", {"n": 1}) + "\n" + call("note", {"n": 2}))


def test_the_cache_key_tells_optional_from_forced():
    optional = optional_tool_call_params([WEATHER], {"get_weather"}, True)
    forced = tool_call_params([WEATHER], None, True)
    assert optional.key != forced.key and optional.kind == forced.kind == "tool_calls"
    with pytest.raises(InvalidArgumentError, match="need tools"):
        optional_tool_call_params([], set(), True)
