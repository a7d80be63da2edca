"""Grammar-constrained decoding core: params, compile cache, per-sequence grammars, bitmasks.

Outputs are sampled from RANDOM logits under the mask, so every check below fails if the
constraint is removed. Sampling is argmax over masked ``torch.randn`` logits: a uniform draw among
the allowed tokens. The manager is built with a vocab wider than the tokenizer's, as a model with
a padded ``lm_head`` would be.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.models.builtin import builtin_model_config, builtin_tokenizer
from prefixserve.structured_outputs.grammar import Grammar, allocate_bitmask, apply_bitmask
from prefixserve.structured_outputs.manager import StructuredOutputManager
from prefixserve.structured_outputs.params import StructuredOutputsParams, ToolCallSpec
from prefixserve.structured_outputs.tool_calls import parse_tool_calls, tool_call_params

TOK = builtin_tokenizer()
EOS_IDS = builtin_model_config().eos_token_ids  # <|end_of_text|>, <|im_end|>
VOCAB = len(TOK) + 20  # logits wider than the tokenizer
BOS_ID, IM_START_ID = TOK.convert_tokens_to_ids(["<|begin_of_text|>", "<|im_start|>"])
SEEDS = range(6)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "home"],
    "$defs": {
        "place": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "city": {"type": "string", "maxLength": 8}},
            "required": ["lat"],
        }
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}  # no parameters: arguments are {}
TOOLS = [WEATHER, NOOP]


@pytest.fixture(scope="module")
def manager():
    m = StructuredOutputManager(TOK, VOCAB, stop_token_ids=EOS_IDS)
    yield m
    m.shutdown()


def compiled(manager: StructuredOutputManager, **kwargs):
    return manager.submit(StructuredOutputsParams(**kwargs)).result(timeout=30)


def sample(grammar: Grammar, seed: int, max_steps: int = 5000) -> list[int]:
    """Tokens drawn from masked random logits until the grammar terminates (EOS included)."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, VOCAB)
    tokens: list[int] = []
    while not grammar.is_terminated():
        assert len(tokens) < max_steps, "grammar did not terminate"
        grammar.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, VOCAB, generator=gen)
        apply_bitmask(logits, bitmask)
        token = int(logits.argmax())
        assert grammar.accept_token(token)
        tokens.append(token)
    assert tokens[-1] in EOS_IDS
    assert all(t < len(TOK) for t in tokens), "a padded vocab id was sampled"
    return tokens


def sample_text(manager, compiled_grammar, seed: int) -> str:
    return TOK.decode(sample(manager.new_grammar(compiled_grammar), seed), skip_special_tokens=True)


def allowed(grammar: Grammar) -> set[int]:
    bitmask = allocate_bitmask(1, VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, bitmask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def accept_text(grammar: Grammar, text: str) -> bool:
    return all(grammar.accept_token(t) for t in TOK.encode(text, add_special_tokens=False))


# --- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({}, "got none"),
        ({"json": PERSON, "regex": "a"}, "got json and regex"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1, 2]}, "JSON schema"),
        ({"json": {"x": {1, 2}}}, "cannot be written as JSON"),
        ({"regex": ""}, "non-empty string"),
        ({"grammar": 5}, "non-empty string"),
        ({"choice": []}, "non-empty list"),
        ({"choice": "yes"}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty string"),
        ({"json_object": "yes"}, "true or false"),
        ({"tool_calls": "x"}, "tool_call_params"),
    ],
)
def test_params_reject_with_a_message_that_says_what_to_change(kwargs, says):
    with pytest.raises(InvalidArgumentError, match=says) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == "structured_outputs"


def test_params_kind_and_key():
    as_dict = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}}})
    as_text = StructuredOutputsParams(json='{"type":  "object", "properties": {"a": {}}}')
    reordered = StructuredOutputsParams(json={"properties": {"a": {}}, "type": "object"})
    assert as_dict.kind == "json" and as_dict.key == as_text.key
    assert reordered.key != as_dict.key  # property order is generation order: not sorted
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=["x", "y"]).key == ("choice", '["x","y"]')
    assert StructuredOutputsParams(regex="a+").key == ("regex", "a+")
    assert tool_call_params(TOOLS, None, True).kind == "tool_calls"
    assert len({as_dict.key, as_text.key, reordered.key}) == 2  # hashable


