"""Offline prompts: strings, token ids and vLLM's prompt dicts, alone or mixed in a list."""

from __future__ import annotations

import pytest

from prefixserve import LLM, SamplingParams, TextPrompt, TokensPrompt
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.core.inputs import parse_prompts


@pytest.mark.parametrize(
    "prompts, parsed",
    [
        ("hi", ["hi"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ({"prompt": "hi"}, ["hi"]),
        ({"prompt_token_ids": [4, 5]}, [[4, 5]]),
        (["a", [1, 2], {"prompt": "b"}, {"prompt_token_ids": [3]}], ["a", [1, 2], "b", [3]]),
        ([], []),
    ],
)
def test_every_prompt_kind_parses(prompts, parsed):
    assert parse_prompts(prompts) == parsed


@pytest.mark.parametrize(
    "prompts, says",
    [
        ({"prompt": "x", "multi_modal_data": {}}, "multi_modal_data"),
        ({"prompt": "x", "cache_salt": "t"}, "cache_salt"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
        ({}, "exactly one"),
        ({"prompt": 3}, "must be a string"),
        ({"prompt_token_ids": "12"}, "list of token ids"),
        ([{"prompt": "ok"}, 3.5], "expected"),
        (7, "expected"),
    ],
)
def test_prompts_that_cannot_be_honoured_are_refused(prompts, says):
    with pytest.raises(InvalidArgumentError, match=says) as info:
        parse_prompts(prompts)
    assert info.value.param == "prompts"


def test_generate_takes_prompt_dicts_as_the_same_prompts():
    llm = LLM(num_kv_blocks=64)
    params = SamplingParams(max_tokens=5, temperature=0)
    ids = llm.get_tokenizer().encode("The cache")
    text: TextPrompt = {"prompt": "The cache"}
    tokens: TokensPrompt = {"prompt_token_ids": ids}
    outs = llm.generate([text, tokens, "The cache", ids], params, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["The cache", None, "The cache", None]
    single = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
