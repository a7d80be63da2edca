"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request becomes the chat request with the same prompt (``messages_prompt``); rendering, tool
modes, forced-call grammars, engine parameters and admission are ``ChatServing``'s. What is
Anthropic's here: the reply's content blocks, ``stop_reason``, usage in cache terms, and the
event stream::

    message_start (usage) -> ping -> per block: content_block_start, content_block_delta*
    (thinking_delta | text_delta | input_json_delta), content_block_stop -> message_delta (stop_reason,
    stop_sequence, final usage) -> message_stop

with a ``ping`` every ``PING_INTERVAL_S`` of silence, and an ``error`` event if it fails midway.
``message_start`` waits for the request's first output (at most ``FIRST_OUTPUT_WAIT_S``) so that
its usage already splits the prompt by the cache (Claude Code reads usage there); after a longer
wait it counts the whole prompt as ``input_tokens`` and ``message_delta`` carries the split
(cumulative totals, as Anthropic's do).

Tool calls are read, and forced calls generated, in ``--tool-call-parser``'s syntax by one reader
per reply (``tool_call_streams``), streamed and not.

Invariant: the blocks of a stream, concatenated per block, equal the non-streamed content for the
same output, except that a text block may keep whitespace the non-streamed one strips.
Whitespace-only text is held back and dropped if a tool call follows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from prefixserve.api.messages_prompt import to_chat_request
from prefixserve.api.messages_stream import BlockEvents, tool_input, unparsed_call_text
from prefixserve.api.protocol import APIError, ChatCompletionRequest, ToolCall, random_id
from prefixserve.api.protocol_messages import (
    CountTokensRequest,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    anthropic_error,
)
from prefixserve.api.reasoning_parsers import reasoning_parser, reasoning_tags
from prefixserve.api.serving_base import DeltaTracker, merge
from prefixserve.api.serving_chat import ChatServing
from prefixserve.api.tool_call_streams import ToolMode

from prefixserve.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 10.0
FIRST_OUTPUT_WAIT_S = 30.0


def usage_of(out: RequestOutput, block_size: int | None) -> MessagesUsage:
    """The prompt split by the prefix cache. ``block_size``: of the prefix cache, None when it
    is off. Every full block of the prompt is cached once prefilled, so the full blocks not read
    from the cache were created by this request."""
    prompt = len(out.prompt_token_ids)
    read = out.num_cached_tokens
    full = prompt // block_size * block_size if block_size else 0
    created = max(0, full - read)
    return MessagesUsage(
        input_tokens=prompt - read - created,
        output_tokens=sum(len(c.token_ids) for c in out.outputs),
        cache_creation_input_tokens=created,
        cache_read_input_tokens=read,
    )


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


def content_blocks(
    content: str | None, calls: list[ToolCall], reasoning: str | None = None
) -> list[dict]:
    """Anthropic content of a parsed reply: the reasoning as a thinking block (with
    ``--reasoning-parser``), the text (if any), then one tool_use per call; a call whose
    arguments are not a JSON object stays text (as ``BlockEvents`` streams it)."""
    text = content or ""
    uses: list[dict] = []
    for call in calls:
        name, arguments = call.function.name, call.function.arguments
        args = tool_input(arguments)
        if args is None:
            text += unparsed_call_text(name, arguments)
        else:
            uses.append({"type": "tool_use", "id": call.id, "name": name, "input": args})
    if uses and not text.strip():
        text = ""
    thinking = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    return thinking + ([{"type": "text", "text": text}] if text else []) + uses


def event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


class MessagesServing:
    """The Messages endpoints over ``chat`` (which owns the engine and the served names).
    ``drop_attribution``: leave out Claude Code's attribution block (``messages_prompt``).

    ``force_tool_call`` (a testing aid, ``--messages-force-tool-call``): ``{"name",
    "input_schema"}``. A request that lists a tool of that name and whose last user or assistant
    message is the user's own turn (no tool_result in it) is answered with a forced call of that
    tool whose input matches ``input_schema``, as if it had ``tool_choice {"type": "tool"}``; the
    prompt still shows the tool's own schema. It lets an agent client drive a random-weight model
    through a tool turn.
    """

    def __init__(
        self, chat: ChatServing, drop_attribution: bool = True, force_tool_call: dict | None = None
    ) -> None:
        self.chat = chat
        self.drop_attribution = drop_attribution
        self.force_tool_call = force_tool_call
        self.block_size = chat.engine.prefix_cache_block_size

    def _chat_request(self, req: CountTokensRequest) -> ChatCompletionRequest:
        self.chat.check_model(req.model)
        return to_chat_request(req, self.drop_attribution, self.chat.tool_parser is not None)

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        chat_req = self._chat_request(req)
        tools, _ = self.chat._tool_mode(chat_req)
        prompt = await asyncio.to_thread(self.chat._render, chat_req, tools)
        return {"input_tokens": len(prompt)}

    async def create(self, req: MessagesRequest, raw_request: Request):
        chat, chat_req = self.chat, self._chat_request(req)
        model = chat.check_model(req.model)
        grammar_tools = self._force(req, chat_req)
        tools, mode = chat._tool_mode(chat_req)
        prompt = await asyncio.to_thread(chat._render, chat_req, tools)
        prompt_tail = chat.engine.tokenizer.decode(prompt[-32:])  # where reasoning stands
        reasoning = reasoning_tags(chat.reasoning_parser, prompt_tail)
        structured, source = chat._structured_outputs(
            chat_req, grammar_tools or tools, mode, reasoning
        )
        params = chat.make_params(chat_req, req.max_tokens, None, structured)
        if mode is not ToolMode.NONE:
            params.skip_special_tokens = False  # tool-call tags may be special tokens
        message_id = random_id("msg_")
        streams = await chat.add_all(message_id, [prompt], [params], "messages", source)
        reasoner = (
            reasoning_parser(chat.reasoning_parser, prompt_tail) if chat.reasoning_parser else None
        )
        if req.stream:
            blocks = BlockEvents(mode, reasoner, chat.tool_parser, grammar_tools or tools,
                                 chat_req.parallel_tool_calls)  # fmt: skip
            return self._stream(message_id, model, streams, blocks, len(prompt))
        final = (await chat.collect(raw_request, streams))[0]
        c = final.outputs[0]
        choice = chat._choice(chat_req, c, mode, grammar_tools or tools, prompt_tail)
        message = choice.message
        content = content_blocks(message.content, message.tool_calls, message.reasoning_content)
        reason, sequence = stop_reason_of(c, any(b["type"] == "tool_use" for b in content))
        return MessagesResponse(
            id=message_id, model=model, content=content, stop_reason=reason,
            stop_sequence=sequence, usage=usage_of(final, self.block_size),
        )  # fmt: skip

    def _force(self, req: MessagesRequest, chat_req: ChatCompletionRequest) -> list[dict] | None:
        """With ``force_tool_call`` and a request it applies to: name the tool in ``chat_req`` and
        return the tools the grammar uses (that one with ``input_schema``); else None."""
        spec = self.force_tool_call
        turns = [m for m in req.messages if m.role != "system"]
        last = turns[-1] if turns else None
        if spec is None or last is None or last.role != "user" or not chat_req.tools:
            return None
        if isinstance(last.content, list) and any(
            b.get("type") == "tool_result" for b in last.content
        ):
            return None
        if spec["name"] not in [t.function.name for t in chat_req.tools]:
            return None
        chat_req.tool_choice = {"type": "function", "function": {"name": spec["name"]}}
        function = {"name": spec["name"], "parameters": spec["input_schema"]}
        return [{"type": "function", "function": function}]

    async def _stream(
        self, message_id: str, model: str, streams, blocks: BlockEvents, num_prompt: int
    ) -> AsyncIterator[str]:
        tracker, mode = DeltaTracker(), blocks.mode
        outputs = merge(streams)
        pending: asyncio.Future | None = None
        started = False
        try:
            while True:
                pending = pending or asyncio.ensure_future(anext(outputs, None))
                wait = PING_INTERVAL_S if started else FIRST_OUTPUT_WAIT_S
                done, _ = await asyncio.wait({pending}, timeout=wait)
                item = pending.result() if done else None
                if not started:
                    started = True
                    yield self._message_start(message_id, model, item, num_prompt)
                    yield event("ping", {})
                if not done:
                    yield event("ping", {})
                    continue
                pending = None
                if item is None:
                    break
                for kind, body in self._events(item[1], tracker, blocks, mode):
                    yield event(kind, body)
        except APIError as exc:
            yield event("error", {"error": anthropic_error(exc)[1]["error"]})
        except Exception as exc:
            logger.exception("messages stream failed")
            yield event("error", {"error": {"type": "api_error", "message": str(exc)}})
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
            await outputs.aclose()
            self.chat.abort_all(streams)

    def _message_start(self, message_id: str, model: str, item, num_prompt: int) -> str:
        """``message_start``; its usage is split by the cache once the first output is known,
        else the whole prompt counts as input (``message_delta`` corrects it)."""
        if item is not None:
            usage = usage_of(item[1], self.block_size)
            usage.output_tokens = 0
        else:
            usage = MessagesUsage(input_tokens=num_prompt)
        message = {"id": message_id, "type": "message", "role": "assistant", "model": model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage.model_dump()}  # fmt: skip
        return event("message_start", {"message": message})

    def _events(
        self, out: RequestOutput, tracker: DeltaTracker, blocks: BlockEvents, mode: ToolMode
    ) -> list[tuple[str, dict]]:
        c = out.outputs[0]
        d = tracker.delta(c.index, c, self.chat._visible_text(c, mode))
        events = blocks.feed(d.text, final=d.finish_reason is not None) if d is not None else []
        if out.finished:
            reason, sequence = stop_reason_of(c, blocks.has_calls)
            events.append(("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage_of(out, self.block_size).model_dump()}))  # fmt: skip
            events.append(("message_stop", {}))
        return events