# --- compiling ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"json": {"type": "nope"}}, 'Unsupported type "nope"'),
        ({"json": {"$ref": "#/missing"}}, "missing"),
        ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "minLength"),
        ({"regex": "a(b"}, "parenthesis"),
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ({"grammar": 'root ::= "unterminated'}, "string literal"),
    ],
)
def test_bad_grammar_is_an_invalid_argument_on_the_future(manager, kwargs, says):
    params = StructuredOutputsParams(**kwargs)
    error = manager.submit(params).exception(timeout=30)
    assert isinstance(error, InvalidArgumentError) and error.param == "structured_outputs"
    assert says in str(error) and not str(error).startswith("[")  # log prefix stripped
    compiles = manager.num_compiles
    with pytest.raises(InvalidArgumentError, match=re.escape(says)):
        manager.validate(params)
    assert manager.num_compiles == compiles + 1  # failures are not cached


def test_identical_keys_share_one_compile_and_count_a_hit():
    m = StructuredOutputManager(TOK, VOCAB, stop_token_ids=EOS_IDS)
    first = m.submit(StructuredOutputsParams(json={"type": "object", "properties": {"k": {}}}))
    second = m.submit(StructuredOutputsParams(json='{"type": "object", "properties": {"k": {}}}'))
    assert second is first
    first.result(timeout=30)
    assert (m.num_compiles, m.num_cache_hits) == (1, 1)
    m.validate(StructuredOutputsParams(regex="[0-9]+"))
    stats = m.stats()
    assert (stats["num_compiles"], stats["num_cache_hits"]) == (2, 1)
    histogram = stats["compile_seconds"]
    assert histogram["count"] == 2 and histogram["buckets"][-1] == (float("inf"), 2)
    assert histogram["sum"] > 0
    m.shutdown()


