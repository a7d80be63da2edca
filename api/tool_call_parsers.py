"""``--tool-call-parser``: a registry of tool-call syntaxes read from a model's free text.

``TOOL_CALL_PARSERS`` maps a name to a parser class; ``parser = TOOL_CALL_PARSERS[name](tools)``
(the request's OpenAI tool definitions; qwen3_coder reads parameter types from them). Then:

    content, calls = parser.parse(text)          # a whole output: (content or None, ToolCalls)
    stream = parser.stream()                     # one per choice
    content_delta, new_calls = stream.feed(delta, final)

The syntaxes (what each family's model writes; forced calls generate the same, see
``prefixserve.structured_outputs.tool_call_syntaxes``):

- ``hermes``: ``<tool_call>{"name", "arguments"}</tool_call>`` (``api/tool_parsers.py``);
- ``llama3_json``: the output is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments", "id"?}``; content
  may come before it. Ids are 9 alphanumerics (Mistral templates refuse others): the one the
  model wrote, or a new one;
- ``pythonic``: the output is a Python list of calls, ``[f(a=1, b="x"), g()]``;
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>``,
  content may come before it; values are converted by the parameter's schema type.

How an output splits (every parser but hermes, whose own rules are kept): the text before the
syntax's start is content; from the start on, the complete calls; what follows them, or a call
that does not parse, is content too (a cut-off call stays visible). The content is stripped,
None when empty. Streaming holds back from where the start may begin, emits each call once the
syntax closes it, and on ``final`` emits the rest, so the streamed content (up to surrounding
whitespace) and calls equal ``parse``'s for any split of the text.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
from typing import Any

from prefixserve.api.protocol import FunctionCall, ToolCall
from prefixserve.api.tool_parsers import HermesStreamParser, parse_tool_calls


class ToolCallParser:
    """One syntax. Subclasses give ``section`` (where the calls start) and ``calls_in``."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def section(self, text: str, final: bool) -> tuple[int, bool]:
        """``(end of the sure content, whether calls start there)``. Not found and not final:
        the end stops before any text that may still turn into the start."""
        raise NotImplementedError

    def calls_in(self, section: str, final: bool) -> tuple[list[ToolCall], str]:
        """The complete calls at the start of ``section`` (which begins at the syntax's start)
        and the text after them (with ``final``: all of it that is not a complete call)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start, found = self.section(text, final=True)
        if not found:
            return text.strip() or None, []
        calls, rest = self.calls_in(text[start:], final=True)
        content = (text[:start] + rest).strip()
        return content or None, calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """Streams ``parser.parse``: see the module doc. ``calls``: those emitted so far."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of content emitted
        self.calls: list[ToolCall] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        start, found = self.parser.section(self.text, final)
        content = self.text[self.sent : start] if start > self.sent else ""
        self.sent = max(self.sent, start)
        if not found:
            return content, []
        calls, rest = self.parser.calls_in(self.text[start:], final)
        new_calls = calls[len(self.calls) :]
        self.calls.extend(new_calls)
        if final and rest.strip():
            content += rest
        return content, new_calls


