"""POST /v1/responses (OpenAI's Responses API) and its stored responses: GET, DELETE and
input_items of /v1/responses/{id}.

A request becomes one engine request through the chat endpoint's machinery: its items become
chat messages (``responses_items``), rendered by the chat template with its function tools;
``tool_choice`` picks the chat endpoint's ``ToolMode``; calls are read, and forced calls
generated (grammar-constrained to each tool's ``parameters``), in ``--tool-call-parser``'s syntax
as chat completions does (``tool_call_streams``); ``text.format`` is a structured output. With
``--reasoning-parser`` the reasoning block becomes a ``reasoning`` output item, and grammars and
forced calls apply after it. With
``previous_response_id`` the prompt is the stored response's own token ids plus the new items'
tokens, verified against the template (``responses_continuation``). Output text becomes typed
output items and stream events (``responses_output``) in one ``ResponseTurn``.

A stored response (``store``, the default) is written before ``response.completed`` is sent, so
a client may continue it at once. Everything is keyed by tenant (``tenant_of``: the API key and
``cache_salt``); ``store: false`` keeps nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request
from prefixserve.api.async_engine import AsyncEngine, RequestStream
from prefixserve.api.protocol import APIError, _SamplingFields, random_id
from prefixserve.api.protocol_responses import ResponsesRequest, check_supported
from prefixserve.api.reasoning_parsers import (
    count_reasoning_tokens,
    reasoning_parser,
    reasoning_tags,
)
from prefixserve.api.responses_continuation import Prompt, continue_prompt, render_prompt
from prefixserve.api.responses_items import chat_tools, normalize_input, strict_names, to_messages
from prefixserve.api.responses_output import ResponseOutput
from prefixserve.api.responses_store import Chain, ResponseStore, StoredResponse, tenant_of
from prefixserve.api.responses_truncation import truncate
from prefixserve.api.responses_turn import LOGPROBS, ResponseTurn
from prefixserve.api.serving_base import BaseServing
from prefixserve.api.tool_call_streams import ToolMode, forced_syntax

from prefixserve.chat_template import render_chat_text
from prefixserve.errors import InvalidArgumentError
from prefixserve.outputs import CompletionOutput
from prefixserve.structured_outputs.params import StructuredOutputsParams
from prefixserve.structured_outputs.tool_calls import optional_tool_call_params, tool_call_params


class ResponsesServing(BaseServing):
    """``continuations`` counts requests that named a previous response, by how their prompt was
    built: ``token_exact`` (spliced), ``rerendered`` (the template rewrote history) or
    ``truncated`` (``truncation: "auto"`` dropped old turns); ``truncations`` counts every
    request that lost turns so."""

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_names: list[str],
        tool_parser: str | None,
        store: ResponseStore,
        content_format: str = "auto",
        reasoning_parser: str | None = None,
        **options,
    ) -> None:
        super().__init__(engine, served_model_names, **options)
        self.tool_parser = tool_parser
        self.forced_syntax = forced_syntax(tool_parser)
        self.reasoning_parser = reasoning_parser
        self.store = store
        self.content_format = content_format
        self.continuations = {"token_exact": 0, "rerendered": 0, "truncated": 0}
        self.truncations = 0
        texts = {engine.tokenizer.decode([t]) for t in engine.eos_token_ids} - {""}
        self.eos_texts = tuple(sorted(texts, key=len, reverse=True))

    def stats(self) -> dict:
        """The Responses figures of /stats (the same values as the Prometheus metrics)."""
        return {
            "responses_continuations_token_exact": self.continuations["token_exact"],
            "responses_continuations_rerendered": self.continuations["rerendered"],
            "responses_continuations_truncated": self.continuations["truncated"],
            "responses_truncations": self.truncations,
            "responses_store_entries": len(self.store),
            "responses_store_bytes": self.store.nbytes,
            "responses_store_evictions": self.store.evictions,
        }

    # -- the stored responses ------------------------------------------------------------------

    def lookup(self, authorization: str | None, response_id: str, cache_salt: str | None,
               param: str | None = None, chain: Chain | None = None) -> StoredResponse:  # fmt: skip
        """The caller's response ``response_id`` (from the connection's ``chain`` first, then
        the store), or a 404."""
        entry = (chain or {}).get(response_id)
        if entry is None:
            entry = self.store.get(tenant_of(authorization, cache_salt), response_id)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param)
        return entry

    def delete(self, authorization: str | None, response_id: str, cache_salt: str | None) -> dict:
        if not self.store.delete(tenant_of(authorization, cache_salt), response_id):
            raise APIError(f"Response with id '{response_id}' not found.", 404)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def input_items(self, entry: StoredResponse, limit: int, order: str, after: str | None) -> dict:
        """OpenAI's list page of a response's input items (``order`` "desc" is newest first)."""
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise APIError("order: 'asc' or 'desc'; limit: 1 to 100", 400, "order")
        items = entry.items if order == "asc" else entry.items[::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise APIError(f"after: no input item with id {after!r}", 400, "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "has_more": len(items) > limit,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None}  # fmt: skip

    # -- POST /v1/responses --------------------------------------------------------------------

    async def create(self, req: ResponsesRequest, raw_request: Request):
        turn, streams = await self.start(req, raw_request.headers.get("authorization"))
        if req.stream:
            return turn.sse(streams)
        final = (await self.collect(raw_request, streams))[0]
        c = final.outputs[0]
        output = turn.output()
        if req.generate:
            output.feed(self.visible_text(c, turn.mode),
                        self.logprobs_of(req, c.logprobs, c.token_ids), final=True)  # fmt: skip
            output.finish(turn.status(c))
        return turn.complete(final, output)

    async def start(
        self, req: ResponsesRequest, authorization: str | None, chain: Chain | None = None
    ) -> tuple[ResponseTurn, list[RequestStream]]:
        """Check and prepare ``req``, add its engine request: (its turn, its stream).

        ``chain``: the responses of a WebSocket connection, continued from and added to whatever
        ``store`` says. ``generate: false`` (Codex's warm-up) renders the conversation without a
        generation prompt and runs it as a prefill whose one sampled token is discarded.
        """
        model = self.check_model(req.model)
        check_supported(req)
        tenant = tenant_of(authorization, req.cache_salt)
        prev = None
        if req.previous_response_id is not None:
            prev = self.lookup(authorization, req.previous_response_id, req.cache_salt,
                               "previous_response_id", chain)  # fmt: skip
        new_items = normalize_input(req.input)
        history = prev.items + prev.output_items if prev else []
        tools, namespaces = chat_tools(req.tools)
        mode = self._tool_mode(req, tools)
        prompt, items = await asyncio.to_thread(self._fitted_prompt, req, prev,
                                                history + new_items, tools)  # fmt: skip
        prompt_tail = self.engine.tokenizer.decode(prompt.token_ids[-32:])  # where reasoning stands
        structured, source = self._structured_outputs(req, tools, mode, prompt_tail)
        fmt = (req.text or {}).get("format") or {"type": "text"}
        truncated = len(items) < len(history) + len(new_items)
        self.truncations += truncated
        if prev is not None:
            kind = "token_exact" if prompt.token_exact else "rerendered"
            self.continuations["truncated" if truncated else kind] += 1
        logprobs = (req.top_logprobs or 0) if LOGPROBS in (req.include or []) else None
        sampling = _SamplingFields(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                   cache_salt=req.cache_salt)  # fmt: skip
        params = self.make_params(sampling, req.max_output_tokens, logprobs, structured)
        if mode is not ToolMode.NONE:
            params.skip_special_tokens = False  # tool-call tags may be special tokens
        if not req.generate:
            params.max_tokens = 1
        response_id = random_id("resp_")
        streams = await self.add_all(response_id, [prompt.token_ids], [params], "input", source)

        def new_output() -> ResponseOutput:
            name = self.reasoning_parser
            reasoner = reasoning_parser(name, prompt_tail) if name is not None else None
            return ResponseOutput(mode, LOGPROBS in (req.include or []), namespaces,
                                  self.tool_parser, tools, reasoner)  # fmt: skip

        turn = ResponseTurn(self, req, response_id, model, (tenant, chain), items, prompt,
                            (mode, fmt, new_output))  # fmt: skip
        return turn, streams

    def reasoning_tokens(self, token_ids: list[int], reasoning: str | None) -> int:
        """How many of an output's tokens are reasoning (``output_tokens_details``)."""
        return count_reasoning_tokens(self.engine.tokenizer, token_ids, reasoning)

    def _fitted_prompt(self, req: ResponsesRequest, prev: StoredResponse | None,
                       items: list[dict], tools: list[dict] | None) -> tuple[Prompt, list[dict]]:  # fmt: skip
        """(the prompt, the items it renders): with ``truncation: "auto"``, a prompt over the
        context (with room for ``max_output_tokens``) loses its oldest turns
        (``responses_truncation``), and is then a full rendering."""
        prompt = self._prompt(req, prev, items, tools)
        room = self.engine.max_model_len - (req.max_output_tokens or 1)
        if req.truncation != "auto" or len(prompt.token_ids) <= room:
            return prompt, items
        cut = truncate(items, lambda kept: self._prompt(req, None, kept, tools),
                       lambda p: len(p.token_ids) <= room)  # fmt: skip
        return cut if cut is not None else (prompt, items)

    def _prompt(self, req: ResponsesRequest, prev: StoredResponse | None,
                items: list[dict], tools: list[dict] | None) -> Prompt:  # fmt: skip
        messages = to_messages(items)
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        if not messages:
            raise APIError("input: give at least one item (or instructions)", 400, "input")
        try:
            text = render_chat_text(self.engine.tokenizer, messages, tools=tools,
                                    add_generation_prompt=req.generate,
                                    content_format=self.content_format)  # fmt: skip
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, "input") from exc
        if prev is None:
            return render_prompt(self.engine.tokenizer, text)
        return continue_prompt(
            self.engine.tokenizer, prev.prompt_text, prev.prompt_token_ids,
            prev.output_token_ids, text, self.engine.eos_token_ids,
        )  # fmt: skip

    def _tool_mode(self, req: ResponsesRequest, tools: list[dict] | None) -> ToolMode:
        choice = req.tool_choice
        named = isinstance(choice, dict)
        if named and (choice.get("type") != "function" or not isinstance(choice.get("name"), str)):
            raise APIError(
                'tool_choice: the supported object is {"type": "function", "name": ...}',
                400,
                "tool_choice",
            )
        if not named and choice not in ("none", "auto", "required"):
            raise APIError(
                f"tool_choice: {choice!r} is not supported; use 'none', 'auto', 'required' or "
                '{"type": "function", "name": ...}',
                400,
                "tool_choice",
            )
        if not tools:
            if named or choice == "required":
                raise APIError(f"tool_choice: {choice!r} needs tools", 400, "tool_choice")
            return ToolMode.NONE
        if choice == "none":
            return ToolMode.NONE
        if named or choice == "required":
            return ToolMode.NAMED if named else ToolMode.REQUIRED
        if self.tool_parser is None:
            raise APIError(
                "tool_choice: 'auto' with tools requires the server to run with "
                "--tool-call-parser (or force a call with 'required' or a named function)",
                400,
                "tool_choice",
            )
        return ToolMode.AUTO

    def _structured_outputs(
        self, req: ResponsesRequest, tools: list[dict] | None, mode: ToolMode, prompt_tail: str
    ) -> tuple[StructuredOutputsParams | None, str]:
        """(params, the request field they came from). A forced call writes no message text, so
        ``text.format`` applies to the turns that write text; with ``auto``, a ``text.format``
        other than text constrains the whole output, else strict tools constrain the calls
        (hermes only: the optional-call grammar exists in that syntax alone, so with another
        ``--tool-call-parser`` strict auto calls are parsed but not constrained). Every grammar
        applies after the reasoning block, when one comes."""
        fmt = (req.text or {}).get("format") or {"type": "text"}
        kind = fmt.get("type")
        reasoning = reasoning_tags(self.reasoning_parser, prompt_tail)
        try:
            if mode in (ToolMode.REQUIRED, ToolMode.NAMED):
                name = req.tool_choice["name"] if mode is ToolMode.NAMED else None
                params = tool_call_params(tools or [], name, req.parallel_tool_calls,
                                          self.forced_syntax, reasoning)  # fmt: skip
                return params, "tool_choice"
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True, reasoning=reasoning), "text"
            if kind == "json_schema" and isinstance(fmt.get("schema"), (dict, bool)):
                return StructuredOutputsParams(json=fmt["schema"], reasoning=reasoning), "text"
            strict = strict_names(req.tools)
            hermes = self.tool_parser == "hermes"
            if kind == "text" and mode is ToolMode.AUTO and strict and hermes:
                params = optional_tool_call_params(tools or [], strict, req.parallel_tool_calls)
                return dataclasses.replace(params, reasoning=reasoning), "tools"
            if kind == "text":
                return None, "text"
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, exc.param) from exc
        raise APIError(
            "text.format: use {'type': 'text'}, {'type': 'json_object'} or {'type': "
            "'json_schema', 'name': ..., 'schema': {...}}",
            400,
            "text",
        )

    def visible_text(self, c: CompletionOutput, mode: ToolMode) -> str:
        """The output text, less the EOS text that tool modes keep (special tokens shown)."""
        if mode is not ToolMode.NONE and c.finish_reason == "stop":
            for eos in self.eos_texts:
                if c.text.endswith(eos):
                    return c.text[: -len(eos)]
        return c.text

    def logprobs_of(self, req: ResponsesRequest, entries: list[dict[int, float]] | None,
                  token_ids: list[int]) -> list[dict] | None:  # fmt: skip
        """OpenAI's ``logprobs`` of output text: per token its text, bytes, logprob and the top
        ``top_logprobs``."""
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        k = req.top_logprobs or 0
        out = []
        for entry, token in zip(entries, token_ids):
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
            out.append({**item(token, entry[token]), "top_logprobs": [item(*t) for t in top]})
        return out
