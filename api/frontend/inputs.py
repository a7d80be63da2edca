"""The shared front half: any protocol's request -> the engine's inputs, once.

Chat completions, Responses and Messages each turn their own request into a ``ToolRequest`` (the
tools the template shows and how calls come out) and a prompt; ``TemplateServing`` does the rest
the same way for all three::

    ToolRequest  --tool_mode-->  ToolMode         none | auto | required | named (400s here)
    prompt ids   --reasoning-->  tags | None      whether the reply opens with a reasoning block
    + format     --grammar---->  params | None    forced calls, a response format, or strict
                                                  auto calls (hermes); after the reasoning
    + sampling   --params----->  SamplingParams   special tokens kept in tool modes (tags)
                                 = EngineInputs   -> generate, then one ReplyParser per choice

Invariant: a request's grammar, tool mode, reasoning tags and parameters depend only on these
inputs, never on the protocol, so the three protocols generate the same tokens for the same
prompt and tools. ``visible_text`` drops the EOS text that tool modes keep (special tokens are
shown there so that tags survive detokenization).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from prefixserve.api.engine_client import EngineClient
from prefixserve.api.frontend.protocol import APIError, ToolRequest
from prefixserve.api.frontend.request import GenerationRequest
from prefixserve.api.frontend.serving import BaseServing
from prefixserve.api.frontend.tenancy import NO_TENANT, Tenant
from prefixserve.api.frontend.tool_call_retention import ToolCallRetention
from prefixserve.api.parsing.reasoning import (
    count_reasoning_tokens,
    reasoning_parser,
    reasoning_tags,
)
from prefixserve.api.parsing.reply import ReplyParser, ToolMode, forced_syntax
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.core.outputs import CompletionOutput
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.engine.chat_template import render_chat
from prefixserve.engine.request_chat_template import TemplateLimits
from prefixserve.structured_outputs.params import StructuredOutputsParams
from prefixserve.structured_outputs.tool_calls import optional_tool_call_params, tool_call_params

PROMPT_TAIL_TOKENS = 32  # enough of the prompt's end to see where a reasoning block stands


@dataclass(frozen=True, slots=True)
class EngineInputs:
    """What the engine gets for one request and what its replies are read with."""

    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    mode: ToolMode
    tools: ToolRequest
    prompt_tail: str
    grammar_source: str | None = None
    tenant: Tenant = NO_TENANT  # who asks (its share of the retention budget, ``tool_calls``)


class TemplateServing(BaseServing):
    """The serving base of the protocols that render a chat template (chat completions,
    Responses, Messages): one ``--tool-call-parser``, one ``--reasoning-parser``, one content
    format for all of them. ``template_limits``: the bounds a request's own ``chat_template``
    renders under (``request_chat_template``); None refuses one (a 400)."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_names: list[str],
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        content_format: str = "auto",
        retain_tool_calls: bool = True,
        template_limits: TemplateLimits | None = None,
        **options: Any,
    ) -> None:
        super().__init__(engine, served_model_names, **options)
        self.template_limits = template_limits
        self.tool_calls = ToolCallRetention(engine, retain_tool_calls)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.content_format = content_format
        texts = {engine.tokenizer.decode([t]) for t in engine.eos_token_ids} - {""}
        self.eos_texts = tuple(sorted(texts, key=len, reverse=True))

    def tool_mode(self, tools: ToolRequest) -> ToolMode:
        """How calls come out; a 400 when the choice needs tools or a parser it does not have."""
        if not tools.tools:
            if tools.choice != "none":
                raise APIError(
                    f"tool_choice: {tools.choice!r} needs tools; list the functions in tools",
                    400,
                    "tool_choice",
                )
            return ToolMode.NONE
        if tools.choice == "auto" and self.tool_parser is None:
            raise APIError(
                "tool_choice: 'auto' with tools requires the server to run with "
                "--tool-call-parser (or force a call with 'required' or a named function)",
                400,
                "tool_choice",
            )
        return ToolMode(tools.choice)

    def render(self, messages: list[dict], tools: list[dict] | None, **template: Any) -> list[int]:
        """The chat template's prompt ids (a 400 naming the field the template refused, or a
        request's ``chat_template`` the server does not accept)."""
        if template.get("chat_template") is not None and self.template_limits is None:
            raise APIError(
                "chat_template: this server renders the model's own chat template only; leave "
                "chat_template out (an operator may accept one per request with "
                "--allow-client-chat-template)",
                400,
                "chat_template",
            )
        try:
            return render_chat(self.engine.tokenizer, messages, tools=tools,
                               content_format=self.content_format,
                               template_limits=self.template_limits, **template)  # fmt: skip
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, exc.param) from exc

    def prepare(self, request: GenerationRequest) -> EngineInputs:
        """The engine inputs of ``request``: its tool mode, grammar (the response format, or the
        forced calls that replace it), reasoning tags and sampling parameters, salted for its
        tenant, with its retention: its own, a provisional pause when its reply may call a
        tool, and the sessions of the tool results it carries (``tool_call_retention``)."""
        tools, prompt, sampling = request.tools, request.prompt_token_ids, request.sampling
        mode = self.tool_mode(tools)
        tail = self.engine.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:])
        grammar, source = self._grammar(tools, mode, request.structured, reasoning_tags(
            self.reasoning_parser, tail))  # fmt: skip
        retention, tenant = request.retention, request.tenant
        if mode is not ToolMode.NONE and request.request_id and not sampling.use_beam_search:
            retention += self.tool_calls.pause(
                request.request_id, tenant, sampling.params.cache_salt
            )
        resumes = self.tool_calls.resumes(tenant, sampling.params.cache_salt, request.tool_results)
        params = self.make_params(sampling, request.max_tokens, request.logprobs, grammar,
                                  request.prompt_logprobs, tenant, retention, resumes)  # fmt: skip
        if mode is not ToolMode.NONE and hasattr(params, "skip_special_tokens"):
            params.skip_special_tokens = False  # tool-call tags may be special tokens
        return EngineInputs(prompt, params, mode, tools, tail, source, tenant)

    def _grammar(
        self,
        tools: ToolRequest,
        mode: ToolMode,
        structured: tuple[StructuredOutputsParams | None, str | None],
        reasoning: tuple[str, str] | None,
    ) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the grammar, the request field it came from): forced calls in the forced syntax;
        else the response format; else, with ``auto``, strict tools and hermes, the optional-call
        grammar (it exists in that syntax alone). Every grammar applies after the reasoning."""
        grammar, source = structured
        try:
            if mode.forced:
                grammar, source = tool_call_params(
                    tools.grammar_tools or tools.tools or [], tools.name, tools.parallel,
                    forced_syntax(self.tool_parser), reasoning,
                ), "tool_choice"  # fmt: skip
            elif (
                grammar is None
                and mode is ToolMode.AUTO
                and tools.strict
                and self.tool_parser == "hermes"
            ):
                grammar = optional_tool_call_params(tools.grammar_tools or tools.tools or [],
                                                    set(tools.strict), tools.parallel)  # fmt: skip
                source = "tools"
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, exc.param) from exc
        if grammar is not None and reasoning is not None:
            grammar = dataclasses.replace(grammar, reasoning=reasoning)
        return grammar, source

    def reply_parser(self, inputs: EngineInputs) -> ReplyParser:
        """A fresh parser for one reply (one per choice)."""
        reasoner = None
        if self.reasoning_parser is not None:
            reasoner = reasoning_parser(self.reasoning_parser, inputs.prompt_tail)
        tools = inputs.tools
        return ReplyParser(inputs.mode, self.tool_parser, tools.grammar_tools or tools.tools,
                           reasoner, tools.parallel)  # fmt: skip

    def visible_text(self, c: CompletionOutput, mode: ToolMode) -> str:
        """``visible_text`` with this server's EOS texts."""
        return visible_text(c, mode, self.eos_texts)

    def reasoning_tokens(self, token_ids: list[int], reasoning: str | None) -> int:
        """How many of an output's tokens are reasoning (``reasoning``: None without a block)."""
        return count_reasoning_tokens(self.engine.tokenizer, token_ids, reasoning)


def visible_text(c: CompletionOutput, mode: ToolMode, eos_texts: tuple[str, ...]) -> str:
    """The output text, less the EOS text that tool modes keep (special tokens shown):
    ``eos_texts``, longest first."""
    if mode is not ToolMode.NONE and c.finish_reason == "stop":
        for eos in eos_texts:
            if c.text.endswith(eos):
                return c.text[: -len(eos)]
    return c.text
