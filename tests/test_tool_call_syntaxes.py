"""The engine side of the families' formats, directly: ``tool_call_syntaxes.text_without``,
grammars that start after a reasoning block (``StructuredOutputsParams.reasoning``), their cache
keys, the tool-call marker kept as text, and ``chat_template``'s parsing of ``arguments`` for
templates that take a dict."""

from __future__ import annotations

import dataclasses

import pytest
import xgrammar as xgr
from families import family_tokenizer

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.engine.chat_template import render_chat, takes_string_arguments
from prefixserve.models.builtin import CHAT_TEMPLATE, builtin_tokenizer
from prefixserve.structured_outputs.manager import StructuredOutputManager, build_tokenizer_info
from prefixserve.structured_outputs.params import StructuredOutputsParams
from prefixserve.structured_outputs.tool_call_syntaxes import PARAMETER_END, text_without
from prefixserve.structured_outputs.tool_calls import tool_call_params

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def manager():
    tok = builtin_tokenizer()
    return StructuredOutputManager(tok, len(tok))


def _accepts(manager, params, text: str) -> bool:
    grammar = manager.new_grammar(manager.submit(params).result())
    return grammar.matcher.accept_string(text) and grammar.matcher.is_completed()


@pytest.mark.parametrize(
    "text, ok",
    [
        ("", True),
        ("multi\nline <b>text</b> </param", True),
        ("\n\n</parameter", True),
        ("ends\n</parameter>", False),
        ("\n</parameter>\nafter", False),
    ],
)
def test_text_without_excludes_exactly_the_end(manager, text, ok):
    compiled = manager._compiler.compile_grammar(text_without(PARAMETER_END))
    matcher = xgr.GrammarMatcher(compiled)
    assert (matcher.accept_string(text) and matcher.is_completed()) == ok


def test_text_without_needs_a_unique_first_character():
    with pytest.raises(AssertionError):
        text_without("abca")


@pytest.mark.parametrize(
    "reasoning, text, ok",
    [
        (("<think>", "</think>"), '<think>\nfree {"a" text\n</think>\n\n{"a": 1}', True),
        (("<think>", "</think>"), '{"a": 1}', False),  # Qwen3: the block comes first
        (("<think>", "</think>"), '<think>x</think>{"a": 1} trailing', False),
        (("", "</think>"), 'inside already</think>{"a": 1}', True),  # R1: starts inside
        (("", "</think>"), '</think>\n{"a": 1}', True),
        (None, '{"a": 1}', True),
    ],
)
def test_grammars_apply_after_the_reasoning(manager, reasoning, text, ok):
    params = StructuredOutputsParams(json={"type": "object"}, reasoning=reasoning)
    assert _accepts(manager, params, text) == ok


def test_forced_calls_after_the_reasoning_and_in_another_syntax(manager):
    forced = tool_call_params(TOOLS, "f", False, "llama3_json", ("", "</think>"))
    assert _accepts(manager, forced, 'hm</think>\n\n{"name": "f", "parameters": {}}')
    assert not _accepts(manager, forced, '{"name": "f", "parameters": {}}')


def test_cache_keys_tell_reasoning_and_syntax_apart():
    plain = tool_call_params(TOOLS, None, False)
    assert plain.key == plain.inner_key and len(plain.key) == 2  # hermes keys are unchanged
    keys = {
        plain.key,
        tool_call_params(TOOLS, None, False, "mistral").key,
        dataclasses.replace(plain, reasoning=("", "</think>")).key,
        dataclasses.replace(plain, reasoning=("<think>", "</think>")).key,
    }
    assert len(keys) == 4
    with pytest.raises(InvalidArgumentError, match="reasoning"):
        StructuredOutputsParams(regex="a", reasoning=("<think>", ""))


def test_the_mistral_marker_stays_text_other_special_tokens_do_not():
    tok = family_tokenizer("mistral")
    info = build_tokenizer_info(tok, len(tok), [tok.eos_token_id])
    marker, inst = tok.convert_tokens_to_ids(["[TOOL_CALLS]", "[INST]"])
    assert info.decoded_vocab[marker] == b"[TOOL_CALLS]"
    assert info.decoded_vocab[inst] == b""


def test_arguments_reach_dict_templates_parsed_and_string_templates_verbatim():
    assert takes_string_arguments(CHAT_TEMPLATE)
    tok = family_tokenizer("llama3_json")
    assert not takes_string_arguments(tok.chat_template)
    call = {"id": "c1", "type": "function",
            "function": {"arguments": '{"b": 1, "a": [2]}', "name": "f"}}  # fmt: skip
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [call]}]  # fmt: skip
    text = tok.decode(render_chat(tok, history, tools=TOOLS, add_generation_prompt=False))
    assert '{"name": "f", "parameters": {"b": 1, "a": [2]}}' in text
    mistral = family_tokenizer("mistral")
    call["id"] = "abcdefghi"
    text = mistral.decode(render_chat(mistral, history, tools=TOOLS, add_generation_prompt=False))
    assert (
        '[TOOL_CALLS] [{"name": "f", "arguments": {"b": 1, "a": [2]}, "id": "abcdefghi"}]' in text
    )
