"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request maps onto the chat prompt the template renders (``prompt.ChatPrompt``); the shared
front half (``frontend.inputs``) turns it into the engine's inputs (tool mode, forced-call
grammars, reasoning, parameters) as for every protocol. What is Anthropic's here: the reply's
content blocks (``blocks``), ``stop_reason``, usage in cache terms, and the event stream::

    message_start (usage) -> ping -> per block: content_block_start, content_block_delta*
    (thinking_delta | text_delta | input_json_delta), content_block_stop -> message_delta (stop_reason,
    stop_sequence, final usage) -> message_stop

with a ``ping`` every ``PING_INTERVAL_S`` of silence, and an ``error`` event if it fails midway
(the request's deltas pulled from its ``Generation``). ``message_start`` waits for the request's first output (at most
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
from prefixserve.api.anthropic.prompt import ChatPrompt, to_chat_prompt
from prefixserve.api.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    anthropic_error,
)
from prefixserve.api.engine_client import Generation
from prefixserve.api.frontend.inputs import EngineInputs, TemplateServing
from prefixserve.api.frontend.protocol import APIError, ToolRequest, random_id
from prefixserve.api.frontend.request import GenerationRequest
from prefixserve.api.frontend.stream import ChoiceTotals, as_api_error, event_stream
from prefixserve.api.frontend.tenancy import tenant_of
from prefixserve.api.frontend.thinking_budget import BudgetedStream
from prefixserve.api.parsing.reply import Finish
from prefixserve.core.outputs import CompletionOutput, RequestOutput

PING_INTERVAL_S = 10.0
FIRST_OUTPUT_WAIT_S = 30.0


def usage_of(out: RequestOutput, block_size: int | None,
             marks: tuple[tuple[int, float], ...] = (), output_tokens: int | None = None
             ) -> MessagesUsage:  # fmt: skip
    """The prompt split by the prefix cache (``cache_control.split_usage``). ``block_size``: of
    the prefix cache, None when it is off; ``marks``: (position, TTL) of each breakpoint, each
    counted as far as the engine retained it (``out.kv_retained_tokens``); ``output_tokens``:
    the reply's so far (default: ``out``'s, a whole output)."""
    if output_tokens is None:
        output_tokens = sum(len(c.token_ids) for c in out.outputs)
    return split_usage(len(out.prompt_token_ids), out.num_cached_tokens, list(marks),
                       block_size, output_tokens, out.kv_retained_tokens)  # fmt: skip


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

    def _chat_prompt(self, req: CountTokensRequest) -> ChatPrompt:
        self.check_model(req.model)
        return to_chat_prompt(req, self.drop_attribution, self.tool_parser is not None)

    def _render(self, chat: ChatPrompt, tools: list[dict] | None) -> list[int]:
        return self.render(chat.messages, tools,
                           add_generation_prompt=chat.add_generation_prompt,
                           continue_final_message=chat.continue_final_message,
                           chat_template_kwargs=chat.chat_template_kwargs)  # fmt: skip

    def _render_marked(
        self, req: MessagesRequest, chat: ChatPrompt, tools: list[dict] | None
    ) -> tuple[list[int], tuple[tuple[int, float], ...]]:
        """The prompt, and (position, TTL) of each ``cache_control`` breakpoint in it (a cut the
        template refuses to render marks nothing)."""
        found = breakpoints(req, self.drop_attribution)  # a malformed mark: a 400 first
        prompt = self._render(chat, tools)
        marks = []
        for mark in found:
            try:
                cut = self.render(mark.messages, mark.tools, add_generation_prompt=False,
                                  chat_template_kwargs=chat.chat_template_kwargs)  # fmt: skip
            except APIError:
                cut = []
            marks.append((common_prefix(cut, prompt), mark.ttl_s))
        return prompt, tuple(marks)

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        chat = self._chat_prompt(req)
        prompt = await asyncio.to_thread(self._render, chat, chat.tools.tools)
        return {"input_tokens": len(prompt)}

    async def create(self, req: MessagesRequest, raw_request: Request):
        chat = self._chat_prompt(req)
        model = self.check_model(req.model)
        tools = self._force(req, chat.tools)
        prompt, marks = await asyncio.to_thread(self._render_marked, req, chat, tools.tools)
        tenant = tenant_of(raw_request)
        retention = retentions(marks, tenant.namespace(req.cache_salt), tenant.owner)
        message_id = random_id("msg_")
        results = [m["tool_call_id"] for m in chat.messages if m.get("role") == "tool"]
        structured = (chat.structured, "output_config")
        inputs = self.prepare(GenerationRequest(
            prompt, tools, req.sampling_options(), req.max_tokens, structured, tenant=tenant,
            retention=retention, request_id=message_id, tool_results=tuple(results),
        ))  # fmt: skip
        thinking = req.thinking or {}
        budgeted = thinking.get("type") == "enabled"  # read as it comes: deltas
        generation = await self.generate(message_id, [prompt], [inputs.params], "messages",
                                         inputs.grammar_source, stream=req.stream or budgeted)  # fmt: skip
        with self.owned(generation):
            if budgeted:
                generation = Generation(self.engine, [BudgetedStream(
                    self.engine, generation.streams[0], prompt, inputs.params,
                    thinking["budget_tokens"], self.reasoning_parser or "qwen3",
                    inputs.prompt_tail, self.request_timeout,
                )])  # fmt: skip
            if req.stream:
                return event_stream(self._stream(message_id, model, generation, inputs, marks))
        final = (await self.collect(raw_request, generation))[0]
        c = final.outputs[0]
        blocks = BlockEvents(self.reply_parser(inputs))
        content = content_of(blocks.feed(self.visible_text(c, inputs.mode), _finish(c)))
        reason, sequence = stop_reason_of(c, blocks.has_calls)
        self.tool_calls.paused(inputs, c.finish_reason, blocks.first_call)
        return MessagesResponse(
            id=message_id, model=model, content=content, stop_reason=reason,
            stop_sequence=sequence, usage=usage_of(final, self.block_size, marks),
        )  # fmt: skip

    def _force(self, req: MessagesRequest, tools: ToolRequest) -> ToolRequest:
        """With ``force_tool_call`` and a request it applies to: ``tools`` with a forced call of
        that tool, whose grammar uses ``input_schema``; else ``tools``."""
        spec = self.force_tool_call
        turns = [m for m in req.messages if m.role != "system"]
        last = turns[-1] if turns else None
        if spec is None or last is None or last.role != "user" or not tools.tools:
            return tools
        if isinstance(last.content, list) and any(
            b.get("type") == "tool_result" for b in last.content
        ):
            return tools
        if spec["name"] not in [t["function"]["name"] for t in tools.tools]:
            return tools
        function = {"name": spec["name"], "parameters": spec["input_schema"]}
        return dataclasses.replace(tools, choice="named", name=spec["name"],
                                   grammar_tools=[{"type": "function", "function": function}])  # fmt: skip

    async def _stream(self, message_id: str, model: str, generation: Generation,
                      inputs: EngineInputs, marks: tuple[tuple[int, float], ...] = ()
                      ) -> AsyncIterator[str]:  # fmt: skip
        blocks, totals = BlockEvents(self.reply_parser(inputs)), ChoiceTotals()

        def events(out: RequestOutput) -> list[str]:
            c = out.outputs[0]
            totals.add(0, c)
            text = self.visible_text(c, inputs.mode)
            finish = _finish(c) if c.finish_reason is not None else None
            body = blocks.feed(text, finish) if text or finish else []
            if out.finished:
                reason, sequence = stop_reason_of(c, blocks.has_calls)
                self.tool_calls.paused(inputs, c.finish_reason, blocks.first_call)
                usage = usage_of(out, self.block_size, marks, totals.num_tokens())
                body.append(("message_delta", {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage.model_dump()}))  # fmt: skip
                body.append(("message_stop", {}))
            return [event(kind, b) for kind, b in body]

        async with generation:
            try:
                item = await generation.next(FIRST_OUTPUT_WAIT_S)
                first = item[1] if item is not None else None
                yield self._message_start(message_id, model, first,
                                          len(inputs.prompt_token_ids), marks)  # fmt: skip
                yield event("ping", {})
                while True:
                    for line in events(item[1]) if item is not None else ():
                        yield line
                    item = await generation.next(PING_INTERVAL_S)
                    if item is None:  # silence
                        yield event("ping", {})
            except StopAsyncIteration:
                pass
            except Exception as exc:
                yield event("error", {"error": anthropic_error(as_api_error(exc))[1]["error"]})

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
