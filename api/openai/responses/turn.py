"""One response's lifecycle: its body at each stage, its typed events, and what the store keeps.

Built by ``ResponsesServing.start`` once the request's engine request is added. ``events`` numbers
every event from 0 (``sequence_number``): ``response.created``, ``response.in_progress``, the
output's events (``output``), then ``response.completed`` / ``response.incomplete``, or
``response.failed`` with the error. The response is stored (``store``, or on its WebSocket
connection) before its terminal event or its body is sent: with a store file, committed to it,
so an acknowledged response survives a kill -9; a response the store could not keep (a failed
write, larger than a bound) is sent with ``store: false``.
"""

from __future__ import annotations

import itertools
import json
import time
from array import array
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from prefixserve.api.engine_client import RequestStream
from prefixserve.api.frontend.inputs import EngineInputs
from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.frontend.stream import DeltaTracker, drive
from prefixserve.api.frontend.tenancy import Tenant
from prefixserve.api.openai.responses.continuation import Prompt
from prefixserve.api.openai.responses.output import ResponseOutput
from prefixserve.api.openai.responses.protocol import ResponsesRequest
from prefixserve.api.openai.responses.store import Record
from prefixserve.api.parsing.reply import Finish
from prefixserve.core.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from prefixserve.api.openai.responses.serving import ResponsesServing

LOGPROBS = "message.output_text.logprobs"


class ResponseTurn:
    """One request's response: its body at each stage, its stream, and what the store keeps.
    ``owner``: (its tenant, its WebSocket connection's namespace or None, the stored response it
    continues: None for a new conversation or a truncated one, whose record holds all its
    items; how many of ``items`` came from it); ``shape``: (its engine inputs, a maker of the output's fresh ``ResponseOutput``)."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, response_id: str,
                 model: str, owner: tuple[Tenant, str | None, str | None, int], items: list[dict],
                 prompt: Prompt,
                 shape: tuple[EngineInputs, Callable[[], ResponseOutput]]) -> None:  # fmt: skip
        self.serving, self.req, self.id, self.model = serving, req, response_id, model
        self.tenant, self.connection, self.parent, self.history = owner
        self.items, self.prompt = items, prompt
        self.inputs, self.output = shape
        self.fmt = (req.text or {}).get("format") or {"type": "text"}
        self.headers: dict[str, str] = {}  # what was asked for and not honoured
        self.created_at = int(time.time())

    def status(self, c: CompletionOutput) -> str:
        """ "incomplete" when the output hit ``max_output_tokens`` (a warm-up is complete)."""
        return "incomplete" if c.finish_reason == "length" and self.req.generate else "completed"

    def body(self, status: str, output: list[dict], usage: dict | None = None,
             **extra: Any) -> dict:  # fmt: skip
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key, "reasoning": req.reasoning,
            "safety_identifier": req.safety_identifier, "service_tier": "default",
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": self.fmt}, "tool_choice": req.tool_choice,
            "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {}, **extra,
        }  # fmt: skip

    async def complete(self, final: RequestOutput, output: ResponseOutput) -> dict:
        """The finished response's body, once stored (``stored``)."""
        return await self.stored(*self.finished(final, output))

    def finished(self, final: RequestOutput, output: ResponseOutput) -> tuple[dict, list[int]]:
        """The finished response's body and its generated token ids (not stored yet)."""
        c = final.outputs[0]
        status = self.status(c)
        extra: dict[str, Any] = {}
        if status == "incomplete":
            extra["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            extra["completed_at"] = int(time.time())
        generated = c.token_ids if self.req.generate else []
        if self.req.generate:
            call = next((i["call_id"] for i in output.items
                         if i.get("type") in ("function_call", "custom_tool_call")), None)  # fmt: skip
            self.serving.tool_calls.paused(self.inputs, c, call)
        reasoning = self.serving.reasoning_tokens(generated, output.reasoning)
        body = self.body(status, output.items, _usage(final, len(generated), reasoning), **extra)
        return body, generated

    async def stored(self, body: dict, generated: list[int]) -> dict:
        """``body`` once the store kept it when the request asked for that (``store``; on a
        WebSocket connection, its own); with ``store: false`` when the store could not."""
        namespace = self.tenant.namespace(self.req.cache_salt) if self.req.store else (
            self.connection)  # fmt: skip
        if namespace is None:
            return body
        record = self._record(namespace, body, generated)
        if await self.serving.store.put(record, self.items) or not self.req.store:
            return body
        return {**body, "store": False}

    def _record(self, namespace: str, body: dict, generated: list[int]) -> Record:
        """What the store keeps of this response: its delta over ``parent`` (``store``)."""
        prompt, parent = self.prompt, self.parent
        new_items = self.items if parent is None else self.items[self.history :]
        spliced = prompt.spliced if parent is not None else None
        start = prompt.spliced_text if spliced is not None else 0
        return Record(
            self.id, namespace, self.tenant.owner, parent,
            {k: v for k, v in body.items() if k != "output"}, new_items, body["output"],
            spliced, prompt.text[start:], array("i", prompt.token_ids[spliced or 0 :]),
            array("i", generated), persist=self.req.store,
        )  # fmt: skip

    async def sse(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """``events`` as server-sent events."""
        async for body in self.events(streams):
            yield f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[dict]:
        """The stream's events, numbered from 0: created, in_progress, the output's events, then
        completed, incomplete or failed (a ``generate: false`` warm-up has no output events).
        However it ends, the engine request ends with it (``stream.drive``)."""
        serving, numbers = self.serving, itertools.count()
        output, tracker = self.output(), DeltaTracker()
        finished: list[tuple[dict, list[int]]] = []  # the finished body, until it is stored

        def event(body: dict) -> dict:
            return {**body, "sequence_number": next(numbers)}

        def on_output(_: int, out: RequestOutput | None) -> list[dict]:
            if out is None:
                return []
            c, events = out.outputs[0], []
            d = tracker.delta(0, c, serving.visible_text(c, self.inputs.mode))
            if d is not None and self.req.generate:
                done = d.finish_reason is not None
                logprobs = serving.logprobs_of(self.req, d.logprobs, d.token_ids)
                finish = Finish(c.finish_reason, c.stop_reason) if done else None
                events = output.feed(d.text, logprobs, finish)
                if done:
                    events += output.finish(self.status(c))
            if out.finished:
                finished.append(self.finished(out, output))
            return [event(e) for e in events]

        def failed(exc: APIError) -> list[dict]:
            finished.clear()
            return [event(self._failed(output, exc))]

        start = self.body("in_progress", [])
        opening = [event({"type": "response.created", "response": start}),
                   event({"type": "response.in_progress", "response": start})]  # fmt: skip
        async for body in drive(streams, serving.abort_all, on_output, failed, first=opening):
            yield body
        if finished:  # the terminal event once the response is stored
            body = await self.stored(*finished[0])
            yield event({"type": f"response.{body['status']}", "response": body})

    def _failed(self, output: ResponseOutput, exc: APIError) -> dict:
        code = "server_error" if exc.status == 500 and exc.err_type is None else exc.type
        error = {"code": code, "message": exc.message}
        return {"type": "response.failed",
                "response": self.body("failed", output.items, error=error)}  # fmt: skip


def _usage(final: RequestOutput, generated: int, reasoning: int) -> dict:
    prompt = len(final.prompt_token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens,
                                 "reused_segment_tokens": final.num_reused_segment_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + generated,
    }
