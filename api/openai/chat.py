"""POST /v1/chat/completions: the chat template (with tools), sampling, streaming, tool calls.

The request becomes engine inputs through the shared front half (``frontend.inputs``): tool mode
(``auto`` calls read in ``--tool-call-parser``'s syntax; ``required`` or a named function forced
by a grammar in that syntax, hermes without the flag), grammar, reasoning tags and parameters.
Each choice's reply is read by one ``ReplyParser`` into typed parts; this module only encodes
them: ``reasoning_content``, ``content`` and ``tool_calls`` deltas in chunks (a call's id and name,
then its arguments, one tool-call entry per chunk), or one message folded from the same parts, so
streamed and non-streamed choices agree (content up to surrounding whitespace).
``parallel_tool_calls: false`` keeps at most one call in every mode. ``reasoning_effort`` switches
the template's thinking as Responses' ``reasoning.effort`` does (``frontend/reasoning_effort.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from prefixserve.api.engine_client import Generation
from prefixserve.api.frontend.inputs import EngineInputs, TemplateServing
from prefixserve.api.frontend.protocol import APIError, random_id
from prefixserve.api.frontend.reasoning_effort import effort_kwargs
from prefixserve.api.frontend.request import GenerationRequest
from prefixserve.api.frontend.stream import ChoiceTotals, event_stream
from prefixserve.api.frontend.structured_outputs import structured_outputs_of
from prefixserve.api.frontend.tenancy import tenant_of
from prefixserve.api.openai.chunks import Chunks, usage_of
from prefixserve.api.openai.field_support import check_supported
from prefixserve.api.openai.prompt_cache import retention_of, retention_session, routing_key
from prefixserve.api.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionTokensDetails,
    FunctionCall,
    ToolCall,
    Usage,
)
from prefixserve.api.parsing.reply import (
    Finish,
    Part,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolMode,
    first_call,
    fold,
)
from prefixserve.core.outputs import CompletionOutput, RequestOutput


class ChatServing(TemplateServing):
    def render_request(self, req: ChatCompletionRequest, tools: list[dict] | None,
                       effort: dict[str, bool]) -> list[int]:  # fmt: skip
        """The prompt ids; ``effort``: the template kwargs ``reasoning_effort`` sets (the
        request's own ``chat_template_kwargs`` win)."""
        return self.render(
            req.messages, tools, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens, chat_template=req.chat_template,
            chat_template_kwargs={**effort, **(req.chat_template_kwargs or {})} or None,
            documents=req.documents,
        )  # fmt: skip

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        model = self.check_model(req.model)
        check_supported(req, "chat")
        template = req.chat_template or self.engine.tokenizer.chat_template
        effort = effort_kwargs(req.reasoning_effort, template)
        headers = {"x-prefixserve-ignored": "reasoning_effort"} if effort is None else {}
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs: requires logprobs=true", 400, "top_logprobs")
        tools = req.tool_request()
        results = tool_results(req.messages)
        structured, source = structured_outputs_of(req)
        if structured is not None and tools.choice in ("required", "named"):
            raise APIError(f"{source}: cannot be combined with a forced tool_choice", 400, source)
        prompt = await asyncio.to_thread(self.render_request, req, tools.tools, effort or {})
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        tenant = tenant_of(raw_request)
        request_id = "chatcmpl-" + (req.request_id or random_id(""))
        namespace = tenant.namespace(req.cache_salt)
        retention = retention_of(req.prompt_cache_retention,
                                 retention_session(namespace, request_id), tenant.owner)  # fmt: skip
        inputs = self.prepare(GenerationRequest(
            prompt, tools, req.sampling_options(), req.max_completion_tokens or req.max_tokens,
            (structured, source), logprobs, req.prompt_logprobs, tenant, retention, request_id,
            tuple(results),
        ))  # fmt: skip
        generation = await self.generate(
            request_id, [prompt], [inputs.params], "messages", inputs.grammar_source,
            routing_key(namespace, req.prompt_cache_key), stream=req.stream,
        )  # fmt: skip
        with self.owned(generation):
            if req.stream:
                return event_stream(self._stream(req, request_id, model, generation, inputs),
                                    headers)  # fmt: skip
        final = (await self.collect(raw_request, generation))[0]
        choices = [self._choice(req, c, inputs) for c in final.outputs]
        calls = choices[0].message.tool_calls  # the first reply's KV is the one retained
        self.tool_calls.paused(inputs, final.outputs[0].finish_reason,
                               calls[0].id if calls else None)  # fmt: skip
        usage = usage_of([final])
        if self.reasoning_parser is not None:
            counts = [self.reasoning_tokens(c.token_ids, ch.message.reasoning_content)
                      for c, ch in zip(final.outputs, choices)]  # fmt: skip
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(counts))
        response = ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage, **self._extras(req, final)
        )
        return JSONResponse(jsonable_encoder(response), headers=headers)

    def _extras(self, req: ChatCompletionRequest, final: RequestOutput) -> dict:
        """Response-level ``prompt_logprobs`` and ``prompt_token_ids`` when asked for."""
        extras: dict = {}
        if req.prompt_logprobs is not None and final.prompt_logprobs is not None:
            extras["prompt_logprobs"] = self.prompt_logprobs(
                final.prompt_logprobs, req.prompt_logprobs, req.prompt_logprobs,
                req.return_tokens_as_token_ids,
            )  # fmt: skip
        if req.return_token_ids:
            extras["prompt_token_ids"] = final.prompt_token_ids
        return extras

    def _echo(self, req: ChatCompletionRequest) -> str:
        """With ``echo``, the final assistant message's content (continued by the output)."""
        last = req.messages[-1]
        if not req.echo or last.get("role") != "assistant":
            return ""
        content = last.get("content") or ""
        if isinstance(content, list):
            return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content

    def _choice(self, req: ChatCompletionRequest, c: CompletionOutput,
                inputs: EngineInputs) -> ChatChoice:  # fmt: skip
        mode = inputs.mode
        parts = self.reply_parser(inputs).feed(self.visible_text(c, mode), _finish(c))
        reply = fold(parts)
        content: str | None = reply.text
        if mode is not ToolMode.NONE:
            content = reply.text.strip() or None
        if content is not None or not (reply.calls or mode.forced):
            content = self._echo(req) + (content or "")
        calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name,
                                                            arguments=call.arguments))
                 for call in reply.calls]  # fmt: skip
        lps = self._logprobs(req, c.logprobs, c.token_ids) if c.logprobs is not None else None
        message = ChatMessage(content=content, reasoning_content=reply.reasoning, tool_calls=calls)
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=lps,
            finish_reason=_finish_reason(c.finish_reason, mode, bool(calls)),
            stop_reason=c.stop_reason,
            token_ids=c.token_ids if req.return_token_ids else None,
        )

    def _logprobs(
        self, req: ChatCompletionRequest, entries: list[dict[int, float]], token_ids: list[int]
    ) -> dict:
        k = req.top_logprobs or 0

        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id, req.return_tokens_as_token_ids)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for entry, token in zip(entries, token_ids):
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
            content.append(
                {**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in top]}
            )
        return {"content": content}

    def _stream(self, req: ChatCompletionRequest, request_id: str, model: str,
                generation: Generation, inputs: EngineInputs) -> AsyncIterator[str]:  # fmt: skip
        base = {"id": request_id, "object": "chat.completion.chunk", "model": model}
        reasoning_tokens: dict[int, int] = {}

        def usage_details(usage: Usage) -> Usage:
            if self.reasoning_parser is not None:
                details = CompletionTokensDetails(reasoning_tokens=sum(reasoning_tokens.values()))
                usage.completion_tokens_details = details
            return usage

        encoder = _ChoiceEncoder(self, req, inputs, reasoning_tokens)
        roles = [{"choices": [_choice(i, {"role": "assistant", "content": ""})]}
                 for i in range(req.n)]  # fmt: skip
        return Chunks(base, req.stream_options, 1, usage_details).lines(
            generation, lambda _, out: encoder.events(out), roles
        )