def test_compile_runs_in_the_pool_and_concurrent_submits_share_it(monkeypatch):
    m = StructuredOutputManager(TOK, VOCAB, stop_token_ids=EOS_IDS)
    threads, build = [], m._build

    def slow_build(params):
        threads.append(threading.current_thread())
        time.sleep(0.2)
        return build(params)

    monkeypatch.setattr(m, "_build", slow_build)
    params = StructuredOutputsParams(regex="x{3}")
    start = time.perf_counter()
    futures = [m.submit(params) for _ in range(4)]
    assert time.perf_counter() - start < 0.1  # the caller did not wait for the compile
    callers = [threading.Thread(target=m.submit, args=(params,)) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert all(f is futures[0] for f in futures) and futures[0].result(timeout=30)
    assert threads and threads[0] is not threading.current_thread()
    assert threads[0].name.startswith("structured-outputs")
    assert (m.num_compiles, m.num_cache_hits) == (1, 7)
    m.shutdown()


def test_cache_is_bounded_in_bytes():
    m = StructuredOutputManager(TOK, VOCAB, stop_token_ids=EOS_IDS, cache_limit_bytes=1)
    m.validate(StructuredOutputsParams(regex="a"))
    m.validate(StructuredOutputsParams(regex="a"))
    assert (m.num_compiles, m.num_cache_hits) == (2, 0)  # evicted as soon as it was compiled
    m.shutdown()


# --- outputs under random logits ---------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_outputs_validate(manager, seed):
    text = sample_text(manager, compiled(manager, json=PERSON), seed)
    jsonschema.validate(json.loads(text), PERSON)
    assert list(json.loads(text))[:2] == ["name", "age"]  # declared order
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
    assert not re.search(r"\s", re.sub(r"(, |: )", "", outside_strings))  # only the separators


def test_length_limited_strings_exclude_control_characters(manager):
    # xgrammar 0.2.9 alone lets raw control characters into strings with minLength/maxLength.
    grammar = manager.new_grammar(compiled(manager, json=PERSON))
    assert accept_text(grammar, '{"name": "a')
    assert not grammar.accept_token(0x1F) and not grammar.accept_token(0x01)
    assert grammar.accept_token(ord("\x7f")) and accept_text(grammar, '", ')


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_outputs_are_objects(manager, seed):
    value = json.loads(sample_text(manager, compiled(manager, json_object=True), seed))
    assert isinstance(value, dict)


def test_json_object_and_schemas_use_the_template_separators(manager):
    obj = manager.new_grammar(compiled(manager, json_object=True))
    assert accept_text(obj.fork(), '{"a": [1, {"b": null}], "c": "d"}')
    assert not accept_text(obj.fork(), '{"a":1}')
    assert not accept_text(obj.fork(), '{ "a": 1}')
    assert not accept_text(obj, '\n{"a": 1}')


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_outputs_match(manager, seed):
    pattern = r"(\d{3}-)?[a-z]{2,8}(@[a-z]+\.(com|org))?"
    assert re.fullmatch(pattern, sample_text(manager, compiled(manager, regex=pattern), seed))


def test_choice_outputs_are_members(manager):
    choices = ["yes", "no", 'say "hi"\n', "é \\ ok"]
    grammar = compiled(manager, choice=choices)
    texts = {sample_text(manager, grammar, seed) for seed in range(12)}
    assert texts <= set(choices) and len(texts) > 1


@pytest.mark.parametrize("seed", SEEDS)
def test_ebnf_outputs_parse(manager, seed):
    ebnf = 'root ::= pair ("," pair)*\npair ::= "(" [a-c] " " root? ")"'
    text = sample_text(manager, compiled(manager, grammar=ebnf), seed)
    assert re.fullmatch(r"[(),a-c ]+", text) and _balanced(text)


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


# --- EOS, special tokens, fork, rollback ------------------------------------------------------


def test_eos_is_allowed_exactly_when_the_grammar_can_end(manager):
    grammar = manager.new_grammar(compiled(manager, regex="ab?"))
    a, b, ab = TOK.convert_tokens_to_ids(["a", "b", "ab"])
    assert allowed(grammar) == {a, ab}
    assert not grammar.accept_token(EOS_IDS[0])  # rejected, state unchanged
    assert grammar.accept_token(a)
    assert allowed(grammar) == {b, *EOS_IDS}  # may end or go on
    assert grammar.accept_token(b)
    assert allowed(grammar) == set(EOS_IDS)  # complete: only EOS
    assert not grammar.is_terminated()
    assert grammar.accept_token(EOS_IDS[1])
    assert grammar.is_terminated()
    assert not grammar.accept_token(a)


def test_special_tokens_are_never_text(manager):
    grammar = manager.new_grammar(compiled(manager, regex=r"[a-z<|>_/]*x"))
    ids = allowed(grammar)
    assert TOK.convert_tokens_to_ids("<") in ids and TOK.convert_tokens_to_ids("<tool_call>") in ids
    assert BOS_ID not in ids and IM_START_ID not in ids and not ids & set(EOS_IDS)
    assert not grammar.accept_token(IM_START_ID)


def test_fork_keeps_independent_states(manager):
    grammar = manager.new_grammar(compiled(manager, choice=["the cat", "the dog"]))
    assert accept_text(grammar, "the ")
    other = grammar.fork()
    assert accept_text(grammar, "cat") and accept_text(other, "dog")
    assert allowed(grammar) == allowed(other) == set(EOS_IDS)
    assert not other.fork().accept_token(TOK.convert_tokens_to_ids("c"))
    assert other.accept_token(EOS_IDS[0]) and other.is_terminated()
    assert not grammar.is_terminated()


def test_rollback(manager):
    grammar = manager.new_grammar(compiled(manager, choice=["ab", "ac"]))
    a, b, c = TOK.convert_tokens_to_ids(["a", "b", "c"])
    assert grammar.accept_token(a) and grammar.accept_token(b)
    grammar.rollback(1)
    assert allowed(grammar) == {b, c}
    assert grammar.accept_token(c) and grammar.accept_token(EOS_IDS[0])
    grammar.rollback(2)  # through the stop token
    assert not grammar.is_terminated() and allowed(grammar) == {b, c}


# --- jump-forward -------------------------------------------------------------------------------


def test_jump_forward_on_fixed_keys(manager):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    grammar = manager.new_grammar(compiled(manager, json=schema))
    assert grammar.jump_forward_string() == '{"name": "'
    tokens = grammar.jump_forward_tokens()
    assert TOK.decode(tokens) == '{"name": "'
    assert all(grammar.accept_token(t) for t in tokens)
    assert grammar.jump_forward_string() == ""  # the model writes the name
    assert accept_text(grammar, 'Bo"')
    assert grammar.jump_forward_string() == ', "age": '


class _StubTokenizer:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.token_ids


def test_jump_forward_tokens_only_when_bytes_and_grammar_agree(manager):
    grammar = manager.new_grammar(compiled(manager, regex="hello world"))
    good = TOK.encode("hello world", add_special_tokens=False)
    assert grammar.jump_forward_tokens() == good

    def with_tokenizer(token_ids: list[int]) -> Grammar:
        return Grammar(grammar.matcher, grammar._decoded_vocab, _StubTokenizer(token_ids))

    assert with_tokenizer(good[:-1]).jump_forward_tokens() == []  # wrong bytes
    assert with_tokenizer([BOS_ID, *good]).jump_forward_tokens() == []  # not accepted
    assert with_tokenizer([VOCAB + 5]).jump_forward_tokens() == []
    assert TOK.convert_tokens_to_ids("hello") in allowed(grammar)


# --- bitmask ------------------------------------------------------------------------------------


def test_apply_bitmask_only_touches_the_given_rows(manager):
    grammar = manager.new_grammar(compiled(manager, regex="[0-9]"))
    bitmask = allocate_bitmask(3, VOCAB)
    grammar.fill_bitmask(bitmask, 1)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, VOCAB).to(dtype)
        before = logits.clone()
        apply_bitmask(logits, bitmask, rows=[1])
        assert torch.equal(logits[[0, 2]], before[[0, 2]])
        kept = torch.nonzero(logits[1] > float("-inf")).flatten().tolist()
        assert kept == TOK.convert_tokens_to_ids(list("0123456789"))
        assert torch.isneginf(logits[1, len(TOK) :]).all()  # padded ids are masked


