"""Structural tags (vLLM's ``structural_tag``): free text whose tagged regions are constrained.

Two shapes, both as vLLM accepts them (in ``response_format`` with ``"type": "structural_tag"``, or
as the JSON text of ``structured_outputs.structural_tag``):

- xgrammar's: ``{"format": {...}}`` (any xgrammar structural-tag format), compiled as given.
- vLLM's legacy: ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``: the text
  is free until it writes a trigger; from there one structure is written, ``begin``, JSON matching
  its ``schema`` in prefixserve's one JSON format (``json_grammar``), ``end``; then free text
  again. It becomes xgrammar's ``triggered_tags`` format (each ``begin`` starts with a trigger).
"""

from __future__ import annotations

import json
from typing import Any

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.structured_outputs.json_grammar import ANY_OBJECT, json_schema_ebnf


def check_structural_tag(spec: Any) -> None:
    """Raise ``InvalidArgumentError`` unless ``spec`` (parsed JSON) has one of the two shapes."""
    if not isinstance(spec, dict) or ("format" in spec) == ("structures" in spec):
        raise _invalid("give {'format': {...}} or {'structures': [...], 'triggers': [...]}")
    if "format" in spec:
        if not isinstance(spec["format"], dict):
            raise _invalid("'format' must be an xgrammar structural-tag format object")
        return
    structures, triggers = spec["structures"], spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise _invalid("'structures' must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise _invalid("'triggers' must be a list of non-empty strings")
    for s in structures:
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str)
                and isinstance(s.get("end"), str)):  # fmt: skip
            raise _invalid("every structure needs string 'begin' and 'end'")
        if not isinstance(s.get("schema"), (dict, bool, type(None))):
            raise _invalid("a structure's 'schema' must be a JSON schema object")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise _invalid(f"the structure begin {s['begin']!r} starts with none of the triggers")


def xgrammar_structural_tag(spec: dict[str, Any]) -> dict[str, Any]:
    """The xgrammar structural tag of a checked ``spec``. Raises RuntimeError (from xgrammar)
    when a schema cannot be converted."""
    if "format" in spec:
        return {"type": "structural_tag", "format": spec["format"]}
    tags = [
        {
            "type": "tag",
            "begin": s["begin"],
            "content": {"type": "grammar", "grammar": json_schema_ebnf(_schema_text(s))},
            "end": s["end"],
        }
        for s in spec["structures"]
    ]
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": spec["triggers"], "tags": tags},
    }


def _schema_text(structure: dict[str, Any]) -> str:
    schema = structure.get("schema")
    return ANY_OBJECT if schema is None else json.dumps(schema, ensure_ascii=False)


def _invalid(why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"structured_outputs.structural_tag: {why}.", "structured_outputs")
