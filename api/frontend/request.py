"""One typed request from every protocol: what the shared front half (``TemplateServing.prepare``)
turns into engine inputs. Each protocol builds it from its own schema (chat and text
completions: ``_SamplingFields.sampling_options``; Responses and Messages from their fields);
none builds another protocol's request object for it, and the front half reads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.api.frontend.protocol import ToolRequest
from prefixserve.api.frontend.tenancy import NO_TENANT, Tenant
from prefixserve.kv.retention import KVRetention
from prefixserve.structured_outputs.params import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """A request's sampling fields in vLLM's names; None where the request left one out (the
    engine's default then applies). ``use_beam_search`` with ``length_penalty``: beam search of
    width ``n`` (the other options must stay neutral)."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    segment_reuse: bool | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0


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
