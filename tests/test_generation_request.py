"""``GenerationRequest`` and ``SamplingOptions``: each protocol's schema gives every sampling field
it has, and ``TemplateServing.prepare`` turns one request into engine inputs (retention
included, refused with beam search)."""

from __future__ import annotations

import dataclasses

import pytest
from scripted_engine import ScriptedEngine

from prefixserve.api.anthropic.protocol import MessagesRequest
from prefixserve.api.frontend.inputs import TemplateServing
from prefixserve.api.frontend.protocol import APIError, ToolRequest
from prefixserve.api.frontend.request import FRONT_HALF_FIELDS, GenerationRequest, SamplingOptions
from prefixserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from prefixserve.core.sampling_params import SamplingParams
from prefixserve.kv.retention import KVRetention

# a value other than the default for every option
SET = dict(n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=3, stop=["x"],
           stop_token_ids=[4], ignore_eos=True, min_tokens=2, presence_penalty=0.5,
           frequency_penalty=0.25, repetition_penalty=1.1, cache_salt="s",
           skip_special_tokens=False, include_stop_str_in_output=True, logit_bias={"5": 1.0},
           allowed_token_ids=[5, 6], bad_words=["no"], truncate_prompt_tokens=9,
           segment_reuse=False, use_beam_search=True, length_penalty=0.5)  # fmt: skip


def test_the_options_are_the_sampling_params_the_front_half_does_not_set():
    named = {f.name for f in dataclasses.fields(SamplingParams)} - FRONT_HALF_FIELDS
    assert named | {"use_beam_search", "length_penalty"} == set(SET)


@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest])
def test_chat_and_text_completions_carry_every_option(schema):
    body = {"messages": [{"role": "user", "content": "hi"}]} if schema is ChatCompletionRequest \
        else {"prompt": "hi"}  # fmt: skip
    options = schema(**body, **SET).sampling_options()
    assert options == SamplingOptions.of(**SET)
    assert options.given == set(SET) - {"use_beam_search", "length_penalty"}
    assert options.params.logit_bias == {5: 1.0} and options.params.top_k == 7
    assert (options.use_beam_search, options.length_penalty) == (True, 0.5)
    assert schema(**body).sampling_options() == SamplingOptions()


def test_options_keep_the_engines_defaults_and_refuse_its_bad_values():
    assert SamplingOptions.of(temperature=None, stop="x").params == SamplingParams(
        max_tokens=None, stop=["x"])  # fmt: skip
    with pytest.raises(APIError, match="top_p") as err:
        SamplingOptions.of(top_p=0.0)
    assert (err.value.status, err.value.param) == (400, "top_p")
    with pytest.raises(APIError, match="not a token id"):
        SamplingOptions.of(logit_bias={"x": 1.0})
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingOptions.of(max_tokens=5)  # the front half's own field


def test_messages_carry_their_fields_and_stop_sequences():
    req = MessagesRequest(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                          stop_sequences=["END"], temperature=0.2, top_k=3, seed=1,
                          segment_reuse=False)  # fmt: skip
    options = req.sampling_options().params
    assert (options.stop, options.temperature, options.top_k, options.seed) == (["END"], 0.2, 3, 1)
    assert options.segment_reuse is False and options.n == 1


def _serving() -> TemplateServing:
    return TemplateServing(ScriptedEngine(), ["m"])


def test_prepare_gives_the_engine_its_retention_and_limits():
    retention = (KVRetention(ttl_s=60.0, num_tokens=16, session="a"),)
    request = GenerationRequest([1, 2, 3] * 8, ToolRequest(), SamplingOptions.of(temperature=0.0),
                                7, retention=retention)  # fmt: skip
    inputs = _serving().prepare(request)
    assert inputs.prompt_token_ids == request.prompt_token_ids
    assert inputs.params.kv_retention == retention and inputs.params.max_tokens == 7
    assert inputs.params.temperature == 0.0


def test_retention_with_beam_search_is_a_400():
    request = GenerationRequest([1, 2, 3], ToolRequest(), SamplingOptions.of(use_beam_search=True),
                                7, retention=(KVRetention(ttl_s=60.0),))  # fmt: skip
    with pytest.raises(APIError, match="prompt_cache_retention") as err:
        _serving().prepare(request)
    assert err.value.status == 400
