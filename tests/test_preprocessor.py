"""``RequestPreprocessor`` alone: what it tokenizes, truncates, refuses (with which message and
parameter) and submits; and that a request's grammar is compiled once, whatever the entry."""

from __future__ import annotations

import pytest

from prefixserve import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError, PromptTooLongError
from prefixserve.engine.preprocessor import PreparedRequest, RequestPreprocessor, StepLimits
from prefixserve.models.builtin import builtin_tokenizer
from prefixserve.structured_outputs.manager import StructuredOutputManager

TOKENIZER = builtin_tokenizer()
VOCAB = len(TOKENIZER)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def grammars():
    manager = StructuredOutputManager(TOKENIZER, VOCAB)
    yield manager
    manager.shutdown()


def make(grammars, max_model_len: int = 64, **config) -> RequestPreprocessor:
    limits = StepLimits.of(EngineConfig(**config))
    return RequestPreprocessor(TOKENIZER, VOCAB, max_model_len, limits, grammars)


def test_text_is_tokenized_ids_are_kept_and_the_limit_is_prompt_plus_max_tokens(grammars):
    pre = make(grammars)
    prepared = pre.process("hello world", SamplingParams(max_tokens=5))
    assert prepared.prompt == "hello world"
    assert list(prepared.prompt_token_ids) == TOKENIZER.encode("hello world")
    assert prepared.max_total_tokens == len(prepared.prompt_token_ids) + 5
    ids = pre.process([5, 6, 7], SamplingParams(max_tokens=None))
    assert ids.prompt is None and ids.prompt_token_ids == (5, 6, 7)
    assert ids.max_total_tokens == 64  # no max_tokens: up to the context
    assert ids.grammar is None and ids.width == 1


def test_truncation_keeps_the_last_tokens_and_drops_the_text(grammars):
    pre = make(grammars)
    prepared = pre.process("abcdefgh", SamplingParams(truncate_prompt_tokens=3))
    assert prepared.prompt is None
    assert list(prepared.prompt_token_ids) == TOKENIZER.encode("abcdefgh")[-3:]


@pytest.mark.parametrize(
    ("prompt", "params", "error", "param", "match"),
    [
        ([], SamplingParams(), InvalidArgumentError, "prompt", "must not be empty"),
        ([VOCAB], SamplingParams(), InvalidArgumentError, "prompt", "outside the vocabulary"),
        ([1] * 64, SamplingParams(), PromptTooLongError, "prompt", "maximum context length is 64"),
        ([1] * 60, SamplingParams(max_tokens=5), PromptTooLongError, "max_tokens", "you requested 65"),
        ([1], SamplingParams(stop_token_ids=[VOCAB + 1]), InvalidArgumentError, "stop_token_ids", "outside"),
        ([1], SamplingParams(n=9), InvalidArgumentError, "n", "9 sequences"),
        ([1], BeamSearchParams(beam_width=9, max_tokens=4), InvalidArgumentError, "n", "9 sequences"),
        ({"prompt": "x"}, SamplingParams(), InvalidArgumentError, "prompt", "string or a list"),
    ],
)  # fmt: skip
def test_refusals_name_the_parameter(grammars, prompt, params, error, param, match):
    pre = make(grammars, max_num_seqs=8)
    with pytest.raises(error, match=match) as info:
        pre.process(prompt, params)
    assert info.value.param == param


def test_whole_prompts_only_without_chunked_prefill(grammars):
    pre = make(grammars, max_model_len=512, enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(PromptTooLongError, match="max_num_batched_tokens=16"):
        pre.process([1] * 17, SamplingParams(max_tokens=1))
    assert pre.process([1] * 16, SamplingParams(max_tokens=1)).prompt_token_ids == (1,) * 16


def test_bad_words_alone_and_after_a_space(grammars):
    prepared = make(grammars).process([1], SamplingParams(bad_words=["cat"]))
    expected = {tuple(TOKENIZER.encode(t, add_special_tokens=False)) for t in ("cat", " cat")}
    assert set(prepared.bad_words_token_ids) == expected


def test_the_grammar_is_submitted_at_preparation(grammars):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prepared = make(grammars).process([1, 2], params)
    assert isinstance(prepared, PreparedRequest)
    assert prepared.grammar is not None and prepared.grammar.result(timeout=30) is not None


def test_offline_generate_compiles_each_grammar_once():
    llm = LLM()
    params = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json={**SCHEMA, "title": "once"})
    )
    llm.generate(["a"], params, use_tqdm=False)
    so = llm.llm_engine.stats().structured_outputs
    assert (so["num_compiles"], so["num_cache_hits"]) == (1, 0)
    with pytest.raises(InvalidArgumentError, match="regular expression"):
        llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert not llm.llm_engine.has_unfinished_requests()
