"""One response's lifecycle: its body at each stage, its typed events, and what the store keeps.

Built by ``ResponsesServing.start`` once the request's engine request is added, from values: the
request, its owner (``TurnOwner``), the items and prompt it renders, its engine inputs and its
``ResponseOutput``, and what every turn of the server shares (``TurnServices``: the store, the
tool-call retention, the engine's abort, what reads an output). It never reaches back into the
serving. ``events`` numbers every event from 0 (``sequence_number``): ``response.created``,
``response.in_progress``, the output's events (``output``), then ``response.completed`` /
``response.incomplete``, or ``response.failed`` with the error; ``complete`` feeds a whole
reply once through the same output. The response is stored (``store``, or on its WebSocket
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
from dataclasses import dataclass, replace
from typing import Any

from prefixserve.api.engine_client import Generation
from prefixserve.api.frontend.inputs import EngineInputs, visible_text
from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.frontend.stream import ChoiceTotals, as_api_error
from prefixserve.api.frontend.tenancy import Tenant
from prefixserve.api.frontend.tool_call_retention import ToolCallRetention
from prefixserve.api.openai.responses.continuation import Prompt
from prefixserve.api.openai.responses.output import ResponseOutput
from prefixserve.api.openai.responses.protocol import ResponsesRequest
from prefixserve.api.openai.responses.store import Record, ResponseStore
from prefixserve.api.parsing.reasoning import count_reasoning_tokens
from prefixserve.api.parsing.reply import Finish
from prefixserve.core.outputs import CompletionOutput, RequestOutput

LOGPROBS = "message.output_text.logprobs"


@dataclass(frozen=True, slots=True)
class TurnOwner:
    """Whose response a turn is and what it continues: ``connection``, its WebSocket
    connection's store namespace (None over HTTP); ``parent``, the stored response it continues
    (None for a new conversation or a truncated one, whose record then holds all its items);
    ``history``, how many of the turn's items came from ``parent``'s conversation."""

    tenant: Tenant
    connection: str | None
    parent: str | None
    history: int


@dataclass(frozen=True, slots=True)
class TurnServices:
    """What every turn of one server shares, each as narrow as a turn needs: ``store`` keeps
    finished responses; ``retention`` keeps the KV of a reply that paused on a tool call;
    ``tokenizer`` counts reasoning
    tokens; ``eos_texts`` are the EOS texts tool modes keep (``visible_text``); ``token_text``
    spells a token in its logprobs."""

    store: ResponseStore
    retention: ToolCallRetention
    tokenizer: Any
    eos_texts: tuple[str, ...]
    token_text: Callable[[int], str]


class ResponseTurn:
    """One request's response: its body at each stage, its stream, and what the store keeps.
    ``items``: the conversation's input items ``prompt`` renders; ``inputs``: its engine
    inputs; ``output``: its output, fed by ``events`` or ``complete`` (one of them, once)."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, owner: TurnOwner,
                 items: list[dict], prompt: Prompt, inputs: EngineInputs,
                 output: ResponseOutput, services: TurnServices) -> None:  # fmt: skip
        self.req, self.id, self.model, self.owner = req, response_id, model, owner
        self.items, self.prompt = items, prompt
        self.inputs, self.output, self.services = inputs, output, services
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

    async def complete(self, final: RequestOutput) -> dict:
        """The body of a whole (not streamed) reply, once stored (``stored``): its text is fed
        once through the output, as a stream feeds it in pieces."""
        c = final.outputs[0]
        if self.req.generate:
            self.output.feed(self._visible_text(c), self._logprobs(c.logprobs, c.token_ids),
                             Finish(c.finish_reason, c.stop_reason))  # fmt: skip
            self.output.finish(self.status(c))
        return await self.stored(*self.finished(final))

    def finished(self, final: RequestOutput) -> tuple[dict, list[int]]:
        """The finished response's body and its generated token ids (not stored yet)."""
        c, output = final.outputs[0], self.output
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
            self.services.retention.paused(self.inputs, c.finish_reason, call)
        reasoning = count_reasoning_tokens(self.services.tokenizer, generated, output.reasoning)
        body = self.body(status, output.items, _usage(final, len(generated), reasoning), **extra)
        return body, generated

    async def stored(self, body: dict, generated: list[int]) -> dict:
        """``body`` once the store kept it when the request asked for that (``store``; on a
        WebSocket connection, its own); with ``store: false`` when the store could not."""
        owner = self.owner
        namespace = owner.tenant.namespace(self.req.cache_salt) if self.req.store else (
            owner.connection)  # fmt: skip
        if namespace is None:
            return body
        record = self._record(namespace, body, generated)
        if await self.services.store.put(record, self.items) or not self.req.store:
            return body
        return {**body, "store": False}

    def _record(self, namespace: str, body: dict, generated: list[int]) -> Record:
        """What the store keeps of this response: its delta over ``parent`` (``store``)."""
        prompt, parent = self.prompt, self.owner.parent
        new_items = self.items if parent is None else self.items[self.owner.history :]
        spliced = prompt.spliced if parent is not None else None
        start = prompt.spliced_text if spliced is not None else 0
        return Record(
            self.id, namespace, self.owner.tenant.owner, parent,
            {k: v for k, v in body.items() if k != "output"}, new_items, body["output"],
            spliced, prompt.text[start:], array("i", prompt.token_ids[spliced or 0 :]),
            array("i", generated), persist=self.req.store,
        )  # fmt: skip

    async def sse(self, generation: Generation) -> AsyncIterator[str]:
        """``events`` as server-sent events."""
        async for body in self.events(generation):
            yield f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, generation: Generation) -> AsyncIterator[dict]:
        """The stream's events, numbered from 0: created, in_progress, the output's events, then
        completed, incomplete or failed (a ``generate: false`` warm-up has no output events).
        However it ends, the engine request ends with it (the generation is closed)."""
        numbers, output, totals = itertools.count(), self.output, ChoiceTotals()
        finished: tuple[dict, list[int]] | None = None  # the finished body, until it is stored

        def event(body: dict) -> dict:
            return {**body, "sequence_number": next(numbers)}

        start = self.body("in_progress", [])
        async with generation:
            try:
                yield event({"type": "response.created", "response": start})
                yield event({"type": "response.in_progress", "response": start})
                async for _, out in generation:
                    c = out.outputs[0]
                    totals.add(0, c)
                    text = self._visible_text(c)
                    done = c.finish_reason is not None
                    if self.req.generate and (text or c.token_ids or done):
                        finish = Finish(c.finish_reason, c.stop_reason) if done else None
                        for body in output.feed(text, self._logprobs(c.logprobs, c.token_ids),
                                                finish):  # fmt: skip
                            yield event(body)
                        for body in output.finish(self.status(c)) if done else ():
                            yield event(body)
                    if out.finished:
                        whole = replace(c, token_ids=totals.token_ids(0))
                        finished = self.finished(replace(out, outputs=[whole]))
            except Exception as exc:
                finished = None
                yield event(self._failed(as_api_error(exc)))
        if finished is not None:  # the terminal event once the response is stored
            body = await self.stored(*finished)
            yield event({"type": f"response.{body['status']}", "response": body})

    def _failed(self, exc: APIError) -> dict:
        code = "server_error" if exc.status == 500 and exc.err_type is None else exc.type
        error = {"code": code, "message": exc.message}
        return {"type": "response.failed",
                "response": self.body("failed", self.output.items, error=error)}  # fmt: skip

    def _visible_text(self, c: CompletionOutput) -> str:
        return visible_text(c, self.inputs.mode, self.services.eos_texts)

    def _logprobs(self, entries: list[dict[int, float]] | None,
                  token_ids: list[int]) -> list[dict] | None:  # fmt: skip
        """OpenAI's ``logprobs`` of output text: per token its text, bytes, logprob and the top
        ``top_logprobs``."""
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self.services.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        k = self.req.top_logprobs or 0
        out = []
        for entry, token in zip(entries, token_ids):
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
            out.append({**item(token, entry[token]), "top_logprobs": [item(*t) for t in top]})
        return out


def _usage(final: RequestOutput, generated: int, reasoning: int) -> dict:
    prompt = len(final.prompt_token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": final.num_cached_tokens,
            "reused_segment_tokens": final.num_reused_segment_tokens,
        },
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + generated,
    }
