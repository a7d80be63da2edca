"""What a request asks its output to match: ``StructuredOutputsParams`` (vLLM's names).

Exactly one kind is set. ``key`` names the grammar for the compile cache: two params with equal
keys compile to the same grammar. JSON (``json``, ``json_object``, tool-call arguments) is
generated in one format: see ``json_grammar``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prefixserve.errors import InvalidArgumentError

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "tool_calls")


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, param="structured_outputs")


def canonical_json(value: Any) -> str:
    """One-line JSON text of ``value``, keys in their given order.

    Keys are not sorted: xgrammar writes object properties in the schema's declared order, so two
    schemas that differ only in property order are different grammars.
    """
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class ToolCallSpec:
    """Forced tool calls, built by ``tool_calls.tool_call_params`` (never by a user directly).

    ``functions`` holds ``(name, parameters)`` pairs: ``parameters`` is the function's JSON schema
    as ``canonical_json`` text, or None for "any JSON object". ``parallel`` allows one or more
    calls; otherwise exactly one call is generated. ``optional`` (``tool_choice`` "auto" with
    strict tools): free text, in which a call may start wherever ``<tool_call>`` is written, and
    then must be a complete call of a listed function (``parallel``: any number of calls).
    """

    functions: tuple[tuple[str, str | None], ...]
    parallel: bool
    optional: bool = False


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain a request's output to a JSON schema, regex, choice, EBNF grammar or tool calls.

    ``json``: a JSON schema, as a dict or JSON text. ``regex``: a pattern the whole output matches.
    ``choice``: the output is exactly one of these strings. ``grammar``: EBNF in xgrammar's dialect
    (GBNF-like, root rule ``root``). ``json_object``: any JSON object. ``tool_calls``: the chat
    template's tool-call syntax (internal; see ``tool_calls.tool_call_params``).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    tool_calls: ToolCallSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise _invalid("structured_outputs.json_object must be true or false.")
        given = [k for k in _KINDS if _is_set(getattr(self, k))]
        if len(given) != 1:
            found = " and ".join(given) if given else "none"
            raise _invalid(
                f"Set exactly one of structured_outputs.{{{', '.join(_KINDS[:-1])}}}; got {found}."
            )
        _CHECKS[given[0]](getattr(self, given[0]))

    @property
    def kind(self) -> str:
        """The one kind that is set: "json", "regex", "choice", "grammar", "json_object" or
        "tool_calls"."""
        return next(k for k in _KINDS if _is_set(getattr(self, k)))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: the compile-cache key."""
        kind = self.kind
        if kind == "json":
            return kind, canonical_json(self.json_schema)
        if kind == "choice":
            return kind, canonical_json(list(self.choice or ()))
        if kind == "tool_calls":
            spec = self.tool_calls
            assert spec is not None
            return kind, canonical_json([spec.functions, spec.parallel, spec.optional])
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    @property
    def json_schema(self) -> dict[str, Any] | bool:
        """The ``json`` schema as a Python value (parsed when it was given as text)."""
        value = json.loads(self.json) if isinstance(self.json, str) else self.json
        assert isinstance(value, (dict, bool)), "only set when kind is json"
        return value


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def _check_json(value: object) -> None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _invalid(f"structured_outputs.json is not valid JSON text ({e}).") from None
    if not isinstance(value, (dict, bool)):
        raise _invalid(
            "structured_outputs.json must be a JSON schema: an object (or its JSON text), "
            f"got {type(value).__name__}."
        )
    try:
        canonical_json(value)
    except (TypeError, ValueError) as e:
        raise _invalid(f"structured_outputs.json cannot be written as JSON ({e}).") from None


def _check_text(name: str):
    def check(value: object) -> None:
        if not isinstance(value, str) or not value:
            raise _invalid(f"structured_outputs.{name} must be a non-empty string.")

    return check


def _check_choice(value: object) -> None:
    if not isinstance(value, (list, tuple)) or not value:
        raise _invalid("structured_outputs.choice must be a non-empty list of strings.")
    if not all(isinstance(c, str) and c for c in value):
        raise _invalid("Every entry of structured_outputs.choice must be a non-empty string.")


def _check_tool_calls(value: object) -> None:
    if not isinstance(value, ToolCallSpec) or not value.functions:
        raise _invalid("structured_outputs.tool_calls must be built by tool_call_params().")


_CHECKS = {
    "json": _check_json,
    "regex": _check_text("regex"),
    "choice": _check_choice,
    "grammar": _check_text("grammar"),
    "json_object": lambda value: None,
    "tool_calls": _check_tool_calls,
}
