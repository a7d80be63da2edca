"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request maps onto the chat-completions request with the same prompt (``prompt``); the shared
front half (``frontend.inputs``) turns it into the engine's inputs (tool mode, forced-call
grammars, reasoning, parameters) as for every protocol. What is Anthropic's here: the reply's
content blocks (``blocks``), ``stop_reason``, usage in cache terms, and the event stream::

    message_start (usage) -> ping -> per block: content_block_start, content_block_delta*
    (thinking_delta | text_delta | input_json_delta), content_block_stop -> message_delta (stop_reason,
    stop_sequence, final usage) -> message_stop

with a ``ping`` every ``PING_INTERVAL_S`` of silence, and an ``error`` event if it fails midway
(``stream.drive``). ``message_start`` waits for the request's first output (at most
``FIRST_OUTPUT_WAIT_S``) so that its usage already splits the prompt by the cache (Claude Code
reads usage there); after a longer wait it counts the whole prompt as ``input_tokens`` and
``message_delta`` carries the split (cumulative totals, as Anthropic's do).

Invariant: a non-streamed reply's content is the blocks its stream would send (``content_of``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

from fastapi import Request

from prefixserve.api.anthropic.blocks import BlockEvents, content_of
from prefixserve.api.anthropic.cache_control import (
    breakpoints,
    common_prefix,
    retentions,
    split_usage,
)
from prefixserve.api.anthropic.prompt import to_chat_request
from prefixserve.api.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    anthropic_error,
)
from prefixserve.api.frontend.inputs import EngineInputs, TemplateServing
from prefixserve.api.frontend.protocol import APIError, ToolRequest, random_id
from prefixserve.api.frontend.stream import DeltaTracker, drive, event_stream
from prefixserve.api.frontend.structured_outputs import structured_outputs_of
from prefixserve.api.frontend.tenancy import tenant_of
from prefixserve.api.frontend.thinking_budget import BudgetedStream
from prefixserve.api.openai.protocol import ChatCompletionRequest
from prefixserve.api.parsing.reply import Finish
from prefixserve.core.outputs import CompletionOutput, RequestOutput

PING_INTERVAL_S = 10.0
FIRST_OUTPUT_WAIT_S = 30.0


def usage_of(out: RequestOutput, block_size: int | None,
             marks: tuple[tuple[int, float], ...] = ()) -> MessagesUsage:  # fmt: skip
    """The prompt split by the prefix cache (``cache_control.split_usage``). ``block_size``: of
    the prefix cache, None when it is off; ``marks``: (position, TTL) of each breakpoint, each
    counted as far as the engine retained it (``out.kv_retained_tokens``)."""
    return split_usage(len(out.prompt_token_ids), out.num_cached_tokens, list(marks),
                       block_size, sum(len(c.token_ids) for c in out.outputs),
                       out.kv_retained_tokens)  # fmt: skip


