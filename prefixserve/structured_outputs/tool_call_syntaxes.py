"""Forced tool calls in each model family's own syntax, as its chat template renders them.

A forced call must be the text the family's template writes for that call in the next turn's
prompt, so that the prefix cache reaches through it (see ``tool_calls`` for hermes, the default).
Each syntax below is that rendering, for a call whose ``arguments`` the template receives as a
dict (``chat_template`` parses the client's JSON string for templates that need it):

``llama3_json`` (Llama 3.1/3.2 JSON)::

    {"name": "NAME", "parameters": ARGS}            (parallel calls: separated by "; ")

``mistral`` (Mistral 7B v0.3, Nemo: ``tool_call.function|tojson`` plus a 9-character id)::

    [TOOL_CALLS] [{"name": "NAME", "arguments": ARGS, "id": "a1B2c3D4e"}, ...]

``pythonic`` (Llama 3.2 small, Llama 4)::

    [NAME(key=VALUE, key=VALUE), ...]

``qwen3_coder`` (Qwen3-Coder, Qwen3.5+; values as the template writes them: strings raw,
booleans ``True``/``False``, objects and arrays as JSON)::

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

``ARGS`` is JSON in ``json_grammar``'s format. In ``pythonic`` and ``qwen3_coder`` the
parameters come in the schema's declared order, required ones always, optional ones maybe; a
pythonic value is a Python literal (``"text"``, ``3``, ``True``, ``None``), and object or array
parameters are refused there (Python literals of them would not re-render as generated).
"""

from __future__ import annotations

import json
from typing import Any

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.structured_outputs.json_grammar import json_schema_ebnf

SYNTAXES = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
MISTRAL_ID_PATTERN = "[A-Za-z0-9]{9}"
MARKER_TOKENS = ("[TOOL_CALLS]",)  # special tokens a forced call writes (see build_tokenizer_info)
PARAMETER_END = "\n</parameter>"

_INTEGER = '"-"? ("0" | [1-9] [0-9]*)'
_NUMBER = _INTEGER + ' ("." [0-9]* [1-9])?'  # no trailing zero: re-renders as generated
_PY_STRING = r'"\"" ([^"\\\n] | "\\" ["\\nt])* "\""'


def syntax_format(syntax: str, functions: tuple[tuple[str, str | None], ...], parallel: bool):
    """The xgrammar structural-tag ``format`` of forced calls of ``functions`` in ``syntax``
    (any syntax but hermes, which ``tool_calls`` builds)."""
    if syntax == "llama3_json":
        tags = [_json_tag(f'{{"name": "{name}", "parameters": ', params, "}")
                for name, params in functions]  # fmt: skip
        return _calls(tags, "; ", parallel)
    if syntax == "mistral":
        tags = [
            {
                "type": "tag",
                "begin": f'{{"name": "{name}", "arguments": ',
                "content": {
                    "type": "sequence",
                    "elements": [
                        _json_grammar(params),
                        {"type": "const_string", "value": ', "id": "'},
                        {"type": "regex", "pattern": MISTRAL_ID_PATTERN},
                    ],
                },
                "end": '"}',
            }
            for name, params in functions
        ]
        return _wrapped("[TOOL_CALLS] [", _calls(tags, ", ", parallel), "]")
    if syntax == "pythonic":
        tags = [_python_call_tag(name, params) for name, params in functions]
        return _wrapped("[", _calls(tags, ", ", parallel), "]")
    if syntax == "qwen3_coder":
        tags = [
            {
                "type": "tag",
                "begin": f"<tool_call>\n<function={name}>\n",
                "content": _sequence([_xml_parameter(k, s, req) for k, s, req in _props(params)]),
                "end": "</function>\n</tool_call>",
            }
            for name, params in functions
        ]
        return _calls(tags, "\n", parallel)
    raise ValueError(f"unknown tool-call syntax {syntax!r}")


def check_function(syntax: str, name: str, parameters: str | None) -> None:
    """Raise ``InvalidArgumentError`` (param "tools") when ``syntax`` cannot write this function."""
    if syntax == "pythonic":
        if not name.isidentifier():
            raise InvalidArgumentError(
                f"Tool name {name!r} is not a Python identifier, which the pythonic tool-call "
                "syntax needs; rename it.",
                param="tools",
            )
        for key, schema, _ in _props(parameters):
            if not key.isidentifier() or _type(schema) in ("object", "array"):
                raise InvalidArgumentError(
                    f"Parameter {key!r} of tool {name!r}: the pythonic syntax forces calls with "
                    "identifier-named parameters of scalar types (string, integer, number, "
                    "boolean) only.",
                    param="tools",
                )
    if syntax == "qwen3_coder" and (">" in name or any(">" in k for k, _, _ in _props(parameters))):
        raise InvalidArgumentError(
            f"Tool {name!r}: names in the qwen3_coder syntax cannot contain '>'.", param="tools"
        )


