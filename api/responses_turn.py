"""One response's lifecycle: its body at each stage, its typed events, and what the store keeps.

Built by ``ResponsesServing.start`` once the request's engine request is added. ``events`` numbers
every event from 0 (``sequence_number``): ``response.created``, ``response.in_progress``, the
output's events (``responses_output``), then ``response.completed`` / ``response.incomplete``,
or ``response.failed`` with the error; the response is stored (``store``) and added to the
connection's chain (WebSocket) before its terminal event is sent.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from prefixserve.api.async_engine import RequestStream
from prefixserve.api.protocol import APIError
from prefixserve.api.protocol_responses import ResponsesRequest
from prefixserve.api.responses_continuation import Prompt
from prefixserve.api.responses_output import ResponseOutput
from prefixserve.api.responses_store import Chain, StoredResponse
from prefixserve.api.serving_base import DeltaTracker, merge
from prefixserve.api.tool_call_streams import ToolMode

from prefixserve.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from prefixserve.api.serving_responses import ResponsesServing

logger = logging.getLogger(__name__)
LOGPROBS = "message.output_text.logprobs"


class ResponseTurn:
    """One request's response: its body at each stage, its stream, and what the store keeps.
    ``shape``: (tool mode, ``text.format``, a maker of the output's fresh ``ResponseOutput``)."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, response_id: str,
                 model: str, owner: tuple[str, Chain | None], items: list[dict], prompt: Prompt,
                 shape: tuple[ToolMode, dict, Callable[[], ResponseOutput]]) -> None:  # fmt: skip
        self.serving, self.req, self.id, self.model = serving, req, response_id, model
        self.tenant, self.chain = owner
        self.items, self.prompt = items, prompt
        self.mode, self.fmt, self.output = shape
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
            "prompt_cache_key": req.prompt_cache_key, "reasoning": None,
            "safety_identifier": req.safety_identifier, "service_tier": "default",
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": self.fmt}, "tool_choice": req.tool_choice,
            "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {}, **extra,
        }  # fmt: skip

    def complete(self, final: RequestOutput, output: ResponseOutput) -> dict:
        """The finished response's body; stored when the request asked for it."""
        c = final.outputs[0]
        status = self.status(c)
        extra: dict[str, Any] = {}
        if status == "incomplete":
            extra["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            extra["completed_at"] = int(time.time())
        generated = c.token_ids if self.req.generate else []
        reasoning = self.serving.reasoning_tokens(generated, output.reasoning)
        body = self.body(status, output.items, _usage(final, len(generated), reasoning), **extra)
        if self.req.store or self.chain is not None:
            entry = StoredResponse(
                response=body, items=self.items, output_items=output.items,
                prompt_text=self.prompt.text,
                prompt_token_ids=array("i", final.prompt_token_ids),
                output_token_ids=array("i", generated),
            )  # fmt: skip
            if self.req.store:
                self.serving.store.put(self.tenant, self.id, entry)
            if self.chain is not None:
                self.chain[self.id] = entry
        return body

    async def sse(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """``events`` as server-sent events."""
        async for body in self.events(streams):
            yield f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[dict]:
        """The stream's events, numbered from 0: created, in_progress, the output's events, then
        completed, incomplete or failed (a ``generate: false`` warm-up has no output events).
        However it ends, the engine request ends with it."""
        serving, numbers = self.serving, itertools.count()
        output, tracker = self.output(), DeltaTracker()

        def event(body: dict) -> dict:
            return {**body, "sequence_number": next(numbers)}

        try:
            start = self.body("in_progress", [])
            yield event({"type": "response.created", "response": start})
            yield event({"type": "response.in_progress", "response": start})
            async for _, out in merge(streams):
                c = out.outputs[0]
                d = tracker.delta(0, c, serving.visible_text(c, self.mode))
                if d is not None and self.req.generate:
                    done = d.finish_reason is not None
                    logprobs = serving.logprobs_of(self.req, d.logprobs, d.token_ids)
                    events = output.feed(d.text, logprobs, final=done)
                    if done:
                        events += output.finish(self.status(c))
                    for body in events:
                        yield event(body)
                if out.finished:
                    body = self.complete(out, output)
                    yield event({"type": f"response.{body['status']}", "response": body})
        except APIError as exc:
            yield event(self._failed(output, str(exc), exc.type))
        except Exception as exc:
            logger.exception("responses stream failed")
            yield event(self._failed(output, str(exc), "server_error"))
        finally:
            serving.abort_all(streams)

    def _failed(self, output: ResponseOutput, message: str, code: str) -> dict:
        error = {"code": code, "message": message}
        return {"type": "response.failed",
                "response": self.body("failed", output.items, error=error)}  # fmt: skip


def _usage(final: RequestOutput, generated: int, reasoning: int) -> dict:
    prompt = len(final.prompt_token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + generated,
    }