def test_fill_bitmasks_in_a_batch_equals_one_by_one(manager):
    grammars = [manager.new_grammar(compiled(manager, regex=r)) for r in ("[0-9]", "ab", "x|yz")]
    batch, single = allocate_bitmask(4, VOCAB), allocate_bitmask(4, VOCAB)
    manager.fill_bitmasks(grammars, batch, rows=[0, 1, 3])
    for g, row in zip(grammars, [0, 1, 3]):
        g.fill_bitmask(single, row)
    assert torch.equal(batch, single)


@pytest.mark.gpu
def test_apply_bitmask_on_cuda_matches_cpu(manager):
    grammar = manager.new_grammar(compiled(manager, json=PERSON))
    bitmask = allocate_bitmask(2, VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    logits = torch.randn(2, VOCAB)
    on_gpu = logits.cuda()
    apply_bitmask(logits, bitmask, rows=[0])
    apply_bitmask(on_gpu, bitmask, rows=[0])
    assert torch.equal(on_gpu.cpu(), logits)


# --- forced tool calls --------------------------------------------------------------------------


def _render_calls(calls: list[tuple[str, str | dict]]) -> str:
    """The assistant turn's text after ``<|im_start|>assistant\\n``, as the template renders it."""
    tool_calls = [
        {"type": "function", "function": {"name": n, "arguments": a}, "id": f"call_{i}"}
        for i, (n, a) in enumerate(calls)
    ]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
    ]
    text = TOK.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    body = text.rsplit("<|im_start|>assistant\n", 1)[1]
    assert body.endswith("<|im_end|>\n")
    return body[: -len("<|im_end|>\n")]


