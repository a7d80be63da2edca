"""Structural tags (vLLM's two shapes): checked, rewritten for xgrammar, and enforced."""

from __future__ import annotations

import json

import pytest

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.models.builtin import builtin_model_config, builtin_tokenizer
from prefixserve.structured_outputs.manager import StructuredOutputManager
from prefixserve.structured_outputs.params import StructuredOutputsParams
from prefixserve.structured_outputs.structural_tag import (
    check_structural_tag,
    xgrammar_structural_tag,
)

TOK = builtin_tokenizer()
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LEGACY = {"structures": [{"begin": "<w>", "schema": CITY, "end": "</w>"}], "triggers": ["<w"]}
FORMAT = {"format": {"type": "tag", "begin": "<w>", "content": {"type": "json_schema",
                                                                "json_schema": CITY},
                     "end": "</w>"}}  # fmt: skip


@pytest.fixture(scope="module")
def manager():
    m = StructuredOutputManager(TOK, len(TOK), builtin_model_config().eos_token_ids)
    yield m
    m.shutdown()


def _accepts(manager, spec, text: str) -> bool:
    compiled = manager.submit(StructuredOutputsParams(structural_tag=spec)).result(timeout=30)
    grammar = manager.new_grammar(compiled)
    return all(grammar.accept_token(t) for t in TOK.encode(text, add_special_tokens=False))


def test_legacy_shape_becomes_triggered_tags_in_the_one_json_format():
    tag = xgrammar_structural_tag(LEGACY)
    fmt = tag["format"]
    assert tag["type"] == "structural_tag" and fmt["type"] == "triggered_tags"
    assert fmt["triggers"] == ["<w"] and fmt["tags"][0]["begin"] == "<w>"
    assert fmt["tags"][0]["content"]["type"] == "grammar"  # json_grammar's format, not xgrammar's
    assert xgrammar_structural_tag(FORMAT) == {"type": "structural_tag", **FORMAT}


@pytest.mark.parametrize("spec", [LEGACY, json.dumps(LEGACY)])
def test_legacy_tags_constrain_only_after_a_trigger(manager, spec):
    assert _accepts(manager, spec, 'free text <w>{"city": "Rome"}</w> more text')
    assert not _accepts(manager, spec, 'free text <w>{"town": "Rome"}</w>')
    assert not _accepts(manager, spec, 'free text <w>{"city":"Rome"}</w>')  # not the one format


def test_format_shape_is_compiled_as_given(manager):
    assert _accepts(manager, FORMAT, '<w>{"city": "Rome"}</w>')
    assert not _accepts(manager, FORMAT, 'x<w>{"city": "Rome"}</w>')


@pytest.mark.parametrize(
    "spec, says",
    [
        ({}, "give"),
        ({**LEGACY, **FORMAT}, "give"),
        ({"format": "tag"}, "format"),
        ({"structures": [], "triggers": ["<"]}, "non-empty list"),
        ({"structures": LEGACY["structures"]}, "triggers"),
        ({"structures": [{"begin": "<w>"}], "triggers": ["<"]}, "'begin' and 'end'"),
        ({"structures": [{"begin": "<w>", "end": "", "schema": 3}], "triggers": ["<"]}, "schema"),
        ({"structures": LEGACY["structures"], "triggers": ["["]}, "none of the triggers"),
    ],
)
def test_bad_shapes_are_refused(spec, says):
    with pytest.raises(InvalidArgumentError, match=says):
        check_structural_tag(spec)
    with pytest.raises(InvalidArgumentError):
        StructuredOutputsParams(structural_tag=spec)


def test_a_format_xgrammar_refuses_fails_to_compile(manager):
    params = StructuredOutputsParams(structural_tag={"format": {"type": "bogus"}})
    error = manager.submit(params).exception(timeout=30)
    assert isinstance(error, InvalidArgumentError) and "structural tag" in str(error)
    assert error.param == "structured_outputs"
