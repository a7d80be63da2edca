"""POST /v1/chat/completions: chat template (with tools), sampling, streaming, tool calls.

Tool calls (``ToolMode``): with ``tool_choice`` "auto" and ``--tool-call-parser hermes``, the
model may write ``<tool_call>`` blocks, parsed from its text. With "required" or a named function,
a grammar forces the calls in the template's own syntax (``structured_outputs.tool_calls``) with
arguments that match each tool's ``parameters``, so they always come back as ``tool_calls``,
whatever the parser setting; streamed one tool-call entry per chunk (a call's id and name,
then its arguments), each call once complete, so a call cut off by ``max_tokens`` is neither
streamed nor returned. ``parallel_tool_calls: false`` keeps at most one call in every mode.
With ``--tool-call-parser`` set to another family's syntax (``api/tool_call_parsers.py``), auto
calls are read and forced calls generated in that syntax (streamed a whole call at a time).
With ``--reasoning-parser`` (``api/reasoning_parsers.py``), the reasoning block is split off
first (``reasoning_content``), tool calls and content are read from the rest, and grammars and
forced calls apply after the reasoning.
In tool modes special tokens are kept in the text so tags survive detokenization; the trailing
EOS text is removed before parsing. Invariant: the streamed content and tool calls of a choice,
concatenated, equal the non-streamed message for the same output (content up to surrounding
whitespace).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

from fastapi import Request
from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.field_support import check_supported
from prefixserve.api.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionTokensDetails,
    Usage,
    random_id,
)
from prefixserve.api.reasoning_parsers import (
    count_reasoning_tokens,
    reasoning_parser,
    reasoning_tags,
)
from prefixserve.api.serving_base import BaseServing, ChoiceDelta, DeltaTracker, usage_of
from prefixserve.api.structured_outputs import structured_outputs_of
from prefixserve.api.tool_call_parsers import tool_call_parser
from prefixserve.api.tool_call_streams import ToolMode, forced_syntax
from prefixserve.api.tool_parsers import ForcedToolCallDeltas, parse_forced_tool_calls

from prefixserve.chat_template import render_chat
from prefixserve.errors import InvalidArgumentError
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.structured_outputs.params import StructuredOutputsParams
from prefixserve.structured_outputs.tool_calls import tool_call_params


class ChatServing(BaseServing):
    def __init__(
        self,
        engine: AsyncEngine,
        served_model_names: list[str],
        tool_parser: str | None,
        content_format: str = "auto",
        reasoning_parser: str | None = None,
        **options,
    ) -> None:
        super().__init__(engine, served_model_names, **options)
        self.tool_parser = tool_parser
        self.content_format = content_format
        self.reasoning_parser = reasoning_parser
        self.forced_syntax = forced_syntax(tool_parser)
        texts = {engine.tokenizer.decode([t]) for t in engine.eos_token_ids} - {""}
        self.eos_texts = tuple(sorted(texts, key=len, reverse=True))

    def _tool_mode(self, req: ChatCompletionRequest) -> tuple[list[dict] | None, ToolMode]:
        """(tools for the template, how tool calls come out)."""
        choice = req.tool_choice
        named = isinstance(choice, dict)
        if choice not in (None, "none", "auto", "required") and not named:
            raise APIError(
                f"tool_choice: {choice!r} is not supported; use 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                400,
                "tool_choice",
            )
        if req.tools is not None and not req.tools:
            raise APIError(
                "tools: must not be empty; list at least one function or leave tools out",
                400,
                "tools",
            )
        if not req.tools:
            if choice in ("auto", "required") or named:
                raise APIError(
                    f"tool_choice: {choice!r} needs tools; list the functions in tools",
                    400,
                    "tool_choice",
                )
            return None, ToolMode.NONE
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if choice == "none":  # the model still sees the tools (as vLLM), and calls none
            return tools, ToolMode.NONE
        if choice == "required":
            return tools, ToolMode.REQUIRED
        if named:
            return tools, ToolMode.NAMED
        if self.tool_parser is None:
            raise APIError(
                '"auto" tool choice requires the server to run with --tool-call-parser',
                400,
                "tool_choice",
            )
        return tools, ToolMode.AUTO

    def _structured_outputs(
        self,
        req: ChatCompletionRequest,
        tools: list[dict] | None,
        mode: ToolMode,
        reasoning: tuple[str, str] | None,
    ) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's grammar and the field it came from (a grammar that cannot compile is a
        400 naming that field, raised when the request is prepared)."""
        structured, source = structured_outputs_of(req)
        if mode in (ToolMode.REQUIRED, ToolMode.NAMED):
            if structured is not None:
                raise APIError(
                    f"{source}: cannot be combined with a forced tool_choice", 400, source
                )
            name = req.tool_choice["function"].get("name") if mode is ToolMode.NAMED else None
            try:
                structured = tool_call_params(
                    tools or [], name, req.parallel_tool_calls, self.forced_syntax, reasoning
                )
            except InvalidArgumentError as exc:
                raise APIError(str(exc), 400, exc.param) from exc
            source = "tool_choice"
        if structured is not None and reasoning is not None:
            structured = dataclasses.replace(structured, reasoning=reasoning)
        return structured, source

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        model = self.check_model(req.model)
        check_supported(req, "chat")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs: requires logprobs=true", 400, "top_logprobs")
        if isinstance(req.tool_choice, dict) and not isinstance(
            (req.tool_choice.get("function") or {}).get("name"), str
        ):
            raise APIError(
                'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                400,
                "tool_choice",
            )
        tools, mode = self._tool_mode(req)
        prompt = await asyncio.to_thread(self._render, req, tools)
        prompt_tail = self.engine.tokenizer.decode(prompt[-32:])  # where reasoning stands
        reasoning = reasoning_tags(self.reasoning_parser, prompt_tail)
        structured, source = self._structured_outputs(req, tools, mode, reasoning)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self.make_params(req, max_tokens, logprobs, structured, req.prompt_logprobs)
        if mode is not ToolMode.NONE and hasattr(params, "skip_special_tokens"):
            params.skip_special_tokens = False  # tool-call tags may be special tokens
        request_id = "chatcmpl-" + (req.request_id or random_id(""))
        streams = await self.add_all(request_id, [prompt], [params], "messages", source)
        if req.stream:
            return self._stream(req, request_id, model, streams, mode, tools, prompt_tail)
        final = (await self.collect(raw_request, streams))[0]
        choices = [self._choice(req, c, mode, tools, prompt_tail) for c in final.outputs]
        usage = usage_of([final])
        if self.reasoning_parser is not None:
            counts = [self._reasoning_tokens(c.token_ids, ch.message.reasoning_content)
                      for c, ch in zip(final.outputs, choices)]  # fmt: skip
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(counts))
        return ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage, **self._extras(req, final)
        )

    def _reasoning_tokens(self, token_ids: list[int], reasoning: str | None) -> int:
        return count_reasoning_tokens(self.engine.tokenizer, token_ids, reasoning)

    def _tool_call_parser(self, tools: list[dict] | None, mode: ToolMode):
        """The registered parser that reads this mode's calls (forced: the forced syntax)."""
        forced = mode in (ToolMode.REQUIRED, ToolMode.NAMED)
        return tool_call_parser(
            self.forced_syntax if forced else self.tool_parser or "hermes", tools
        )

    def _render(self, req: ChatCompletionRequest, tools: list[dict] | None) -> list[int]:
        try:
            return render_chat(
                self.engine.tokenizer,
                req.messages,
                tools=tools,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=req.add_special_tokens,
                content_format=self.content_format,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                documents=req.documents,
            )
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, exc.param) from exc

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

    def _visible_text(self, c: CompletionOutput, mode: ToolMode) -> str:
        """The output text, less the EOS text that tool modes keep (special tokens shown)."""
        if mode is not ToolMode.NONE and c.finish_reason == "stop":
            for eos in self.eos_texts:
                if c.text.endswith(eos):
                    return c.text[: -len(eos)]
        return c.text

    def _choice(
        self,
        req: ChatCompletionRequest,
        c: CompletionOutput,
        mode: ToolMode,
        tools: list[dict] | None,
        prompt_tail: str,
    ) -> ChatChoice:
        text, reasoning = self._visible_text(c, mode), None
        if self.reasoning_parser is not None:
            reasoning, text = reasoning_parser(self.reasoning_parser, prompt_tail).extract(text)
            text = text or ""
        forced = mode in (ToolMode.REQUIRED, ToolMode.NAMED)
        if mode is ToolMode.AUTO:
            content, calls = self._tool_call_parser(tools, mode).parse(text)
            calls = calls if req.parallel_tool_calls else calls[:1]
        elif forced and self.forced_syntax != "hermes":
            content, calls = None, self._tool_call_parser(tools, mode).parse(text)[1]
        elif forced:
            content, calls = None, parse_forced_tool_calls(text)
        else:
            content, calls = text, []
        lps = self._logprobs(req, c.logprobs, c.token_ids) if c.logprobs is not None else None
        if content is not None or not (calls or forced):
            content = self._echo(req) + (content or "")
        return ChatChoice(
            index=c.index,
            message=ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls),
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

    def _stream(
        self, req, request_id: str, model: str, streams, mode: ToolMode, tools, prompt_tail
    ):
        base = {"id": request_id, "object": "chat.completion.chunk", "model": model}
        tracker = DeltaTracker()
        any_forced = mode in (ToolMode.REQUIRED, ToolMode.NAMED)
        forced = any_forced and self.forced_syntax == "hermes"  # hermes' own call deltas
        parsers = {
            i: ForcedToolCallDeltas() if forced else self._tool_call_parser(tools, mode).stream()
            for i in range(req.n)
        }
        reasoners = {i: reasoning_parser(self.reasoning_parser, prompt_tail)
                     for i in range(req.n)} if self.reasoning_parser else {}  # fmt: skip
        reasoning_tokens: dict[int, int] = {}
        echo = self._echo(req)
        sent_extras = False

        def choice(index: int, delta: dict, logprobs=None, finish_reason=None, **extra) -> dict:
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish_reason, **extra}  # fmt: skip

        def message_deltas(d: ChoiceDelta) -> list[dict]:
            """The choice's new message parts: content first, then at most one tool-call
            entry per delta (OpenAI and vLLM send one per chunk); reasoning before all."""
            text, head = d.text, []
            if reasoners:
                reasoning, text = reasoners[d.index].feed(text, final=d.finish_reason is not None)
                head = [{"reasoning_content": reasoning}] if reasoning else []
            if mode is ToolMode.NONE:
                text = (echo if d.first else "") + text
                return head + ([{"content": text}] if text else [])
            parser, content = parsers[d.index], ""
            if forced:
                entries = parser.feed(text)
            else:
                content, calls = parser.feed(text, final=d.finish_reason is not None)
                content = "" if any_forced else content
                first = len(parser.calls) - len(calls)
                entries = [{"index": first + k, **call.model_dump()}
                           for k, call in enumerate(calls)
                           if req.parallel_tool_calls or first + k == 0]  # fmt: skip
            deltas = [{"content": content}] if content else []
            return head + deltas + [{"tool_calls": [entry]} for entry in entries]

        def events(_: int, out: RequestOutput) -> Iterator[dict]:
            nonlocal sent_extras
            if req.use_beam_search and not out.finished:
                return
            for c in out.outputs:
                d = tracker.delta(c.index, c, self._visible_text(c, mode))
                if d is None:
                    continue
                deltas = message_deltas(d) or [{}]
                lps = (
                    self._logprobs(req, d.logprobs, d.token_ids)
                    if d.logprobs is not None and d.token_ids
                    else None
                )
                reason = d.finish_reason
                if reason is not None:
                    reason = _finish_reason(reason, mode, parsers[d.index].has_calls)
                    if reasoners:
                        reasoning = "" if reasoners[d.index].has_reasoning else None
                        reasoning_tokens[d.index] = self._reasoning_tokens(c.token_ids, reasoning)
                for k, delta in enumerate(deltas):  # logprobs first, the finish reason last
                    last = k == len(deltas) - 1
                    part_lps, part_reason = (lps if k == 0 else None), (reason if last else None)
                    extra = {"stop_reason": d.stop_reason} if part_reason else {}
                    if req.return_token_ids:
                        extra["token_ids"] = d.token_ids if k == 0 else []
                    if delta or part_lps or part_reason or extra.get("token_ids"):
                        body = {"choices": [choice(d.index, delta, part_lps, part_reason, **extra)]}
                        if not sent_extras:  # prompt_logprobs, prompt_token_ids: once
                            body.update(self._extras(req, out))
                            sent_extras = True
                        yield body

        roles = [{"choices": [choice(i, {"role": "assistant", "content": ""})]}
                 for i in range(req.n)]  # fmt: skip

        def usage_details(usage: Usage) -> Usage:
            if reasoners:
                details = CompletionTokensDetails(reasoning_tokens=sum(reasoning_tokens.values()))
                usage.completion_tokens_details = details
            return usage

        return self.stream(
            streams, base, events, req.stream_options, first_chunks=roles,
            usage_details=usage_details,
        )  # fmt: skip


def _finish_reason(reason: str | None, mode: ToolMode, called: bool) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto) or had to call any function
    (required) and stopped; a call of a named function ends with "stop"."""
    if reason == "stop" and called and mode in (ToolMode.AUTO, ToolMode.REQUIRED):
        return "tool_calls"
    return reason