class HermesParser(ToolCallParser):
    """``api/tool_parsers.py``'s hermes rules, behind the registry's interface."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_tool_calls(text)

    def stream(self) -> HermesStreamParser:  # type: ignore[override]
        return HermesStreamParser()


def _call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    function = FunctionCall(name=name, arguments=text)
    return (
        ToolCall(function=function) if call_id is None else ToolCall(id=call_id, function=function)
    )


def _at_start(text: str, markers: tuple[str, ...], final: bool) -> tuple[int, bool]:
    """``section`` for syntaxes whose calls must open the output (after whitespace)."""
    stripped = text.lstrip()
    offset = len(text) - len(stripped)
    if any(stripped.startswith(m) for m in markers):
        return offset, True
    if not final and any(m.startswith(stripped) for m in markers):
        return 0, False  # undecided: hold everything
    return len(text), False


def _anywhere(text: str, marker: str, final: bool) -> tuple[int, bool]:
    """``section`` for syntaxes whose calls may follow content."""
    index = text.find(marker)
    if index >= 0:
        return index, True
    if final:
        return len(text), False
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n, False
    return len(text), False


class Llama3JsonParser(ToolCallParser):
    PYTHON_TAG = "<|python_tag|>"

    def section(self, text: str, final: bool) -> tuple[int, bool]:
        return _at_start(text, (self.PYTHON_TAG, "{"), final)

    def calls_in(self, section: str, final: bool) -> tuple[list[ToolCall], str]:
        pos = len(self.PYTHON_TAG) if section.startswith(self.PYTHON_TAG) else 0
        calls, decoder = [], json.JSONDecoder()
        while True:
            body = pos + len(section[pos:]) - len(section[pos:].lstrip())
            try:
                obj, end = decoder.raw_decode(section, body)
            except ValueError:
                return calls, section[pos:]
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not (
                isinstance(args, dict)
            ):
                return calls, section[pos:]
            calls.append(_call(obj["name"], args))
            rest = section[end:].lstrip()
            if not rest.startswith(";"):
                return calls, section[end:]
            pos = len(section) - len(rest) + 1


MISTRAL_ID_CHARS = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral_call_id() -> str:
    """A new 9-character alphanumeric id, the only form Mistral templates accept."""
    return "".join(random.choices(MISTRAL_ID_CHARS, k=9))


class MistralParser(ToolCallParser):
    MARKER = "[TOOL_CALLS]"

    def section(self, text: str, final: bool) -> tuple[int, bool]:
        return _anywhere(text, self.MARKER, final)

    def calls_in(self, section: str, final: bool) -> tuple[list[ToolCall], str]:
        body = section[len(self.MARKER) :]
        start = len(body) - len(body.lstrip())
        try:
            items, end = json.JSONDecoder().raw_decode(body, start)
        except ValueError:
            return [], section
        items = items if isinstance(items, list) else [items]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return [], section
            args = item.get("arguments", item.get("parameters", {}))
            if not isinstance(args, (dict, str)):
                return [], section
            call_id = item.get("id")
            valid = isinstance(call_id, str) and _MISTRAL_ID.fullmatch(call_id)
            calls.append(_call(item["name"], args, call_id if valid else mistral_call_id()))
        return calls, body[end:]


class PythonicParser(ToolCallParser):
    def section(self, text: str, final: bool) -> tuple[int, bool]:
        return _at_start(text, ("[",), final)

    def calls_in(self, section: str, final: bool) -> tuple[list[ToolCall], str]:
        end = _list_end(section)
        if end is None:
            return [], section
        try:
            tree = ast.parse(section[:end], mode="eval").body
            calls = [_python_call(node) for node in tree.elts]  # type: ignore[attr-defined]
        except (SyntaxError, ValueError, AttributeError):
            return [], section
        return calls, section[end:]


def _python_call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    name = ast.unparse(node.func)
    args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    if len(args) != len(node.keywords):
        raise ValueError("**kwargs")
    return _call(name, args)


def _list_end(text: str) -> int | None:
    """Index just past the ``]`` closing the list that ``text`` opens; None if not closed."""
    depth, quote, escaped = 0, "", False
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[({":
            depth += 1
        elif ch in "])}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class Qwen3CoderParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*$", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def section(self, text: str, final: bool) -> tuple[int, bool]:
        return _anywhere(text, self.START, final)

    def calls_in(self, section: str, final: bool) -> tuple[list[ToolCall], str]:
        calls, pos = [], 0
        while True:
            rest = section[pos:]
            body_start = len(rest) - len(rest.lstrip())
            if not rest.startswith(self.START, body_start):
                return calls, rest
            end = rest.find(self.END, body_start)
            if end < 0:
                return calls, rest
            call = self._call(rest[body_start + len(self.START) : end])
            if call is None:
                return calls, rest
            calls.append(call)
            pos += end + len(self.END)

    def _call(self, body: str) -> ToolCall | None:
        match = self._FUNCTION.match(body)
        if match is None:
            return None
        name, params = match.group(1), match.group(2)
        types = self._types(name)
        args = {k: _convert(v, types.get(k)) for k, v in self._PARAMETER.findall(params)}
        return _call(name, args)

    def _types(self, name: str) -> dict[str, dict]:
        for tool in self.tools:
            function = tool.get("function", tool)
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties") or {}
                return {k: v for k, v in properties.items() if isinstance(v, dict)}
        return {}


def _convert(value: str, schema: dict | None) -> Any:
    """A qwen3_coder parameter's text as its schema type (unknown: JSON if it parses)."""
    kind = (schema or {}).get("type")
    if kind == "string":
        return value
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if kind in ("null",) and value.strip() in ("None", "null"):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if kind is None and not isinstance(parsed, (dict, list)):
        return value if isinstance(parsed, str) else parsed
    return parsed


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}


def tool_call_parser(name: str, tools: list[dict[str, Any]] | None) -> ToolCallParser:
    """The registered parser ``name`` for a request's tools."""
    return TOOL_CALL_PARSERS[name](tools)
