"""POST /v1/chat/completions: chat template (with tools), sampling, streaming, hermes tool calls.

With a tool parser and tools in the request (tool_choice "auto"), special tokens are kept in the
output text so that ``<tool_call>`` tags survive detokenization; the trailing EOS text is removed
before parsing. Invariant: the streamed content and tool calls of a choice, concatenated, equal
the non-streamed message for the same output (content up to surrounding whitespace).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from fastapi import Request
from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    random_id,
)
from prefixserve.api.serving_base import (
    BaseServing,
    ChoiceDelta,
    DeltaTracker,
    chunk_event,
    usage_of,
)
from prefixserve.api.tool_parsers import HermesStreamParser, parse_tool_calls

from prefixserve.outputs import CompletionOutput, RequestOutput


def render_chat(
    tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool
) -> list[int]:
    """Token ids of the conversation; the template writes BOS itself, so nothing is added twice."""
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}]: every message needs a string 'role'", 400, "messages")
    try:
        encoded = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
    except Exception as exc:
        raise APIError(f"messages: the chat template failed: {exc}", 400, "messages") from exc
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return list(encoded)


class ChatServing(BaseServing):
    def __init__(
        self,
        engine: AsyncEngine,
        served_model_names: list[str],
        tool_parser: str | None,
        **options,
    ) -> None:
        super().__init__(engine, served_model_names, **options)
        self.tool_parser = tool_parser
        self.eos_text = engine.tokenizer.eos_token or ""

    def _use_tools(self, req: ChatCompletionRequest) -> tuple[list[dict] | None, bool]:
        """(tools for the template, whether to parse tool calls)."""
        if not req.tools or req.tool_choice == "none":
            return None, False
        if req.tool_choice not in (None, "auto"):
            raise APIError("tool_choice: only 'auto' and 'none' are supported", 400, "tool_choice")
        if self.tool_parser is None:
            raise APIError(
                '"auto" tool choice requires the server to run with --tool-call-parser',
                400,
                "tool_choice",
            )
        return [t.model_dump(exclude_none=True) for t in req.tools], True

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        model = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs: requires logprobs=true", 400, "top_logprobs")
        tools, parse = self._use_tools(req)
        prompt = await asyncio.to_thread(
            render_chat, self.engine.tokenizer, req.messages, tools, req.add_generation_prompt
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.make_params(req, req.max_completion_tokens or req.max_tokens, logprobs)
        if parse and hasattr(params, "skip_special_tokens"):
            params.skip_special_tokens = False
        request_id = random_id("chatcmpl-")
        streams = await self.add_all(request_id, [prompt], [params], "messages")
        if req.stream:
            return self._stream(req, request_id, model, streams, parse)
        final = (await self.collect(raw_request, streams))[0]
        choices = [self._choice(req, c, parse) for c in final.outputs]
        return ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage_of([final])
        )

    def _visible_text(self, c: CompletionOutput, parse: bool) -> str:
        if parse and c.finish_reason == "stop" and self.eos_text and c.text.endswith(self.eos_text):
            return c.text[: -len(self.eos_text)]
        return c.text

    def _choice(self, req: ChatCompletionRequest, c: CompletionOutput, parse: bool) -> ChatChoice:
        text = self._visible_text(c, parse)
        content, calls = parse_tool_calls(text) if parse else (text, [])
        lps = self._logprobs(req, c.logprobs, c.token_ids) if c.logprobs is not None else None
        return ChatChoice(
            index=c.index,
            message=ChatMessage(content=content, tool_calls=calls),
            logprobs=lps,
            finish_reason="tool_calls" if calls else c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _logprobs(
        self, req: ChatCompletionRequest, entries: list[dict[int, float]], token_ids: list[int]
    ) -> dict:
        k = req.top_logprobs or 0

        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for entry, token in zip(entries, token_ids):
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
            content.append(
                {**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in top]}
            )
        return {"content": content}

    def _stream(self, req, request_id: str, model: str, streams, parse: bool):
        base = {"id": request_id, "object": "chat.completion.chunk", "model": model}
        tracker = DeltaTracker()
        parsers = {i: HermesStreamParser() for i in range(req.n)}

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, **extra) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason, **extra}  # fmt: skip
            return chunk_event(base, [choice])

        def message_delta(d: ChoiceDelta) -> dict:
            if not parse:
                return {"content": d.text} if d.text else {}
            parser = parsers[d.index]
            content, calls = parser.feed(d.text, final=d.finish_reason is not None)
            delta: dict = {"content": content} if content else {}
            if calls:
                first = len(parser.calls) - len(calls)
                delta["tool_calls"] = [
                    {"index": first + k, **call.model_dump()} for k, call in enumerate(calls)
                ]
            return delta

        def events(_: int, out: RequestOutput) -> Iterator[str]:
            if req.use_beam_search and not out.finished:
                return
            for c in out.outputs:
                d = tracker.delta(c.index, c, self._visible_text(c, parse))
                if d is None:
                    continue
                delta = message_delta(d)
                lps = (
                    self._logprobs(req, d.logprobs, d.token_ids)
                    if d.logprobs is not None and d.token_ids
                    else None
                )
                reason = d.finish_reason
                if reason is not None and parsers[d.index].calls:
                    reason = "tool_calls"
                if delta or lps or reason:
                    extra = {"stop_reason": d.stop_reason} if reason else {}
                    yield chunk(d.index, delta, lps, reason, **extra)

        roles = [chunk(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return self.stream(streams, base, events, include_usage, first_events=roles)
