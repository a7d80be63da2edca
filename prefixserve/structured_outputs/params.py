"""What a request asks its output to match: ``StructuredOutputsParams`` (vLLM's names).

Exactly one kind is set. ``key`` names the grammar for the compile cache: two params with equal
keys compile to the same grammar. JSON (``json``, ``json_object``, tool-call arguments) is
generated in one format: see ``json_grammar``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.structured_outputs.structural_tag import check_structural_tag

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "tool_calls")


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
    as ``canonical_json`` text, or None for a function that takes no parameters (its arguments
    are exactly ``{}``). ``parallel`` allows one or more calls; otherwise exactly one call is
    generated. ``syntax``: the family's tool-call syntax (``tool_call_syntaxes.SYNTAXES``; hermes
    by default). ``optional`` (``tool_choice`` "auto" with strict tools, hermes syntax): free
    text, in which a call may start wherever ``<tool_call>`` is written, and then must be a
    complete call of a listed function (``parallel``: any number of calls).
    """

    functions: tuple[tuple[str, str | None], ...]
    parallel: bool
    syntax: str = "hermes"
    optional: bool = False


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain a request's output to a JSON schema, regex, choice, EBNF grammar or tool calls.

    ``json``: a JSON schema, as a dict or JSON text. ``regex``: a pattern the whole output matches.
    ``choice``: the output is exactly one of these strings. ``grammar``: EBNF in xgrammar's dialect
    (GBNF-like, root rule ``root``). ``json_object``: any JSON object. ``structural_tag``: free
    text with constrained tagged regions, a dict or its JSON text (see ``structural_tag``).
    ``tool_calls``: the chat template's tool-call syntax (internal; see
    ``tool_calls.tool_call_params``).

    ``reasoning``: ``(begin, end)`` when the output first holds a reasoning block: ``begin``,
    any text without ``end``, ``end``, then newlines; what the kind constrains starts after it
    (as vLLM applies grammars after the reasoning). Not a kind: it goes with any one of them.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict[str, Any] | str | None = None
    tool_calls: ToolCallSpec | None = None
    reasoning: tuple[str, str] | None = None

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
        if self.reasoning is not None and not (
            isinstance(self.reasoning, tuple)
            and len(self.reasoning) == 2
            and all(isinstance(t, str) for t in self.reasoning)
            and self.reasoning[1]
        ):
            raise _invalid("structured_outputs.reasoning must be a (begin, end) pair of strings.")

    @property
    def kind(self) -> str:
        """The one kind that is set: "json", "regex", "choice", "grammar", "json_object" or
        "tool_calls"."""
        return next(k for k in _KINDS if _is_set(getattr(self, k)))

    @property
    def key(self) -> tuple[str, ...]:
        """``(kind, canonical text)``, plus the reasoning tags when set: the compile-cache key."""
        if self.reasoning is not None:
            return (*self.inner_key, *self.reasoning)
        return self.inner_key

    @property
    def inner_key(self) -> tuple[str, str]:
        """``(kind, canonical text)`` of what the kind constrains."""
        kind = self.kind
        if kind == "json":
            return kind, canonical_json(self.json_schema)
        if kind == "choice":
            return kind, canonical_json(list(self.choice or ()))
        if kind == "structural_tag":
            return kind, canonical_json(self.structural_tag_spec)
        if kind == "tool_calls":
            spec = self.tool_calls
            assert spec is not None
            return kind, canonical_json([spec.functions, spec.parallel, spec.syntax, spec.optional])
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    @property
    def json_schema(self) -> dict[str, Any] | bool:
        """The ``json`` schema as a Python value (parsed when it was given as text)."""
        value = json.loads(self.json) if isinstance(self.json, str) else self.json
        assert isinstance(value, (dict, bool)), "only set when kind is json"
        return value

    @property
    def structural_tag_spec(self) -> dict[str, Any]:
        """The ``structural_tag`` as a Python dict (parsed when it was given as text)."""
        value = self.structural_tag
        return json.loads(value) if isinstance(value, str) else value  # type: ignore[return-value]


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def _parsed(value: object, name: str) -> object:
    """``value``, or the value its JSON text spells."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise _invalid(f"structured_outputs.{name} is not valid JSON text ({e}).") from None


def _check_json(value: object) -> None:
    value = _parsed(value, "json")
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


def _check_structural_tag(value: object) -> None:
    check_structural_tag(_parsed(value, "structural_tag"))


def _check_tool_calls(value: object) -> None:
    if not isinstance(value, ToolCallSpec) or not value.functions:
        raise _invalid("structured_outputs.tool_calls must be built by tool_call_params().")


_CHECKS = {
    "json": _check_json,
    "regex": _check_text("regex"),
    "choice": _check_choice,
    "grammar": _check_text("grammar"),
    "json_object": lambda value: None,
    "structural_tag": _check_structural_tag,
    "tool_calls": _check_tool_calls,
}
