"""The splice of a continued response (``previous_response_id``): the stored prompt and output
ids are kept only when the template's rendering of the whole conversation starts with their
text; otherwise the prompt is the template's text re-tokenized."""

from __future__ import annotations

import pytest

from prefixserve.api.openai.responses.continuation import continue_prompt, render_prompt
from prefixserve.api.openai.responses.items import normalize_input, to_messages
from prefixserve.engine.chat_template import render_chat_text
from prefixserve.models.builtin import CHAT_TEMPLATE, EOS, IM_END, builtin_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def as_bytes(text: str) -> list[int]:
    """``text`` spelled one byte token at a time (ids 0..255 are the bytes): a valid
    tokenization that re-tokenizing the text never gives back."""
    return list(text.encode())


def reply_then(reply: str, user: str) -> list[dict]:
    """Items: the assistant's ``reply``, then a user message."""
    return normalize_input([{"role": "assistant", "content": reply},
                            {"role": "user", "content": user}])  # fmt: skip


def turn(tok, items, tools=None):
    """The first turn's prompt (as the server builds it)."""
    text = render_chat_text(tok, to_messages(items), tools=tools)
    return render_prompt(tok, text)


def test_splice_keeps_generated_ids_and_spells_the_template_text(tok):
    items = normalize_input([{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "hello"}])  # fmt: skip
    first = turn(tok, items)
    output = [*as_bytes("hello world"), tok.convert_tokens_to_ids(IM_END)]
    reply = normalize_input([{"role": "assistant", "content": "hello world"}])
    new = normalize_input("and again")
    full = render_chat_text(tok, to_messages(items + reply + new))
    prompt = continue_prompt(tok, first.text, first.token_ids, output, full)
    assert prompt.token_exact
    stored = [*first.token_ids, *output]
    assert prompt.token_ids[: len(stored)] == stored
    assert tok.decode(prompt.token_ids, skip_special_tokens=False) == full == prompt.text
    # what re-rendering gives differs from the model's own ids: the cache would miss there
    rerendered = render_prompt(tok, full).token_ids
    assert rerendered[: len(stored)] != stored


def test_forced_tool_call_and_its_output_splice(tok):
    items = normalize_input("weather in Paris?")
    first = turn(tok, items, TOOLS)
    args = '{"city": "Paris"}'
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    output = [*tok(text, add_special_tokens=False).input_ids, tok.convert_tokens_to_ids(IM_END)]
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": args}  # fmt: skip
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    full = render_chat_text(tok, to_messages(normalize_input([*items, call, result])), tools=TOOLS)
    prompt = continue_prompt(tok, first.text, first.token_ids, output, full)
    assert prompt.token_exact and prompt.token_ids[: len(first.token_ids) + len(output)] == [
        *first.token_ids, *output]  # fmt: skip


def test_template_that_rewrites_history_falls_back_to_a_full_render(tok):
    numbered = "{{ messages | length }}" + CHAT_TEMPLATE  # every render changes its first line
    items = normalize_input("hello")
    text = render_chat_text(tok, to_messages(items), chat_template=numbered)
    first = render_prompt(tok, text)
    output = [*as_bytes("hi"), tok.convert_tokens_to_ids(IM_END)]
    later = items + reply_then("hi", "more")
    full = render_chat_text(tok, to_messages(later), chat_template=numbered)
    prompt = continue_prompt(tok, first.text, first.token_ids, output, full)
    assert not prompt.token_exact
    assert prompt.token_ids == tok(full, add_special_tokens=False).input_ids
    assert prompt.text == full


def test_changed_instructions_fall_back(tok):
    items = normalize_input("hello")
    sys_a = [{"role": "system", "content": "A"}]
    first = render_prompt(tok, render_chat_text(tok, sys_a + to_messages(items)))
    output = [*as_bytes("hi"), tok.convert_tokens_to_ids(IM_END)]
    later = to_messages(items + reply_then("hi", "x"))
    full = render_chat_text(tok, [{"role": "system", "content": "B"}, *later])
    assert not continue_prompt(tok, first.text, first.token_ids, output, full).token_exact


def test_a_different_final_eos_is_dropped_from_the_splice(tok):
    items = normalize_input("hello")
    first = turn(tok, items)
    eos = tok.convert_tokens_to_ids(EOS)  # the model stopped on <|end_of_text|>
    output = [*as_bytes("hi"), eos]
    full = render_chat_text(tok, to_messages(items + reply_then("hi", "more")))
    without = continue_prompt(tok, first.text, first.token_ids, output, full)
    assert not without.token_exact  # without the EOS rule the text differs at that token
    prompt = continue_prompt(tok, first.text, first.token_ids, output, full, {eos})
    assert prompt.token_exact
    kept = [*first.token_ids, *output[:-1]]
    assert prompt.token_ids[: len(kept)] == kept and prompt.token_ids[len(kept)] != eos
    assert tok.decode(prompt.token_ids, skip_special_tokens=False) == full


def test_output_cut_inside_a_character_falls_back(tok):
    items = normalize_input("hello")
    first = turn(tok, items)
    output = list("é".encode())[:1]  # half a UTF-8 character: decodes to U+FFFD
    full = render_chat_text(tok, to_messages(items + reply_then("é", "more")))
    assert not continue_prompt(tok, first.text, first.token_ids, output, full).token_exact