def text_without(end: str) -> str:
    """EBNF (rule ``root``) of any text that does not contain ``end``, whose first character
    occurs in it only once (so the automaton falls back to state 0 or 1 only)."""
    assert end and end[0] not in end[1:], "the automaton below needs a unique first character"
    first = json.dumps(end[0])
    rules = ["root ::= s0"]
    for i, ch in enumerate(end):
        alts = ['""']
        if i + 1 < len(end):
            alts.append(f"{json.dumps(ch)} s{i + 1}")
        if i > 0:
            alts.append(f"{first} s1")
        excluded = {end[0], ch}
        alts.append(f"[^{''.join(_class_char(c) for c in sorted(excluded))}] s0")
        rules.append(f"s{i} ::= " + " | ".join(alts))
    return "\n".join(rules)


def _class_char(ch: str) -> str:
    return {"\n": "\\n", "\\": "\\\\", "]": "\\]", "^": "\\^", "-": "\\-"}.get(ch, ch)


def _calls(tags: list[dict], separator: str, parallel: bool) -> dict:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def _wrapped(begin: str, inner: dict, end: str) -> dict:
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": begin},
            inner,
            {"type": "const_string", "value": end},
        ],
    }


def _sequence(elements: list[dict]) -> dict:
    if not elements:
        return {"type": "const_string", "value": ""}
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _optional(element: dict) -> dict:
    return {"type": "or", "elements": [element, {"type": "const_string", "value": ""}]}


def _json_grammar(params: str | None) -> dict:
    """Arguments as JSON matching ``params``; None (a function without parameters): ``{}``."""
    grammar = 'root ::= "{}"' if params is None else json_schema_ebnf(params)
    return {"type": "grammar", "grammar": grammar}


def _json_tag(begin: str, params: str | None, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": _json_grammar(params), "end": end}


def _props(parameters: str | None) -> list[tuple[str, dict, bool]]:
    """``(name, schema, required)`` of each declared property, in declared order."""
    schema = json.loads(parameters) if parameters else {}
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return []
    required = schema.get("required") or []
    return [(k, v if isinstance(v, dict) else {}, k in required) for k, v in properties.items()]


def _type(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    return kind if isinstance(kind, str) else "string"


def _enum_ebnf(values: list[Any], render) -> str:
    return "root ::= " + " | ".join(json.dumps(render(v)) for v in values)


def _xml_value(schema: dict[str, Any]) -> dict:
    """A qwen3_coder value: what ``args_value | string`` (or ``| tojson``) writes."""
    kind = _type(schema)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return {"type": "grammar", "grammar": _enum_ebnf(schema["enum"], _template_string)}
    if kind in ("object", "array"):
        return _json_grammar(json.dumps(schema))
    scalar = {"integer": _INTEGER, "number": _NUMBER, "boolean": '"True" | "False"',
              "null": '"None"'}.get(kind)  # fmt: skip
    grammar = f"root ::= {scalar}" if scalar else text_without(PARAMETER_END)
    return {"type": "grammar", "grammar": grammar}


def _template_string(value: Any) -> str:
    """Jinja's ``value | string`` (``tojson`` for containers), as the qwen3_coder template."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _xml_parameter(key: str, schema: dict, required: bool) -> dict:
    element = _sequence(
        [
            {"type": "const_string", "value": f"<parameter={key}>\n"},
            _xml_value(schema),
            {"type": "const_string", "value": PARAMETER_END + "\n"},
        ]
    )
    return element if required else _optional(element)


def _python_value(schema: dict[str, Any]) -> str:
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return " | ".join(json.dumps(repr(v)) for v in schema["enum"])
    return {"integer": _INTEGER, "number": _NUMBER, "boolean": '"True" | "False"',
            "null": '"None"'}.get(_type(schema), _PY_STRING)  # fmt: skip


def _python_call_tag(name: str, parameters: str | None) -> dict:
    """``NAME(k=v, ...)``: required keywords always, optional ones maybe, in declared order;
    a comma only between keywords present."""
    props = _props(parameters)
    rules = [f"v{i} ::= {_python_value(s)}" for i, (_, s, _) in enumerate(props)]
    # r{i}: the keywords from i on, none written yet; c{i}: the same after a written one.
    for i, (key, _, required) in enumerate(props):
        item = f'"{key}=" v{i}'
        rest = (f"r{i + 1}", f"c{i + 1}") if i + 1 < len(props) else ('""', '""')
        first, after = f"{item} {rest[1]}", f'", " {item} {rest[1]}'
        rules.append(f"r{i} ::= {first}" + ("" if required else f" | {rest[0]}"))
        rules.append(f"c{i} ::= {after}" + ("" if required else f" | {rest[1]}"))
    rules.insert(0, "root ::= r0" if props else 'root ::= ""')
    return {
        "type": "tag",
        "begin": f"{name}(",
        "content": {"type": "grammar", "grammar": "\n".join(rules)},
        "end": ")",
    }
