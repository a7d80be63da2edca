"""Every field the openai SDK documents for ``responses.create`` is honoured or refused."""

from __future__ import annotations

from openai.types.responses.response_create_params import ResponseCreateParamsBase

from prefixserve.api.openai.responses.protocol import ResponsesRequest, refused_fields


def test_every_documented_field_is_honoured_or_refused():
    documented = set(ResponseCreateParamsBase.__annotations__) | {"stream"}
    known = set(ResponsesRequest.model_fields) | set(refused_fields())
    assert documented <= known, sorted(documented - known)