def stop_reason_of(c: CompletionOutput, called: bool) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)``: a tool call wins; a matched stop string is
    ``stop_sequence``; EOS or a stop token ``end_turn``; the token limit ``max_tokens``."""
    if called:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    if c.finish_reason == "stop":
        return "end_turn", None
    return None, None


def event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


class MessagesServing(TemplateServing):
    """The Messages endpoints. ``drop_attribution``: leave out Claude Code's attribution block
    (``prompt``).

    ``force_tool_call`` (a testing aid, ``--messages-force-tool-call``): ``{"name",
    "input_schema"}``. A request that lists a tool of that name and whose last user or assistant
    message is the user's own turn (no tool_result in it) is answered with a forced call of that
    tool whose input matches ``input_schema``, as if it had ``tool_choice {"type": "tool"}``; the
    prompt still shows the tool's own schema. It lets an agent client drive a random-weight model
    through a tool turn.
    """

    def __init__(self, engine, served_model_names: list[str], drop_attribution: bool = True,
                 force_tool_call: dict | None = None, **options) -> None:  # fmt: skip
        super().__init__(engine, served_model_names, **options)
        self.drop_attribution = drop_attribution
        self.force_tool_call = force_tool_call
        self.block_size = engine.prefix_cache_block_size

    def _chat_request(self, req: CountTokensRequest) -> ChatCompletionRequest:
        self.check_model(req.model)
        return to_chat_request(req, self.drop_attribution, self.tool_parser is not None)

    def _render(self, chat_req: ChatCompletionRequest, tools: list[dict] | None) -> list[int]:
        return self.render(chat_req.messages, tools,
                           add_generation_prompt=chat_req.add_generation_prompt,
                           continue_final_message=chat_req.continue_final_message,
                           chat_template_kwargs=chat_req.chat_template_kwargs)  # fmt: skip

    def _render_marked(
        self, req: MessagesRequest, chat_req: ChatCompletionRequest, tools: list[dict] | None
    ) -> tuple[list[int], tuple[tuple[int, float], ...]]:
        """The prompt, and (position, TTL) of each ``cache_control`` breakpoint in it (a cut the
        template refuses to render marks nothing)."""
        found = breakpoints(req, self.drop_attribution)  # a malformed mark: a 400 first
        prompt = self._render(chat_req, tools)
        marks = []
        for mark in found:
            try:
                cut = self.render(mark.messages, mark.tools, add_generation_prompt=False,
                                  chat_template_kwargs=chat_req.chat_template_kwargs)  # fmt: skip
            except APIError:
                cut = []
            marks.append((common_prefix(cut, prompt), mark.ttl_s))
        return prompt, tuple(marks)

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        chat_req = self._chat_request(req)
        prompt = await asyncio.to_thread(self._render, chat_req, chat_req.tool_request().tools)
        return {"input_tokens": len(prompt)}

    async def create(self, req: MessagesRequest, raw_request: Request):
        chat_req = self._chat_request(req)
        model = self.check_model(req.model)
        tools = self._force(req, chat_req, chat_req.tool_request())
        prompt, marks = await asyncio.to_thread(self._render_marked, req, chat_req, tools.tools)
        structured = structured_outputs_of(chat_req)
        tenant = tenant_of(raw_request)
        inputs = self.inputs(prompt, tools, chat_req, req.max_tokens, structured=structured,
                             tenant=tenant)  # fmt: skip
        inputs.params.kv_retention = retentions(
            marks, tenant.namespace(req.cache_salt), tenant.owner
        )
        message_id = random_id("msg_")
        results = [m["tool_call_id"] for m in chat_req.messages if m.get("role") == "tool"]
        streams = await self.add_all(message_id, [prompt], [inputs.params], "messages",
                                     inputs.grammar_source)  # fmt: skip
        with self.owned(streams):
            self.tool_calls.resumed(inputs, results)
            thinking = req.thinking or {}
            if thinking.get("type") == "enabled":
                streams = [BudgetedStream(self.engine, streams[0], prompt, inputs.params,
                                          thinking["budget_tokens"],
                                          self.reasoning_parser or "qwen3", inputs.prompt_tail,
                                          self.request_timeout)]  # fmt: skip
            if req.stream:
                return event_stream(self._stream(message_id, model, streams, inputs, marks))
        final = (await self.collect(raw_request, streams))[0]
        c = final.outputs[0]
        blocks = BlockEvents(self.reply_parser(inputs))
        content = content_of(blocks.feed(self.visible_text(c, inputs.mode), _finish(c)))
        reason, sequence = stop_reason_of(c, blocks.has_calls)
        self.tool_calls.paused(inputs, c, blocks.first_call)
        return MessagesResponse(
            id=message_id, model=model, content=content, stop_reason=reason,
            stop_sequence=sequence, usage=usage_of(final, self.block_size, marks),
        )  # fmt: skip

    def _force(
        self, req: MessagesRequest, chat_req: ChatCompletionRequest, tools: ToolRequest
    ) -> ToolRequest:
        """With ``force_tool_call`` and a request it applies to: ``tools`` with a forced call of
        that tool, whose grammar uses ``input_schema``; else ``tools``."""
        spec = self.force_tool_call
        turns = [m for m in req.messages if m.role != "system"]
        last = turns[-1] if turns else None
        if spec is None or last is None or last.role != "user" or not chat_req.tools:
            return tools
        if isinstance(last.content, list) and any(
            b.get("type") == "tool_result" for b in last.content
        ):
            return tools
        if spec["name"] not in [t.function.name for t in chat_req.tools]:
            return tools
        function = {"name": spec["name"], "parameters": spec["input_schema"]}
        return dataclasses.replace(tools, choice="named", name=spec["name"],
                                   grammar_tools=[{"type": "function", "function": function}])  # fmt: skip

    def _stream(self, message_id: str, model: str, streams, inputs: EngineInputs,
                marks: tuple[tuple[int, float], ...] = ()) -> AsyncIterator[str]:  # fmt: skip
        tracker, blocks = DeltaTracker(), BlockEvents(self.reply_parser(inputs))
        started = False

        def events(_: int, out: RequestOutput | None) -> list[str]:
            nonlocal started
            head = []
            if not started:
                started = True
                head = [self._message_start(message_id, model, out, len(inputs.prompt_token_ids),
                                            marks), event("ping", {})]  # fmt: skip
            if out is None:
                return head + ([event("ping", {})] if len(head) == 0 else [])
            c = out.outputs[0]
            d = tracker.delta(c.index, c, self.visible_text(c, inputs.mode))
            finish = _finish(c) if d is not None and d.finish_reason is not None else None
            body = blocks.feed(d.text, finish) if d is not None else []
            if out.finished:
                reason, sequence = stop_reason_of(c, blocks.has_calls)
                self.tool_calls.paused(inputs, c, blocks.first_call)
                body.append(("message_delta", {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage_of(out, self.block_size, marks).model_dump()}))  # fmt: skip
                body.append(("message_stop", {}))
            return head + [event(kind, b) for kind, b in body]

        def error(exc) -> list[str]:
            return [event("error", {"error": anthropic_error(exc)[1]["error"]})]

        return drive(streams, self.abort_all, events, error, idle_s=PING_INTERVAL_S,
                     first_idle_s=FIRST_OUTPUT_WAIT_S)  # fmt: skip

    def _message_start(self, message_id: str, model: str, out: RequestOutput | None,
                       num_prompt: int, marks: tuple[tuple[int, float], ...]) -> str:  # fmt: skip
        """``message_start``; its usage is split by the cache once the first output is known,
        else the whole prompt counts as input (``message_delta`` corrects it)."""
        if out is not None:
            usage = usage_of(out, self.block_size, marks)
            usage.output_tokens = 0
        else:
            usage = MessagesUsage(input_tokens=num_prompt)
        message = {"id": message_id, "type": "message", "role": "assistant", "model": model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage.model_dump()}  # fmt: skip
        return event("message_start", {"message": message})


def _finish(c: CompletionOutput) -> Finish:
    return Finish(c.finish_reason, c.stop_reason)
