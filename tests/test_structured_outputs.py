"""Structured outputs in the engine: every output a constrained request gets matches its
grammar, whatever the (random-weight) model, in every engine mode: n > 1, beam search,
preemption, stop strings, prefix caching, jump-forward; grammars compile off the engine's way and
a bad one fails its request alone. Without the constraint these models never write valid JSON."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from prefixserve import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from prefixserve.core.errors import InvalidArgumentError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe not"]
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def check_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


CASES = {
    "json": (StructuredOutputsParams(json=PERSON), check_json),
    "json_object": (StructuredOutputsParams(json_object=True), check_object),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or 1 / 0),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: CHOICES.index(t)),
    "grammar": (
        StructuredOutputsParams(grammar=EBNF),
        lambda t: re.fullmatch(r"\((\d|x)(,(\d|x))*\)", t) or 1 / 0,
    ),
}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=512, block_size=16)


def constrained(so: StructuredOutputsParams, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 200)
    return SamplingParams(temperature=1.0, structured_outputs=so, **kw)


@pytest.mark.parametrize("kind", list(CASES))
def test_every_sample_matches_its_grammar(llm, kind):
    so, check = CASES[kind]
    prompts = ["Answer in the required format: ", "Another question. "]
    params = [constrained(so, n=4, seed=seed) for seed in (1, 2)]
    samples = [c for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]
    done = [c for c in samples if c.finish_reason == "stop"]
    for c in done:
        check(c.text)
    if kind == "json_object":  # any key is allowed: a random model may write a long one
        assert len(done) >= 4 and all(c.text.startswith("{") for c in samples)
    else:
        assert len(done) == len(samples) == 8


def test_without_the_constraint_these_models_write_no_json(llm):
    """The reason the tests above mean something: free sampling is not JSON."""
    outs = llm.generate(["{"] * 2, SamplingParams(temperature=1.0, max_tokens=40, n=4, seed=3),
                        use_tqdm=False)  # fmt: skip
    for c in (c for o in outs for c in o.outputs):
        with pytest.raises(ValueError):
            check_json(c.text)


def test_beam_search_scores_only_allowed_tokens(llm):
    so = StructuredOutputsParams(regex=REGEX)
    out = llm.beam_search(
        ["Code: "], BeamSearchParams(beam_width=4, max_tokens=20, structured_outputs=so)
    )
    assert len(out[0].outputs) == 4
    for c in out[0].outputs:
        assert re.fullmatch(REGEX, c.text), c.text
        assert c.finish_reason == "stop"


def test_stop_strings_and_max_tokens_still_end_a_sequence(llm):
    so = StructuredOutputsParams(regex="a{40}")
    short = llm.generate("x", constrained(so, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) <= 5
    assert set(short.text) <= {"a"}
    stopped = llm.generate("x", constrained(so, stop=["aaa"]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "aaa"


def test_a_prompt_shares_its_blocks_whether_constrained_or_not(llm):
    llm.reset_prefix_cache()
    prompt = "A shared system prompt, long enough for several blocks of the cache. " * 3
    llm.generate(prompt + "free", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    out = llm.generate(prompt + "json", constrained(CASES["json"][0]), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 16 * (len(out.prompt_token_ids) // 16 - 1)
    check_json(out.outputs[0].text)


def test_preemption_keeps_the_grammar_state_without_double_accepts():
    so = StructuredOutputsParams(json=PERSON)
    prompts = [f"Person number {i}: " * 3 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
    roomy = LLM(num_kv_blocks=256, block_size=8).generate(prompts, params, use_tqdm=False)
    tight = LLM(num_kv_blocks=40, block_size=8)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    for o in outs:  # every token the grammar accepted once: a double accept would break this
        grammar = o.outputs[0]
        assert grammar.finish_reason in ("stop", "length")
        if grammar.finish_reason == "stop":
            check_json(grammar.text)
    assert tight.cache_stats()["used_blocks"] == 0


def test_jump_forward_appends_forced_text_and_saves_steps():
    schema = {
        "type": "object",
        "properties": {"first_name": {"type": "string", "maxLength": 6},
                       "last_name": {"type": "string", "maxLength": 6}},
        "required": ["first_name", "last_name"],
    }  # fmt: skip
    so = StructuredOutputsParams(json=schema)
    steps = {}
    for jump in (True, False):
        llm = LLM(enable_jump_forward=jump)
        out = llm.generate("Name: ", constrained(so, seed=0), use_tqdm=False)[0].outputs[0]
        jsonschema.validate(json.loads(out.text), schema)
        steps[jump] = llm.llm_engine.stats().num_steps
        if jump:  # the forced opening was prefilled with the prompt: one step, then sampling
            assert out.text.startswith('{"first_name": "')
    assert steps[True] < steps[False] - 8  # the keys and punctuation were not sampled


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llm):
    engine = llm.llm_engine
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= nowhere"))
    engine.add_request("bad-grammar", "x", bad)  # the offline API checks first; the engine alone
    engine.add_request("fine", "y", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "nowhere" in finals["bad-grammar"].error
    assert finals["fine"].error is None and len(finals["fine"].outputs[0].token_ids) == 3
    with pytest.raises(InvalidArgumentError, match="nowhere"):
        llm.generate("x", bad, use_tqdm=False)  # the offline API refuses it up front


def test_a_slow_compile_does_not_delay_other_requests(llm, monkeypatch):
    engine = llm.llm_engine
    manager = engine.structured_outputs
    release = threading.Event()
    build = manager._build

    def slow_build(params):
        release.wait(timeout=30)
        return build(params)

    monkeypatch.setattr(manager, "_build", slow_build)
    so = StructuredOutputsParams(regex="slow[0-9]")
    engine.add_request("slow", "x", SamplingParams(max_tokens=8, structured_outputs=so))
    engine.add_request("quick", "y", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finished = set()
    for _ in range(10):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "quick" in finished and "slow" not in finished
    assert engine.stats().num_waiting == 1 and engine.stats().kv_cache["used_blocks"] == 0
    release.set()
    deadline = time.monotonic() + 30
    while "slow" not in finished and time.monotonic() < deadline:
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "slow" in finished
