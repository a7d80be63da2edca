"""``api/parsing/reasoning.py``: where an output starts (from prompts the real Qwen3 and
DeepSeek-R1 templates render), what is reasoning and what is content, streamed == whole."""

from __future__ import annotations

import pytest
from families import family_tokenizer

from prefixserve.api.parsing.reasoning import (
    count_reasoning_tokens,
    reasoning_ahead,
    reasoning_parser,
    starts_in_reasoning,
)
from prefixserve.engine.chat_template import render_chat

USER = [{"role": "user", "content": "Is 7 prime?"}]


def _prompt(family: str, **kwargs) -> str:
    tok = family_tokenizer(family)
    return tok.decode(render_chat(tok, USER, chat_template_kwargs=kwargs or None))


def test_where_the_output_starts_follows_the_real_templates():
    r1 = _prompt("deepseek_r1")
    assert r1.endswith("<think>\n")
    assert starts_in_reasoning("deepseek_r1", r1) and reasoning_ahead("deepseek_r1", r1)
    thinking = _prompt("qwen3")
    assert not starts_in_reasoning("qwen3", thinking) and reasoning_ahead("qwen3", thinking)
    off = _prompt("qwen3", enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("qwen3", off) and not reasoning_ahead("qwen3", off)
    assert not reasoning_ahead("deepseek_r1", off)  # a closed block: no reasoning either way


@pytest.mark.parametrize(
    "family, prompt, text, expected",
    [
        ("qwen3", "", "<think>\nsmall\n</think>\n\nYes.", ("\nsmall\n", "Yes.")),
        ("qwen3", "", "  <think>a</think>b", ("a", "b")),
        ("qwen3", "", "Yes, no thinking.", (None, "Yes, no thinking.")),
        ("qwen3", "", "Yes </think> later", (None, "Yes </think> later")),
        ("qwen3", "", "<think>cut off by max_tokens", ("cut off by max_tokens", None)),
        ("qwen3", "x<think>\n", "inside</think>out", ("inside", "out")),
        ("qwen3", "<think>\n\n</think>\n\n", "Plain answer", (None, "Plain answer")),
        ("deepseek_r1", "<think>\n", "step 1</think>\n\n42", ("step 1", "42")),
        ("deepseek_r1", "<think>\n", "<think>\nstep</think>42", ("\nstep", "42")),
        ("deepseek_r1", "<think>\n", "never closed", ("never closed", None)),
        ("deepseek_r1", "<think>\n", "a</think>b</think>c", ("a", "b</think>c")),
        ("deepseek_r1", "", "r</think>", ("r", None)),
    ],
)
def test_extract_and_every_split_of_the_stream_agree(family, prompt, text, expected):
    assert reasoning_parser(family, prompt).extract(text) == expected
    for cut in range(len(text) + 1):
        for step in (1, 3):
            parser = reasoning_parser(family, prompt)
            pieces = [text[:cut]] + [text[i : i + step] for i in range(cut, len(text), step)]
            reasoning = content = ""
            for i, piece in enumerate(pieces):
                r, c = parser.feed(piece, final=i == len(pieces) - 1)
                reasoning, content = reasoning + r, content + c
            assert (reasoning if parser.has_reasoning else None, content or None) == expected


def test_stream_holds_back_only_what_may_be_a_tag():
    parser = reasoning_parser("deepseek_r1", "<think>\n")
    assert parser.feed("thinking </th") == ("thinking ", "")
    assert parser.feed("inking") == ("</thinking", "")  # not the tag after all
    assert parser.feed("</think>") == ("", "")
    assert parser.feed("\n\n") == ("", "")  # newlines before the answer are dropped
    assert parser.feed("Answer") == ("", "Answer")


def test_reasoning_tokens_count_through_the_end_tag():
    tok = family_tokenizer("qwen3")
    ids = tok.encode("<think>\nhm\n</think>\n\nYes", add_special_tokens=False)
    end = tok.convert_tokens_to_ids("</think>")
    assert count_reasoning_tokens(tok, ids, "\nhm\n") == ids.index(end) + 1
    assert count_reasoning_tokens(tok, ids, None) == 0
    open_ids = tok.encode("<think>\nstill going", add_special_tokens=False)
    assert count_reasoning_tokens(tok, open_ids, "\nstill going") == len(open_ids)


def test_a_qwen3_turn_re_renders_from_its_parts_in_the_real_template():
    """Reasoning, then a hermes call, in the shape Qwen3 writes: split into reasoning_content
    and tool_calls, the tool loop's next prompt contains the output byte for byte."""
    from prefixserve.api.parsing.tool_calls import tool_call_parser

    tok = family_tokenizer("qwen3")
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}}}]
    prompt = tok.decode(render_chat(tok, USER, tools=tools))
    output = '<think>\nSeven has no divisors.\n</think>\n\n<tool_call>\n{"name": "pick", "arguments": {"n": 7}}\n</tool_call>'
    reasoning, content = reasoning_parser("qwen3", prompt).extract(output)
    _, calls = tool_call_parser("hermes", tools).parse(content)
    call = {"id": calls[0].id, "type": "function",
            "function": {"name": calls[0].name, "arguments": calls[0].arguments}}
    history = [*USER, {"role": "assistant", "content": "", "reasoning_content": reasoning,
                       "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]  # fmt: skip
    assert tok.decode(render_chat(tok, history, tools=tools)).startswith(prompt + output)
