"""The request fields that constrain an output, turned into one ``StructuredOutputsParams``.

A request may use one of: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``; vLLM's ``structural_tag``), vLLM's ``structured_outputs`` object (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``), or vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. Two of them at once is a 400, as is an unknown
``response_format`` type or a ``json_schema`` without its ``schema``. Whether the grammar compiles
is checked next, by the engine's compiler, before anything is queued.
"""

from __future__ import annotations

from typing import Any

from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.structured_outputs.params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def structured_outputs_of(req: Any) -> tuple[StructuredOutputsParams | None, str]:
    """``(params or None, the request field they came from)``; a 400 on a bad combination."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = _response_format(req.response_format)
    if fmt is not None:
        given.append(("response_format", fmt))
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(_FIELDS))
        if unknown:
            raise APIError(
                f"structured_outputs: unknown field(s) {unknown}; use one of {list(_FIELDS)}",
                400,
                "structured_outputs",
            )
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            given.append((name, {kind: value}))
    if not given:
        return None, ""
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(
            f"{names}: give one way to constrain the output, not several", 400, given[1][0]
        )
    source, kwargs = given[0]
    try:
        return StructuredOutputsParams(**kwargs), source
    except InvalidArgumentError as exc:
        raise APIError(str(exc), 400, source) from exc


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """``StructuredOutputsParams`` keyword arguments of OpenAI's ``response_format``."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise APIError(
                "response_format.json_schema: give {'name': ..., 'schema': {...}} with the "
                "JSON schema the reply must match",
                400,
                "response_format",
            )
        return {"json": spec["schema"]}
    if kind == "structural_tag":  # vLLM: the rest of the object is the tag's spec
        return {"structural_tag": {k: v for k, v in fmt.items() if k != "type"}}
    raise APIError(
        f"response_format.type: {kind!r} is not supported; use 'text', 'json_object', "
        "'json_schema' or 'structural_tag'",
        400,
        "response_format",
    )