def _choice(index: int, delta: dict, logprobs=None, finish_reason=None, **extra) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, **extra}  # fmt: skip


class _ChoiceEncoder:
    """A streamed chat completion's choices: each DELTA output's chunk bodies."""

    def __init__(self, serving: ChatServing, req: ChatCompletionRequest, inputs: EngineInputs,
                 reasoning_tokens: dict[int, int]) -> None:  # fmt: skip
        self.serving, self.req, self.inputs = serving, req, inputs
        self.parsers = {i: serving.reply_parser(inputs) for i in range(req.n)}
        self.totals = ChoiceTotals()
        self.call_ids: dict[int, str] = {}  # each choice's first call
        self.reasoning_tokens = reasoning_tokens
        self.echo = serving._echo(req)
        self.sent_extras = False

    def events(self, out: RequestOutput) -> Iterator[dict]:
        serving, req, inputs, mode = self.serving, self.req, self.inputs, self.inputs.mode
        for c in out.outputs:
            text = serving.visible_text(c, mode)
            if not (text or c.token_ids or c.finish_reason):
                continue
            _, first = self.totals.add(c.index, c)
            finish = _finish(c) if c.finish_reason is not None else None
            parts = self.parsers[c.index].feed(text, finish)
            if (call_id := first_call(parts)) is not None:
                self.call_ids.setdefault(c.index, call_id)
            deltas = _message_deltas(parts, self.echo if first and mode is ToolMode.NONE
                                     else "") or [{}]  # fmt: skip
            lps = (serving._logprobs(req, c.logprobs, c.token_ids)
                   if c.logprobs is not None and c.token_ids else None)  # fmt: skip
            reason = None
            if finish is not None:
                done = parts[-1]
                assert isinstance(done, Finish)
                reason = _finish_reason(c.finish_reason, mode, done.called)
                if c.index == 0:  # the first reply's KV is the one retained
                    serving.tool_calls.paused(inputs, c.finish_reason, self.call_ids.get(0))
                self.reasoning_tokens[c.index] = serving.reasoning_tokens(
                    self.totals.token_ids(c.index), "" if done.reasoned else None)  # fmt: skip
            for k, delta in enumerate(deltas):  # logprobs first, the finish reason last
                last = k == len(deltas) - 1
                part_lps, part_reason = (lps if k == 0 else None), (reason if last else None)
                extra = {"stop_reason": c.stop_reason} if part_reason else {}
                if req.return_token_ids:
                    extra["token_ids"] = c.token_ids if k == 0 else []
                if delta or part_lps or part_reason or extra.get("token_ids"):
                    body = {"choices": [_choice(c.index, delta, part_lps, part_reason, **extra)]}
                    if not self.sent_extras:  # prompt_logprobs, prompt_token_ids: once
                        body.update(serving._extras(req, out))
                        self.sent_extras = True
                    yield body


