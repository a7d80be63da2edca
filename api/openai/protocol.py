"""Request and response bodies of the OpenAI-compatible API (pydantic 2).

Requests accept and ignore unknown fields, as OpenAI clients send extras freely. Validation here is
about shapes and about the bounds that keep one request's cost bounded (``n``, ``logprobs``,
``seed``); the other value ranges are checked by ``SamplingParams`` so both APIs share one set of
rules.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field, StrictBool

from prefixserve.api.frontend.protocol import APIError, Lenient, ToolRequest, random_id
from prefixserve.api.frontend.request import FRONT_HALF_FIELDS, SamplingOptions
from prefixserve.core.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 16
"""Most choices (``n``, or beams) one request may ask for."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
_ChoiceT = TypeVar("_ChoiceT", bound=BaseModel)


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (vLLM)


class FunctionDefinition(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _SamplingFields(Lenient):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: str | None = None
    segment_reuse: StrictBool | None = None  # opt out of --segment-reuse (kv/segments.py)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # structured outputs: one of these (see BaseServing.structured_outputs)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    request_id: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_options(self) -> SamplingOptions:
        """This request's sampling fields, as the shared front half takes them."""
        return SamplingOptions.of(**self.model_dump(include=_SAMPLING_OPTIONS, exclude_unset=True))


_SAMPLING_OPTIONS = {f.name for f in dataclasses.fields(SamplingParams)} - FRONT_HALF_FIELDS | {
    "use_beam_search", "length_penalty"}  # fmt: skip


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # checked in field_support, as the template's switch
    prompt_cache_key: str | None = None  # api.openai.prompt_cache
    prompt_cache_retention: str | None = None

    def tool_request(self) -> ToolRequest:
        """The request's tools and tool choice (a 400 for a shape OpenAI does not define)."""
        choice = self.tool_choice
        named = isinstance(choice, dict)
        if named and not isinstance((choice.get("function") or {}).get("name"), str):
            raise APIError(
                'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                400,
                "tool_choice",
            )
        if choice not in (None, "none", "auto", "required") and not named:
            raise APIError(
                f"tool_choice: {choice!r} is not supported; use 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                400,
                "tool_choice",
            )
        if self.tools is not None and not self.tools:
            raise APIError(
                "tools: must not be empty; list at least one function or leave tools out",
                400,
                "tools",
            )
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        kind = "named" if named else choice or ("auto" if tools else "none")
        name = choice["function"]["name"] if named else None
        return ToolRequest(tools, kind, name, self.parallel_tool_calls)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True


class ReleaseRequest(Lenient):
    """``POST /v1/kv/release`` (prefixserve's): ``id`` of a response or completion, or None for
    the ``cache_control`` prefixes of the caller's ``cache_salt``."""

    id: str | None = None
    cache_salt: str | None = None


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDefinition] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose K/V this request did not compute (prefix hits and
    reused segments); ``reused_segment_tokens``: of those, the ones from reused segments
    (``--segment-reuse``)."""

    cached_tokens: int = 0
    reused_segment_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # with --reasoning-parser


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("call_"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


class _Choice(BaseModel):
    """What a choice of any completion carries: where it stands, its logprobs, why it ended."""

    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChoice(_Choice):
    message: ChatMessage
    token_ids: list[int] | None = None  # return_token_ids


class _CompletionResponseFields(BaseModel, Generic[_ChoiceT]):
    """What every non-streaming completion response carries, in wire order; a subclass pins
    ``object`` (a redeclared field keeps its place) and appends its own fields after ``usage``."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[_ChoiceT]
    usage: Usage


class ChatCompletionResponse(_CompletionResponseFields[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class CompletionChoice(_Choice):
    text: str
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(_CompletionResponseFields[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ModelCard(BaseModel):
    """A served model in OpenAI's shape, with the fields Anthropic's clients read added
    (``type``, ``display_name``, ``created_at``), so both SDKs list the same models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "prefixserve"
    root: str | None = None
    max_model_len: int | None = None
    type: Literal["model"] = "model"
    display_name: str = ""
    created_at: str = ""

    def model_post_init(self, _: Any) -> None:
        self.display_name = self.display_name or self.id
        when = time.gmtime(self.created)
        self.created_at = self.created_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", when)


class ModelList(BaseModel):
    """OpenAI's list, with Anthropic's paging fields (one page holds every model)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None

    def model_post_init(self, _: Any) -> None:
        if self.data:
            self.first_id, self.last_id = self.data[0].id, self.data[-1].id
