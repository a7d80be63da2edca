"""Forced tool calls (``tool_choice`` "required" or a named function), in the chat template's syntax.

The built-in ChatML template (``prefixserve/models/builtin.py``) renders an assistant turn whose
content is empty and which calls tools as::

    <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>\\n<tool_call>\\n{"name": ...

with ``ARGS`` the arguments string verbatim (or ``tojson`` of a dict) and a newline between
calls, as hermes-style templates (Qwen 2.5 and 3) write them. For a template with another
tool-call syntax, this form is the documented default.
The grammar generates exactly these bytes: the name is a literal, ``ARGS`` is JSON in the format
of ``json_grammar``. So when the client sends the call back (OpenAI clients return the
``arguments`` string unchanged), the next turn's prompt contains the generated text byte for byte
and the prefix cache reaches through it. After the last ``</tool_call>`` only EOS is allowed.
A string argument may contain the text ``</tool_call>``: read a call as JSON, not up to the tag.
"""

from __future__ import annotations

import json
from typing import Any

from prefixserve.errors import InvalidArgumentError
from prefixserve.structured_outputs.json_grammar import json_schema_ebnf
from prefixserve.structured_outputs.params import (
    StructuredOutputsParams,
    ToolCallSpec,
    canonical_json,
)

CALL_SEPARATOR = "\n"  # between calls, as the template renders them (see above)
ANY_OBJECT = '{"type": "object"}'


def tool_call_params(
    tools: list[dict[str, Any]], name: str | None, parallel: bool
) -> StructuredOutputsParams:
    """Params that force tool calls of ``tools`` (OpenAI tool definitions).

    ``name`` given: exactly one call of that function. ``name`` None (``tool_choice`` "required"):
    one call of any listed function, or one or more calls when ``parallel``. Each call's arguments
    match the function's ``parameters`` schema; missing or empty ``parameters`` mean any object.
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
    return StructuredOutputsParams(tool_calls=ToolCallSpec(tuple(functions), parallel))


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
    checked = tuple((name, params if name in strict else None) for name, params in functions)
    return StructuredOutputsParams(tool_calls=ToolCallSpec(checked, parallel, optional=True))


def tool_call_structural_tag(spec: ToolCallSpec) -> dict[str, Any]:
    """The xgrammar structural tag that generates ``spec``'s calls.

    Raises RuntimeError (from xgrammar) when a ``parameters`` schema cannot be converted.
    """
    tags = [
        {
            "type": "tag",
            "begin": f'<tool_call>\n{{"name": "{name}", "arguments": ',
            "content": {"type": "grammar", "grammar": json_schema_ebnf(parameters or ANY_OBJECT)},
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


class ToolCallStream:
    """Reads forced tool-call text in pieces; ``feed`` returns what became known, in order:
    ``("name", index, name)`` once a call's name is complete, then ``("arguments", index, text)``
    fragments whose concatenation is the call's raw arguments text (OpenAI's streaming shape).

    Text that could still be the closing ``}\\n</tool_call>`` is held back; a fragment is never
    retracted. The arguments are JSON, so where they end is found by tracking nesting and strings.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._index = -1
        self._in_args = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list[tuple[str, int, str]]:
        self._buffer += text
        events: list[tuple[str, int, str]] = []
        while True:
            if self._in_args:
                fragment, done = self._scan_arguments()
                if fragment:
                    events.append(("arguments", self._index, fragment))
                if not done:
                    return events
                self._in_args = False
                continue
            head = _CALL_START if self._index < 0 else CALL_SEPARATOR + _CALL_START
            if self._index >= 0:
                head = _CALL_END + head
            name_end = self._buffer.find(_ARGS_START, len(head))
            if not self._buffer.startswith(head) or name_end < 0:
                return events
            self._index += 1
            events.append(("name", self._index, self._buffer[len(head) : name_end]))
            self._buffer = self._buffer[name_end + len(_ARGS_START) :]
            self._in_args, self._depth = True, 0

    def _scan_arguments(self) -> tuple[str, bool]:
        """Consume argument text from the buffer: (fragment, whether the arguments ended)."""
        for i, ch in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return self._take(i + 1), True
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._take(i + 1), True
            elif self._depth == 0:  # a bare number or literal: it ends where the call's end does
                end = self._buffer.find(_CALL_END, i)
                return (self._take(end), True) if end >= 0 else ("", False)
        return self._take(len(self._buffer)), False

    def _take(self, n: int) -> str:
        fragment, self._buffer = self._buffer[:n], self._buffer[n:]
        return fragment
