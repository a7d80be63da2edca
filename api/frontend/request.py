"""One typed request from every protocol: what the shared front half (``TemplateServing.prepare``)
turns into engine inputs. Each protocol builds it from its own schema (chat and text
completions: ``_SamplingFields.sampling_options``; Responses and Messages from their fields; all
through ``SamplingOptions.of``): none builds another protocol's request object for it, and the
front half reads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixserve.api.frontend.protocol import APIError, ToolRequest
from prefixserve.api.frontend.tenancy import NO_TENANT, Tenant
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.core.sampling_params import SamplingParams
from prefixserve.kv.retention import KVRetention
from prefixserve.structured_outputs.params import StructuredOutputsParams

FRONT_HALF_FIELDS = frozenset({"max_tokens", "logprobs", "structured_outputs", "prompt_logprobs",
                               "kv_retention", "kv_resume", "output_kind"})  # fmt: skip
"""``SamplingParams`` fields the front half sets itself (from the request's limits, formats,
tenant and retention), never a protocol's sampling options."""


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """A request's sampling fields: ``params`` holds those it gave (vLLM's names and checks, the
    engine's defaults for the rest) and ``given`` their names; ``use_beam_search`` with
    ``length_penalty``: beam search of width ``params.n`` (the other options must stay neutral).

    Invariant: ``params`` sets none of ``FRONT_HALF_FIELDS`` (``max_tokens`` is None) and is
    never mutated: the front half derives each request's parameters from a copy.
    """

    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=None))
    given: frozenset[str] = frozenset()
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @classmethod
    def of(cls, use_beam_search: bool = False, length_penalty: float = 1.0, **fields: Any):
        """The options of a protocol's sampling ``fields`` (a field left out or None takes the
        engine's default). A value the engine refuses is a 400 naming its field; a key of
        ``logit_bias`` that is not a token id too (OpenAI sends them as strings)."""
        given = {name: value for name, value in fields.items() if value is not None}
        owned = FRONT_HALF_FIELDS.intersection(given)
        if owned:
            raise TypeError(f"sampling options may not set {sorted(owned)}")
        if "logit_bias" in given:
            given["logit_bias"] = _logit_bias(given["logit_bias"])
        try:
            params = SamplingParams(max_tokens=None, **given)
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, exc.param) from exc
        return cls(params, frozenset(given), use_beam_search, length_penalty)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(
                f"logit_bias: {key!r} is not a token id; the keys are token ids", 400, "logit_bias"
            ) from None
    return out


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as the front half takes it: the rendered prompt, its tools, sampling and
    output limits, who asks and what KV it retains.

    ``structured``: the response format's grammar and the request field it came from (a forced
    tool call replaces it); ``logprobs``: top logprobs per generated token (None: none);
    ``prompt_logprobs``: vLLM's; ``retention``: the prompt KV to keep past the request
    (``prompt_cache_retention``, ``cache_control`` marks), which the engine applies
    (``SamplingParams.kv_retention``); ``request_id``: names the pause on a tool call the reply
    may end with (``tool_call_retention``); ``tool_results``: the call ids whose results the
    request carries (their pauses end).
    """

    prompt_token_ids: list[int]
    tools: ToolRequest
    sampling: SamplingOptions
    max_tokens: int | None
    structured: tuple[StructuredOutputsParams | None, str | None] = (None, None)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    tenant: Tenant = NO_TENANT
    retention: tuple[KVRetention, ...] = ()
    request_id: str | None = None
    tool_results: tuple[str, ...] = ()
