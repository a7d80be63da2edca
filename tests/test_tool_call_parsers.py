"""``api/parsing/tool_calls.py`` and the forced syntaxes of
``prefixserve/structured_outputs/tool_call_syntaxes.py``, on each family's real chat template:
what each parser reads, streamed == whole for every split, and that a forced call the grammar
accepts is parsed into the call whose next-turn rendering is the generated text, byte for byte."""

from __future__ import annotations

import json

import pytest
from families import family_tokenizer

from prefixserve.api.parsing.tool_calls import TOOL_CALL_PARSERS, ParsedCall, tool_call_parser
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.engine.chat_template import render_chat
from prefixserve.structured_outputs.manager import StructuredOutputManager
from prefixserve.structured_outputs.tool_calls import tool_call_params

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days"],
}
ADD = {"type": "object", "required": ["a", "b"], "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}, "exact": {"type": "boolean"}}}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]

# (parser, output text, expected content, expected [(name, arguments as a dict)])
CASES = [
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}',
     None, [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("llama3_json", "The answer is {not a call}", "The answer is {not a call}", []),
    ("llama3_json", '{"answer": 3}', '{"answer": 3}', []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abcDEF123"}]',
     None, [("add", {"a": 1, "b": 2})]),
    ("mistral", 'Let me add. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "P", "days": 1}}]',
     "Let me add.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "P", "days": 1})]),
    ("mistral", "No tools [TOOL_CALL", "No tools [TOOL_CALL", []),
    ("mistral", "[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []),
    ("pythonic", '[get_weather(city="San Francisco", days=3), add(a=1, b=2)]', None,
     [("get_weather", {"city": "San Francisco", "days": 3}), ("add", {"a": 1, "b": 2})]),
    ("pythonic", "[add(a=1, b=2)] and then text", "and then text", [("add", {"a": 1, "b": 2})]),
    ("pythonic", "[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    ("pythonic", "Plain answer.", "Plain answer.", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\nCity\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "New York\nCity", "days": 3, "metric": True, "tags": ["a"]})]),
    ("qwen3_coder", "I will add.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n5\n</parameter>\n<parameter=b>\n6\n</parameter>\n</function>\n</tool_call>",
     "I will add.", [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 6})]),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1", "<tool_call>\n<function=add>\n<parameter=a>\n1", []),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.", [("add", {"a": 1, "b": 2})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>',
     None, [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "add", "arguments": {}}', '<tool_call>{"name": "add", "arguments": {}}', []),
    ("hermes", "plain <tool text with < signs, ends with <tool_ca", "plain <tool text with < signs, ends with <tool_ca", []),
]  # fmt: skip


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parse_and_every_split_of_the_stream_agree(name, text, content, calls):
    parser = tool_call_parser(name, TOOLS)
    got_content, got_calls = parser.parse(text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    for step in (1, 2, 7):
        stream = parser.stream()
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        fed = [p for i, piece in enumerate(pieces)
               for p in stream.feed(piece, final=i == len(pieces) - 1)]  # fmt: skip
        streamed = "".join(p for p in fed if isinstance(p, str))
        streamed_calls = [p for p in fed if isinstance(p, ParsedCall)]
        assert (streamed.strip() or None, _calls(streamed_calls)) == (content, calls)
        assert stream.calls == streamed_calls


def test_content_streams_before_the_calls_are_known():
    stream = tool_call_parser("mistral", TOOLS).stream()
    assert stream.feed("Sure, [TOOL") == ["Sure, "]  # "[TOOL" may be the marker: held
    assert stream.feed('_CALLS] [{"name": "add", "arguments": {}}') == []
    (call,) = stream.feed("]")
    assert call.name == "add"
    assert len(call.id) == 9 and call.id.isalnum()  # the id Mistral templates demand


def test_registry_lists_every_cli_choice():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"}


@pytest.fixture(scope="module")
def managers():
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            tok = family_tokenizer(family)
            cache[family] = tok, StructuredOutputManager(tok, len(tok), [tok.eos_token_id])
        return cache[family]

    return get


# (syntax, tools the call is forced from, one generated output the grammar must accept)
FORCED = [
    ("llama3_json", TOOLS, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3, "tags": ["x", "y"]}}'),
    ("mistral", TOOLS, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "Zx81Qa0bc"}]'),
    ("pythonic", TOOLS[1:], "[add(a=1, b=-20, exact=True)]"),
    ("qwen3_coder", TOOLS, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, <b>France</b>\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n</function>\n</tool_call>"),
]  # fmt: skip


@pytest.mark.parametrize("syntax, tools, generated", FORCED)
def test_a_forced_call_re_renders_as_generated_in_the_real_template(
    managers, syntax, tools, generated
):
    tok, manager = managers(syntax)
    params = tool_call_params(tools, None, False, syntax)
    grammar = manager.new_grammar(manager.submit(params).result())
    assert grammar.matcher.accept_string(generated) and grammar.matcher.is_completed()
    content, calls = tool_call_parser(syntax, tools).parse(generated)
    assert content is None and len(calls) == 1
    call = {"id": calls[0].id, "type": "function",  # what the client sends back
            "function": {"name": calls[0].name, "arguments": calls[0].arguments}}
    prompt = tok.decode(render_chat(tok, USER, tools=tools))
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]  # fmt: skip
    next_prompt = tok.decode(render_chat(tok, history, tools=tools))
    assert next_prompt.startswith(prompt + generated)


def test_forced_grammars_refuse_what_the_syntax_cannot_write(managers):
    _, manager = managers("pythonic")
    params = tool_call_params(TOOLS[1:], None, True, "pythonic")
    wrong = manager.new_grammar(manager.submit(params).result())
    assert not wrong.matcher.accept_string("[add(b=1, a=2)]")  # declared order only
    with pytest.raises(InvalidArgumentError, match="scalar types"):
        tool_call_params(TOOLS[:1], None, False, "pythonic")  # an array parameter
    _, manager = managers("qwen3_coder")
    params = tool_call_params(TOOLS, "add", False, "qwen3_coder")
    grammar = manager.new_grammar(manager.submit(params).result())
    assert not grammar.matcher.accept_string("<tool_call>\n<function=add>\n<parameter=b>")


def test_parallel_forced_calls_use_the_syntax_separator(managers):
    _, manager = managers("mistral")
    params = tool_call_params(TOOLS, None, True, "mistral")
    grammar = manager.new_grammar(manager.submit(params).result())
    two = ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "aaaaaaaaa"}, '
           '{"name": "add", "arguments": {"a": 3, "b": 4}, "id": "bbbbbbbbb"}]')  # fmt: skip
    assert grammar.matcher.accept_string(two) and grammar.matcher.is_completed()
    _, calls = tool_call_parser("mistral", TOOLS).parse(two)
    assert [c.id for c in calls] == ["aaaaaaaaa", "bbbbbbbbb"]


def test_forced_hermes_calls_read_json_bodies_and_keep_complete_calls_only():
    """A string argument may hold ``</tool_call>``; a call cut off is no call (the grammar
    allows nothing else, so it is no content either in forced modes)."""
    call_a = '<tool_call>\n{"name": "a", "arguments": {"x": "}\\n</tool_call>"}}\n</tool_call>'
    two = call_a + '\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    parser = tool_call_parser("hermes", TOOLS)
    assert [(c.name, c.arguments) for c in parser.parse(two)[1]] == [
        ("a", '{"x": "}\\n</tool_call>"}'), ("b", "{}")]  # fmt: skip
    for cut in (5, len(call_a) - 1, len(call_a) + 4, len(two) - 1):
        assert len(parser.parse(two[:cut])[1]) == (1 if cut > len(call_a) else 0), cut
