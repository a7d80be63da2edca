"""A custom tool's Lark grammar as the grammar of its call's JSON arguments ``{"input": "..."}``.

The template's tool-call syntax carries a custom tool's free-form input as a JSON string, so the
model writes the input JSON-escaped. xgrammar converts the Lark grammar (Python regex semantics:
``.`` does not match a newline) into its EBNF (``Grammar.from_lark``); here every terminal of that
EBNF is rewritten into the text that spells it inside a JSON string::

    "*** Begin Patch\\n"   ->  "*** Begin Patch\\\\n"             a literal, escaped as JSON writes it
    [^\\n]                 ->  ([^\\n"\\\\\\x00-\\x1f] | "\\\\\\"" | "\\\\\\\\" | "\\\\t" | ...)
                             raw characters but the quote, backslash and control characters,
                             and the escapes JSON writes for those the class holds

So the arguments a grammar accepts decode to exactly the inputs the Lark grammar accepts, and the
call re-renders as generated (``json.dumps`` writes the same escapes). ``arguments_ebnf`` wraps it
in ``{"input": "`` ... ``"}``, in the forced JSON format (``json_grammar``).
"""

from __future__ import annotations

import json
import re

import xgrammar

from prefixserve.core.errors import InvalidArgumentError

INPUT_RULE = "custom_tool_input"
_CONTROL = [chr(c) for c in range(0x20)]
_SPECIAL = ['"', "\\", *_CONTROL]  # the characters JSON escapes
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|x[0-9a-fA-F]{2}|.)", re.DOTALL)
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "v": "\v", "0": "\0"}


def arguments_ebnf(definition: str, syntax: str = "lark") -> str:
    """EBNF (rule ``root``) of ``{"input": "<JSON string of an input the grammar accepts>"}``
    for a ``lark`` or ``regex`` grammar; an ``InvalidArgumentError`` (param "tools") when
    xgrammar cannot read it."""
    read = xgrammar.Grammar.from_regex if syntax == "regex" else xgrammar.Grammar.from_lark
    try:
        ebnf = str(read(definition))
    except Exception as exc:
        raise InvalidArgumentError(f"tools: a custom tool's {syntax} grammar: {exc}",
                                   "tools") from exc  # fmt: skip
    body = re.sub(r"\broot\b", INPUT_RULE, json_string_ebnf(ebnf))
    return f'root ::= "{{\\"input\\": \\"" {INPUT_RULE} "\\"}}"\n{body}'


def json_string_ebnf(ebnf: str) -> str:
    """``ebnf`` with each string literal and character class rewritten as the JSON-escaped
    text that spells it (see the module doc)."""
    out, i = [], 0
    while i < len(ebnf):
        ch = ebnf[i]
        if ch in '"[':
            end = _closing(ebnf, i, '"' if ch == '"' else "]")
            body = ebnf[i + 1 : end]
            out.append(_literal(_unescape(body)) if ch == '"' else _char_class(body))
            i = end + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _closing(text: str, start: int, close: str) -> int:
    i = start + 1
    while text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i


def _unescape(body: str) -> str:
    def one(m: re.Match) -> str:
        code = m.group(1)
        if code[0] in "uUx" and len(code) > 1:
            return chr(int(code[1:], 16))
        return _SIMPLE.get(code, code)

    return _ESCAPE.sub(one, body)


def _ebnf_char(ch: str) -> str:
    """``ch`` as it may stand in an EBNF literal or class."""
    if ch in '"\\]-^[' or ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\U{ord(ch):08x}" if ord(ch) > 0xFFFF else f"\\u{ord(ch):04x}"
    return ch


def _literal(text: str) -> str:
    """The EBNF literal of ``text`` as a JSON string spells it."""
    escaped = json.dumps(text, ensure_ascii=False)[1:-1]
    return '"' + "".join(_ebnf_char(c) for c in escaped) + '"'


def _char_class(body: str) -> str:
    """A character class as the alternatives that spell its characters in a JSON string."""
    negated = body.startswith("^")
    chars = _unescape(body[1:] if negated else body)
    ranges, i = [], 0
    while i < len(chars):
        if i + 2 < len(chars) and chars[i + 1] == "-":
            ranges.append((chars[i], chars[i + 2]))
            i += 3
        else:
            ranges.append((chars[i], chars[i]))
            i += 1
    in_class = [any(lo <= c <= hi for lo, hi in ranges) != negated for c in _SPECIAL]
    plain = "".join(_ebnf_char(lo) + ("-" + _ebnf_char(hi) if hi != lo else "")
                    for lo, hi in ranges)  # fmt: skip
    excluded = "\\u0022\\u005c\\u0000-\\u001f"
    raw = f"[^{plain}{excluded}]" if negated else _without_special(ranges)
    alternatives = ([raw] if raw else []) + [
        _literal(c) for c, kept in zip(_SPECIAL, in_class) if kept
    ]
    if not alternatives:
        raise InvalidArgumentError("tools: a custom tool's grammar has an empty class", "tools")
    return "(" + " | ".join(alternatives) + ")"


def _without_special(ranges: list[tuple[str, str]]) -> str:
    """A positive class's ranges less the characters JSON escapes ("" when none is left)."""
    kept: list[tuple[int, int]] = []
    for lo, hi in ranges:
        start, end = max(ord(lo), 0x20), ord(hi)
        for cut in (ord('"'), ord("\\")):
            if start <= cut <= end:
                kept.append((start, cut - 1))
                start = cut + 1
        kept.append((start, end))
    parts = [_ebnf_char(chr(a)) + ("-" + _ebnf_char(chr(b)) if b != a else "")
             for a, b in kept if a <= b]  # fmt: skip
    return f"[{''.join(parts)}]" if parts else ""