def tool_results(messages: list[dict]) -> list[str]:
    """The ``tool_call_id`` of each tool message (a 400 for one that is not a string: checked
    before anything reaches the engine)."""
    ids = []
    for i, m in enumerate(messages):
        call_id = m.get("tool_call_id") if isinstance(m, dict) and m.get("role") == "tool" else None
        if call_id is not None and not isinstance(call_id, str):
            raise APIError(f"messages[{i}].tool_call_id: must be a string", 400, "messages")
        if call_id is not None:
            ids.append(call_id)
    return ids


def _finish(c: CompletionOutput) -> Finish:
    return Finish(c.finish_reason, c.stop_reason)


def _message_deltas(parts: list[Part], echo: str) -> list[dict]:
    """A choice's new message deltas, one per chunk: reasoning, content (after ``echo``), and
    per call its id and name, then its arguments (one tool-call entry per chunk, as OpenAI and
    vLLM send them)."""
    deltas: list[dict] = []
    for part in parts:
        if isinstance(part, ReasoningDelta):
            deltas.append({"reasoning_content": part.text})
        elif isinstance(part, TextDelta):
            if deltas and "content" in deltas[-1]:
                deltas[-1] = {"content": deltas[-1]["content"] + part.text}
            else:
                deltas.append({"content": part.text})
        elif isinstance(part, ToolCallDelta):
            if part.call_id is not None:
                deltas.append({"tool_calls": [{"index": part.index, "id": part.call_id,
                               "type": "function", "function": {"name": part.name,
                                                                "arguments": ""}}]})  # fmt: skip
            if part.arguments:
                deltas.append({"tool_calls": [{"index": part.index,
                                               "function": {"arguments": part.arguments}}]})  # fmt: skip
    if echo:
        first = next((k for k, d in enumerate(deltas) if "content" in d), None)
        if first is None:
            deltas.append({"content": echo})
        else:
            deltas[first] = {"content": echo + deltas[first]["content"]}
    return deltas


def _finish_reason(reason: str | None, mode: ToolMode, called: bool) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto) or had to call any function
    (required) and stopped; a call of a named function ends with "stop"."""
    if reason == "stop" and called and mode in (ToolMode.AUTO, ToolMode.REQUIRED):
        return "tool_calls"
    return reason
