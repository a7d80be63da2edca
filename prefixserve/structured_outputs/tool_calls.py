"""Forced tool calls (``tool_choice`` "required" or a named function), in the chat template's syntax.

The built-in ChatML template (``prefixserve/models/builtin.py``) renders an assistant turn whose
content is empty and which calls tools as::

    <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>\\n<tool_call>\\n{"name": ...

with ``ARGS`` the arguments string verbatim (or ``tojson`` of a dict) and a newline between
calls, as hermes-style templates (Qwen 2.5 and 3) write them. Other families' syntaxes
(``ToolCallSpec.syntax``, chosen by ``--tool-call-parser``) are in ``tool_call_syntaxes``.
The grammar generates exactly these bytes: the name is a literal, ``ARGS`` is JSON in the format
of ``json_grammar``. So when the client sends the call back (OpenAI clients return the
``arguments`` string unchanged), the next turn's prompt contains the generated text byte for byte
and the prefix cache reaches through it. After the last ``</tool_call>`` only EOS is allowed.
A string argument may contain the text ``</tool_call>``: read a call as JSON, not up to the tag.
"""

from __future__ import annotations

import json
from typing import Any

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.structured_outputs.json_grammar import ANY_OBJECT, json_schema_ebnf
from prefixserve.structured_outputs.params import (
    StructuredOutputsParams,
    ToolCallSpec,
    canonical_json,
)
from prefixserve.structured_outputs.tool_call_syntaxes import check_function, syntax_format

CALL_SEPARATOR = "\n"  # between calls, as the template renders them (see above)
NO_ARGUMENTS_EBNF = 'root ::= "{}"'  # a function without parameters takes none (OpenAI)


def tool_call_params(
    tools: list[dict[str, Any]],
    name: str | None,
    parallel: bool,
    syntax: str = "hermes",
    reasoning: tuple[str, str] | None = None,
) -> StructuredOutputsParams:
    """Params that force tool calls of ``tools`` (OpenAI tool definitions).

    ``name`` given: exactly one call of that function. ``name`` None (``tool_choice`` "required"):
    one call of any listed function, or one or more calls when ``parallel``. Each call's arguments
    match the function's ``parameters`` schema; missing or empty ``parameters`` mean a function
    that takes no parameters, called with exactly ``{}`` (OpenAI's definition). ``syntax``: the
    family's (``tool_call_syntaxes``); ``reasoning``: a reasoning block first
    (``StructuredOutputsParams.reasoning``).
    """
    functions = [_function(tool) for tool in tools]
    if not functions:
        raise InvalidArgumentError(
            "tool_choice forces a tool call, but tools is empty: list the functions in tools.",
            param="tool_choice",
        )
    if name is not None:
        chosen = [f for f in functions if f[0] == name]
        if not chosen:
            known = ", ".join(repr(f[0]) for f in functions)
            raise InvalidArgumentError(
                f"tool_choice names the function {name!r}, which is not in tools ({known}).",
                param="tool_choice",
            )
        functions, parallel = chosen[:1], False
    for function_name, parameters in functions:
        check_function(syntax, function_name, parameters)
    spec = ToolCallSpec(tuple(functions), parallel, syntax)
    return StructuredOutputsParams(tool_calls=spec, reasoning=reasoning)


def optional_tool_call_params(
    tools: list[dict[str, Any]], strict: set[str], parallel: bool
) -> StructuredOutputsParams:
    """Params for ``tool_choice`` "auto" with strict tools: free text, and every call (which
    starts at ``<tool_call>``) names a listed function, with arguments that match its
    ``parameters`` when it is in ``strict`` (else any object). ``parallel``: any number of
    calls, else at most one, after which only EOS may follow."""
    functions = [_function(tool) for tool in tools]
    if not functions:
        raise InvalidArgumentError("tools: strict tool calls need tools.", param="tools")
    checked = tuple(
        (name, params if name in strict else ANY_OBJECT) for name, params in functions
    )
    return StructuredOutputsParams(tool_calls=ToolCallSpec(checked, parallel, optional=True))


def tool_call_structural_tag(spec: ToolCallSpec) -> dict[str, Any]:
    """The xgrammar structural tag that generates ``spec``'s calls.

    Raises RuntimeError (from xgrammar) when a ``parameters`` schema cannot be converted.
    """
    if spec.syntax != "hermes":
        return {
            "type": "structural_tag",
            "format": syntax_format(spec.syntax, spec.functions, spec.parallel),
        }
    tags = [
        {
            "type": "tag",
            "begin": f'<tool_call>\n{{"name": "{name}", "arguments": ',
            "content": {"type": "grammar", "grammar": _arguments_ebnf(parameters)},
            "end": "}\n</tool_call>",
        }
        for name, parameters in spec.functions
    ]
    if spec.optional:
        return {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": ["<tool_call>"],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": not spec.parallel,
            },
        }
    return {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": CALL_SEPARATOR,
            "at_least_one": True,
            "stop_after_first": not spec.parallel,
        },
    }


def _arguments_ebnf(parameters: str | None) -> str:
    """EBNF of a call's arguments: JSON matching ``parameters``, or exactly ``{}`` without."""
    return NO_ARGUMENTS_EBNF if parameters is None else json_schema_ebnf(parameters)


def _function(tool: dict[str, Any]) -> tuple[str, str | None]:
    """``(name, parameters as canonical JSON or None)`` of one OpenAI tool definition."""
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(
            'Every tool needs {"type": "function", "function": {"name": ...}} with a non-empty name.',
            param="tools",
        )
    if json.dumps(name, ensure_ascii=False)[1:-1] != name:
        # The template writes the name between quotes unescaped; such a name would not be JSON.
        raise InvalidArgumentError(
            f"Tool name {name!r} contains a quote, backslash or control character; rename it.",
            param="tools",
        )
    parameters = function.get("parameters")
    if not parameters:
        return name, None
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(
            f"The parameters of tool {name!r} must be a JSON schema object.", param="tools"
        )
    return name, canonical_json(parameters)


_CALL_START = '<tool_call>\n{"name": "'
_ARGS_START = '", "arguments": '
_CALL_END = "}\n</tool_call>"


def parse_tool_calls(text: str) -> tuple[list[tuple[str, str]], int]:
    """``([(name, raw arguments text), ...], end)``: the complete calls at the start of ``text``
    (generated under ``tool_call_params``) and where they end. Arguments are read as JSON, so a
    string holding ``</tool_call>`` is no problem; a call cut short (``max_tokens``, a stop
    string) is not returned and ``end`` stops before it."""
    calls: list[tuple[str, str]] = []
    pos, decoder = 0, json.JSONDecoder()
    while True:
        start = pos + len(CALL_SEPARATOR) if calls else pos
        if not text.startswith(_CALL_START, start):
            return calls, pos
        name_end = text.find('"', start + len(_CALL_START))
        args_start = name_end + len(_ARGS_START)
        if name_end < 0 or not text.startswith(_ARGS_START, name_end):
            return calls, pos
        try:
            _, args_end = decoder.raw_decode(text, args_start)
        except ValueError:
            return calls, pos
        if not text.startswith(_CALL_END, args_end):
            return calls, pos
        calls.append((text[start + len(_CALL_START) : name_end], text[args_start:args_end]))
        pos = args_end + len(_CALL_END)