def _parse_calls(text: str) -> list[tuple[str, str]]:
    """(name, raw arguments text) of each call; the whole text must be complete calls."""
    calls, end = parse_tool_calls(text)
    assert end == len(text), text[end:]
    return calls


@pytest.mark.parametrize(
    "calls",
    [
        [("get_weather", '{"city": "Paris", "days": 3}')],
        [("get_weather", {"city": "Paris", "days": 3, "unit": "c"})],
        [("noop", {})],
        [("get_weather", {"city": "Rome", "days": 1}), ("noop", {})],
    ],
)
def test_tool_call_grammar_accepts_the_template_rendering_byte_for_byte(manager, calls):
    text = _render_calls(calls)
    parallel = manager.new_grammar(manager.submit(tool_call_params(TOOLS, None, True)).result())
    single = manager.new_grammar(manager.submit(tool_call_params(TOOLS, None, False)).result())
    assert accept_text(parallel, text) and parallel.accept_token(EOS_IDS[1])  # the prompt's tokens
    assert accept_text(single, text) == (len(calls) == 1)
    if len(calls) == 1:
        assert single.accept_token(EOS_IDS[1]) and single.is_terminated()


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_tool_calls_parse_validate_and_rerender_identically(manager, seed):
    grammar = manager.submit(tool_call_params(TOOLS, None, parallel=True)).result()
    text = sample_text(manager, grammar, seed)
    calls = _parse_calls(text)
    assert calls
    for name, arguments in calls:
        if name == "noop":
            assert arguments == "{}"
        else:
            jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert _render_calls(calls) == text  # the next turn's prompt holds exactly this text


def test_named_tool_call_is_forced_up_to_the_arguments(manager):
    compiled_grammar = manager.submit(tool_call_params(TOOLS, "get_weather", True)).result()
    grammar = manager.new_grammar(compiled_grammar)
    assert grammar.jump_forward_string() == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    )
    tokens = grammar.jump_forward_tokens()
    assert tokens[0] == TOK.convert_tokens_to_ids("<tool_call>")  # the template's own token
    for seed in SEEDS:
        calls = _parse_calls(sample_text(manager, compiled_grammar, seed))
        assert [name for name, _ in calls] == ["get_weather"]  # one call: a name is not parallel


@pytest.mark.parametrize("parameters", [None, {}])
def test_tool_without_parameters_is_called_with_empty_arguments(manager, parameters):
    function = {"name": "ping"} if parameters is None else {"name": "ping", "parameters": parameters}
    tools = [{"type": "function", "function": function}]
    compiled_grammar = manager.submit(tool_call_params(tools, "ping", False)).result()
    for seed in SEEDS:
        assert _parse_calls(sample_text(manager, compiled_grammar, seed)) == [("ping", "{}")]
    grammar = manager.new_grammar(compiled_grammar)
    assert grammar.jump_forward_string() == '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert not accept_text(manager.new_grammar(compiled_grammar), _render_calls([("ping", {"a": 1})]))


def test_tool_choice_errors():
    with pytest.raises(InvalidArgumentError, match="not in tools") as info:
        tool_call_params(TOOLS, "get_time", parallel=False)
    assert info.value.param == "tool_choice" and "'get_weather'" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="tools is empty") as info:
        tool_call_params([], None, parallel=False)
    assert info.value.param == "tool_choice"
    for bad in ({"type": "function", "function": {"name": 'a"b'}}, {"type": "function"}):
        with pytest.raises(InvalidArgumentError) as info:
            tool_call_params([bad], None, parallel=False)
        assert info.value.param == "tools"


def test_bad_tool_parameters_fail_to_compile(manager):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    error = manager.submit(tool_call_params([bad], "f", parallel=False)).exception(timeout=30)
    assert isinstance(error, InvalidArgumentError) and error.param == "tools"


def test_tool_call_spec_is_one_function_when_named():
    params = tool_call_params(TOOLS, "noop", parallel=True)
    assert params.tool_calls == ToolCallSpec((("noop", None),), parallel=False)
