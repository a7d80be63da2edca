"""POST /v1/responses (OpenAI's Responses API) and its stored responses: GET, DELETE and
input_items of /v1/responses/{id}.

A request's items become chat messages (``items``) rendered by the chat template with its
function tools; the shared front half (``frontend.inputs``) turns ``tool_choice``, the tools'
``strict`` and ``text.format`` into the tool mode, grammar and parameters, as for chat
completions. With ``previous_response_id`` the prompt is the stored response's own token ids plus
the new items' tokens, verified against the template (``continuation``). The reply's parts become
typed output items and stream events (``output``) in one ``ResponseTurn``.

A stored response (``store``, the default) is kept, and with a store file committed to it, before
its body or ``response.completed`` is sent, so a client may continue it at once and it survives a
kill -9; one the store could not keep is sent with ``store: false`` (``turn``). ``DELETE``
answers once the deletes are committed. Everything is keyed by tenant (``frontend.tenancy``: the
API key's identity and ``cache_salt``); ``store: false`` keeps nothing (but on a WebSocket
connection, for as long as it lives). Continuations and truncations are counted once the engine
accepted the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from fastapi import Request
from fastapi.responses import JSONResponse

from prefixserve.api.engine_client import Generation
from prefixserve.api.frontend.inputs import TemplateServing, ToolRequest
from prefixserve.api.frontend.protocol import APIError, random_id
from prefixserve.api.frontend.reasoning_effort import effort_kwargs
from prefixserve.api.frontend.request import GenerationRequest, SamplingOptions
from prefixserve.api.frontend.stream import event_stream
from prefixserve.api.frontend.tenancy import Tenant, tenant_of
from prefixserve.api.openai.prompt_cache import retention_of, retention_session, routing_key
from prefixserve.api.openai.responses.continuation import Prompt, continue_prompt, render_prompt
from prefixserve.api.openai.responses.items import (
    normalize_input,
    reasoning_text,
    split_trailing_reasoning,
    to_messages,
)
from prefixserve.api.openai.responses.output import ResponseOutput
from prefixserve.api.openai.responses.protocol import (
    ResponsesRequest,
    check_supported,
    effort_of,
)
from prefixserve.api.openai.responses.store import ResponseStore, StoredResponse
from prefixserve.api.openai.responses.tools import JSON_ARGUMENTS, ResponsesTools, chat_tools
from prefixserve.api.openai.responses.truncation import truncate
from prefixserve.api.openai.responses.turn import LOGPROBS, ResponseTurn, TurnOwner, TurnServices
from prefixserve.api.parsing.reasoning import THINK_END, THINK_START, starts_in_reasoning
from prefixserve.api.parsing.reply import forced_syntax
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.engine.chat_template import render_chat_text
from prefixserve.structured_outputs.params import StructuredOutputsParams


class ResponsesServing(TemplateServing):
    """``continuations`` counts requests that named a previous response, by how their prompt was
    built: ``token_exact`` (spliced), ``rerendered`` (the template rewrote history) or
    ``truncated`` (``truncation: "auto"`` dropped old turns); ``truncations`` counts every
    request that lost turns so."""

    def __init__(self, engine, served_model_names: list[str], store: ResponseStore,
                 hosted_tools: str = "accept", **options) -> None:  # fmt: skip
        super().__init__(engine, served_model_names, **options)
        self.store = store
        self.hosted_tools = hosted_tools
        self.turn_services = TurnServices(store, self.tool_calls, engine.tokenizer,
                                          self.eos_texts, self.token_text)  # fmt: skip
        self.continuations = {"token_exact": 0, "rerendered": 0, "truncated": 0}
        self.truncations = 0
        self.tools_not_offered: Counter[str] = Counter()

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
            "responses_store_skipped_rows": self.store.skipped_rows,
            "responses_store_write_failures": self.store.write_failures,
        }

    # -- the stored responses ------------------------------------------------------------------

    def lookup(self, tenant: Tenant, response_id: str, cache_salt: str | None,
               param: str | None = None, connection: str | None = None) -> StoredResponse:  # fmt: skip
        """The caller's response ``response_id`` with its conversation (a WebSocket
        ``connection``'s own responses too), or a 404."""
        namespaces = (tenant.namespace(cache_salt), *((connection,) if connection else ()))
        entry = self.store.conversation(response_id, namespaces, self.engine.tokenizer)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param)
        return entry

    async def delete(self, tenant: Tenant, response_id: str, cache_salt: str | None) -> dict:
        """Delete a stored response and release what it retained (``prompt_cache_retention``;
        where the engine client cannot release, the retention runs out its TTL)."""
        namespace = tenant.namespace(cache_salt)
        if not await self.store.delete(response_id, namespace):
            raise APIError(f"Response with id '{response_id}' not found.", 404)
        with contextlib.suppress(APIError):
            await self.engine.release_kv(retention_session(namespace, response_id))
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
        """The response (a JSON body or an event stream), with ``_notices`` as headers."""
        turn, generation = await self.start(req, tenant_of(raw_request), stream=req.stream)
        with self.owned(generation):
            if req.stream:
                return event_stream(turn.sse(generation), turn.headers)
        final = (await self.collect(raw_request, generation))[0]
        return JSONResponse(await turn.complete(final), headers=turn.headers)

    async def start(
        self,
        req: ResponsesRequest,
        tenant: Tenant,
        connection: str | None = None,
        stream: bool = True,
    ) -> tuple[ResponseTurn, Generation]:
        """Check and prepare ``req``, add its engine request: (its turn, its generation, whose
        outputs are deltas when ``stream``, else the final one only).

        ``connection``: a WebSocket connection's store namespace, where its ``store: false``
        responses are kept while it lives (counted against the same bounds). ``generate: false`` (Codex's warm-up) renders the conversation without a
        generation prompt and runs it as a prefill whose one sampled token is discarded.
        """
        model = self.check_model(req.model)
        check_supported(req)
        prev = None
        if req.previous_response_id is not None:
            prev = self.lookup(tenant, req.previous_response_id, req.cache_salt,
                               "previous_response_id", connection)  # fmt: skip
        new_items = normalize_input(req.input)
        history = prev.items + prev.output_items if prev else []
        offered = chat_tools(req.tools, self.hosted_tools,
                             forced_syntax(self.tool_parser) in JSON_ARGUMENTS)  # fmt: skip
        tools = self._tool_request(req, offered)
        self.tool_mode(tools)  # a bad tool choice is a 400 before anything is rendered
        prompt, items = await asyncio.to_thread(self._fitted_prompt, req, prev,
                                                history + new_items, offered.functions)  # fmt: skip
        logprobs = (req.top_logprobs or 0) if LOGPROBS in (req.include or []) else None
        sampling = SamplingOptions.of(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                      cache_salt=req.cache_salt,
                                      segment_reuse=req.segment_reuse)  # fmt: skip
        response_id = random_id("resp_")
        retention = retention_of(req.prompt_cache_retention, retention_session(
            tenant.namespace(req.cache_salt), response_id), tenant.owner)  # fmt: skip
        # generate: false (a warm-up) runs the prompt and discards its one token
        results = [i["call_id"] for i in new_items if i.get("type") in (
            "function_call_output", "custom_tool_call_output")]  # fmt: skip
        inputs = self.prepare(GenerationRequest(
            prompt.token_ids, tools, sampling, req.max_output_tokens if req.generate else 1,
            _text_format(req, tools), logprobs, tenant=tenant, retention=retention,
            request_id=response_id if req.generate else None, tool_results=tuple(results),
        ))  # fmt: skip
        headers = self._notices(req, offered)
        generation = await self.generate(
            response_id, [prompt.token_ids], [inputs.params], "input", inputs.grammar_source,
            routing_key(tenant.namespace(req.cache_salt), req.prompt_cache_key), stream=stream)  # fmt: skip
        with self.owned(generation):
            truncated = len(items) < len(history) + len(new_items)
            self.truncations += truncated
            self.tools_not_offered.update(offered.not_offered)
            if prev is not None:
                kind = "token_exact" if prompt.token_exact else "rerendered"
                self.continuations["truncated" if truncated else kind] += 1

            output = ResponseOutput(self.reply_parser(inputs), LOGPROBS in (req.include or []),
                                    offered.namespaces, offered.custom)  # fmt: skip
            parent = None if prev is None or truncated else req.previous_response_id
            owner = TurnOwner(tenant, connection, parent, len(history))
            turn = ResponseTurn(req, response_id, model, owner, items, prompt, inputs, output,
                                self.turn_services)  # fmt: skip
            turn.headers = headers
        return turn, generation

    def _notices(self, req: ResponsesRequest, offered: ResponsesTools) -> dict[str, str]:
        """Response headers naming what the request asked for and did not get."""
        effort = effort_kwargs(effort_of(req), self.engine.tokenizer.chat_template)
        ignored = [name for name, given in (
            ("reasoning.effort", effort is None),
            ("text.verbosity", (req.text or {}).get("verbosity") is not None),
        ) if given]  # fmt: skip
        headers = {"x-prefixserve-ignored": ", ".join(ignored)} if ignored else {}
        if offered.not_offered:
            headers["x-prefixserve-tools-not-offered"] = ", ".join(offered.not_offered)
        return headers

    @staticmethod
    def _tool_request(req: ResponsesRequest, offered: ResponsesTools) -> ToolRequest:
        choice = req.tool_choice
        named = isinstance(choice, dict)
        if named and (choice.get("type") not in ("function", "custom")
                      or not isinstance(choice.get("name"), str)):  # fmt: skip
            raise APIError(
                'tool_choice: the supported object is {"type": "function" | "custom", "name": ...}',
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
        kind = "named" if named else choice
        if not offered.functions and kind == "auto":
            kind = "none"
        return ToolRequest(offered.functions, kind, choice["name"] if named else None,
                           req.parallel_tool_calls, offered.strict,
                           offered.grammar_functions)  # fmt: skip

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
        items, trailing = split_trailing_reasoning(items)
        messages = to_messages(items)
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        if not messages:
            raise APIError("input: give at least one item (or instructions)", 400, "input")
        try:
            effort = effort_kwargs(effort_of(req), self.engine.tokenizer.chat_template)
            text = render_chat_text(self.engine.tokenizer, messages, tools=tools,
                                    add_generation_prompt=req.generate,
                                    content_format=self.content_format,
                                    chat_template_kwargs=effort or None)  # fmt: skip
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, "input") from exc
        text += self._reasoning_prefill(text, trailing)
        if prev is None or prev.prompt_text is None:  # nothing to splice (or not after a restart)
            return render_prompt(self.engine.tokenizer, text)
        return continue_prompt(
            self.engine.tokenizer, prev.prompt_text, prev.prompt_token_ids,
            prev.output_token_ids, text, self.engine.eos_token_ids,
        )  # fmt: skip

    def _reasoning_prefill(self, prompt: str, trailing: list[dict]) -> str:
        """The reply's start that trailing reasoning items write: the reasoning block as the
        model writes it (``<think>`` unless the prompt opened it), closed unless the last item is
        ``incomplete`` (a reply cut off inside its reasoning goes on reasoning)."""
        if not trailing:
            return ""
        text = "\n".join(reasoning_text(i, item) for i, item in enumerate(trailing))
        opened = starts_in_reasoning(self.reasoning_parser or "qwen3", prompt)
        closed = trailing[-1].get("status") != "incomplete"
        return ("" if opened else THINK_START) + text + (THINK_END + "\n\n" if closed else "")


def _text_format(
    req: ResponsesRequest, tools: ToolRequest
) -> tuple[StructuredOutputsParams | None, str | None]:
    """``text.format`` as a grammar and its field (a forced call writes no text, so the front half
    applies it to the turns that write text)."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    try:
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True), "text"
        if kind == "json_schema" and isinstance(fmt.get("schema"), (dict, bool)):
            return StructuredOutputsParams(json=fmt["schema"]), "text"
    except InvalidArgumentError as exc:
        raise APIError(str(exc), 400, "text") from exc
    if kind == "text":
        return None, None
    raise APIError(
        "text.format: use {'type': 'text'}, {'type': 'json_object'} or {'type': "
        "'json_schema', 'name': ..., 'schema': {...}}",
        400,
        "text",
    )
