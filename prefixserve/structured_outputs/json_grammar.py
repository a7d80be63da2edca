"""JSON schema -> EBNF, in the one JSON format prefixserve generates.

JSON is written on one line with the separators ``", "`` and ``": "`` and no other whitespace
between tokens (xgrammar's ``any_whitespace=False``; ``max_whitespace_cnt`` is then moot): a weak
model cannot loop on whitespace, and the text is what Hugging Face chat templates' ``tojson``
writes, so a forced tool call re-renders byte for byte in the next turn's prompt. Object
properties come in the schema's declared order; properties the schema does not declare are not
generated (xgrammar's ``strict_mode``).
"""

from __future__ import annotations

import json

import xgrammar as xgr

JSON_SEPARATORS = (", ", ": ")
ANY_OBJECT = '{"type": "object"}'  # the schema of any JSON object
EBNF_KEY = "x-prefixserve-ebnf"  # a schema's own grammar (see json_schema_ebnf)

# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as [^"\\\r\n], which
# lets raw control characters (invalid in JSON) through; plain strings exclude them. Same fix here.
_LENGTH_LIMITED_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def json_schema_ebnf(schema: str) -> str:
    """EBNF (root rule ``root``) of the JSON values the schema (JSON text) allows, as above; a
    schema holding ``EBNF_KEY`` is that EBNF (a custom tool's arguments, written by the API).

    Raises RuntimeError (from xgrammar) when the schema cannot be converted.
    """
    value = json.loads(schema)
    if isinstance(value, dict) and isinstance(value.get(EBNF_KEY), str):
        return value[EBNF_KEY]
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
    return str(grammar).replace(_LENGTH_LIMITED_CHAR, _JSON_STRING_CHAR)
