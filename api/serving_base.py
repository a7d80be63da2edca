"""What chat and text completions share: model check, engine parameters, admission, collecting
outputs, and one streaming core.

A request becomes one or more engine requests (one per prompt); outputs are cumulative, so a
stream's delta is the new suffix of a choice's text, token ids and logprobs since the last event
(``DeltaTracker``). Every engine request a handler added is aborted when the handler ends before
it finished (client gone, error, timeout, cancellation). A request is admitted whole or refused
whole (503 when the waiting queue is full). A stream always ends with ``data: [DONE]``, after an
OpenAI-shaped error event if it failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from prefixserve.api.async_engine import RequestStream
from prefixserve.api.engine_client import EngineClient
from prefixserve.api.protocol import APIError, PromptTokensDetails, Usage

from prefixserve.errors import CacheCapacityError, InvalidArgumentError
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.structured_outputs.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def chunk_event(base: dict, choices: list[dict], **extra) -> str:
    """One streamed chunk: ``base`` (id, object, model) with a fresh ``created``."""
    return sse({**base, "created": int(time.time()), "choices": choices, **extra})


def usage_of(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


@dataclass(slots=True)
class ChoiceDelta:
    """What a choice gained since its last event. ``text_offset``: where ``text`` starts in the
    choice's whole text; ``first``: this is the choice's first event (nothing was sent yet)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    text_offset: int
    finish_reason: str | None
    stop_reason: str | int | None
    first: bool


class DeltaTracker:
    """Per choice index, how much text and how many tokens were already sent.

    Invariant: the concatenated ``text`` of a choice's deltas is its final text, each token is
    sent once, and a choice yields nothing after the delta that carries its finish reason.
    """

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int]] = {}  # index -> (chars, tokens)
        self._done: set[int] = set()

    def delta(self, index: int, c: CompletionOutput, text: str) -> ChoiceDelta | None:
        """The delta of choice ``index`` whose output is ``c`` with visible ``text``; None if
        nothing is new."""
        if index in self._done:
            return None
        first = index not in self._sent
        chars, tokens = self._sent.get(index, (0, 0))
        new_ids = c.token_ids[tokens:]
        if len(text) == chars and not new_ids and c.finish_reason is None:
            return None
        self._sent[index] = (len(text), len(c.token_ids))
        if c.finish_reason is not None:
            self._done.add(index)
        logprobs = c.logprobs[tokens:] if c.logprobs is not None else None
        return ChoiceDelta(index, text[chars:], new_ids, logprobs, chars, c.finish_reason,
                           c.stop_reason, first)  # fmt: skip


class BaseServing:
    """What both endpoints share. ``request_timeout`` (seconds) bounds each request's time in
    the engine; ``require_cache_salt`` refuses requests without a ``cache_salt`` (every tenant
    must name its cache namespace)."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_names: list[str],
        request_timeout: float | None = None,
        require_cache_salt: bool = False,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.request_timeout = request_timeout
        self.require_cache_salt = require_cache_salt
        self._token_text: dict[int, str] = {}

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.served_model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, "model")
        return self.served_model_names[0]

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """A token's text, or ``token_id:N`` (``return_tokens_as_token_ids``)."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def prompt_logprobs(
        self, entries: list[dict[int, float] | None], k: int, computed_k: int, as_ids: bool
    ) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}} for the prompt token and the k most likely tokens.

        The engine computed each entry with ``computed_k`` >= k: the prompt token first, then
        the true top ``computed_k``, so the order among those is exact. The prompt token's rank
        is known when it is one of them; otherwise it is None (the engine ranks only the top).
        """
        out: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            target = next(iter(entry))  # the engine puts the prompt token first
            ranked = sorted(entry, key=entry.__getitem__, reverse=True)
            known = len(entry) == computed_k  # the prompt token is one of the true top k
            ranks = {tid: r for r, tid in enumerate(ranked, 1) if tid != target or known}
            kept = ranked[:k] + ([target] if target not in ranked[:k] else [])
            out.append({
                str(tid): {"logprob": entry[tid], "rank": ranks.get(tid),
                           "decoded_token": self.token_text(tid, as_ids)}
                for tid in kept
            })  # fmt: skip
        return out

    def make_params(
        self,
        req,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ):
        """Engine parameters of a request (the engine checks them against the context and the
        vocabulary)."""
        if self.require_cache_salt and not req.cache_salt:
            raise APIError(
                "cache_salt: this server requires a non-empty 'cache_salt' on every request "
                "(it isolates your prefix cache from other tenants); add one",
                400,
                "cache_salt",
            )
        try:
            if req.use_beam_search:
                self._check_beam_search(req, logprobs, prompt_logprobs)
                return BeamSearchParams(
                    beam_width=req.n,
                    max_tokens=max_tokens,
                    length_penalty=req.length_penalty,
                    ignore_eos=req.ignore_eos,
                    cache_salt=req.cache_salt,
                    stop_token_ids=list(req.stop_token_ids or []),
                    structured_outputs=structured_outputs,
                    stop=req.stop,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    skip_special_tokens=req.skip_special_tokens,
                )
            return SamplingParams(
                n=req.n,
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                logprobs=logprobs,
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                cache_salt=req.cache_salt,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured_outputs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=_logit_bias(req.logit_bias),
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
            )
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, exc.param) from exc

    @staticmethod
    def _check_beam_search(req, logprobs: int | None, prompt_logprobs: int | None) -> None:
        """Beam search scores with the raw model: options it would not honour are refused
        (sampling controls at values other than their neutral ones included; ``seed`` is
        accepted, the search being deterministic)."""
        given = {
            "temperature": req.temperature not in (None, 0),
            "top_p": req.top_p not in (None, 1),
            "top_k": req.top_k not in (None, 0, -1),
            "min_p": req.min_p not in (None, 0),
            "presence_penalty": req.presence_penalty != 0,
            "frequency_penalty": req.frequency_penalty != 0,
            "repetition_penalty": req.repetition_penalty != 1,
            "logprobs": logprobs is not None,
            "prompt_logprobs": prompt_logprobs is not None,
            "logit_bias": bool(req.logit_bias),
            "allowed_token_ids": req.allowed_token_ids is not None,
            "bad_words": bool(req.bad_words),
            "truncate_prompt_tokens": req.truncate_prompt_tokens is not None,
            "min_tokens": req.min_tokens > 0,
        }
        for name, is_set in given.items():
            if is_set:
                raise APIError(f"{name}: not supported with use_beam_search", 400, name)

    async def add_all(
        self,
        request_id: str,
        prompts: list[list[int]],
        params_list: list,
        prompt_param: str,
        grammar_param: str | None = None,
    ) -> list[RequestStream]:
        """Prepare every prompt (tokens, validation, grammar compiled once), then add one engine
        request per prompt. A refusal is a 400 before anything is queued (the engine's "prompt"
        parameter is reported as ``prompt_param``, a grammar that cannot compile as
        ``grammar_param``); a later one aborts those added.

        Raises ``EngineOverloadedError`` (503) before adding anything when the queue is full.
        """
        try:
            prepared = [self.engine.prepare(p, params) for p, params in zip(prompts, params_list)]
            for request in prepared:
                if request.grammar is not None:
                    await asyncio.wrap_future(request.grammar)
        except InvalidArgumentError as exc:
            param = prompt_param if exc.param == "prompt" else exc.param
            if exc.param == "structured_outputs" and grammar_param is not None:
                param = grammar_param
            raise APIError(str(exc), 400, param) from exc
        self.engine.admit(len(prepared))
        streams: list[RequestStream] = []
        try:
            for i, request in enumerate(prepared):
                streams.append(
                    await self.engine.add(
                        f"{request_id}-{i}", request, timeout=self.request_timeout
                    )
                )
        except (InvalidArgumentError, CacheCapacityError) as exc:
            self.abort_all(streams)
            param = getattr(exc, "param", None)
            raise APIError(str(exc), 400, prompt_param if param == "prompt" else param) from exc
        except BaseException:
            self.abort_all(streams)
            raise
        return streams

    def abort_all(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def collect(
        self, raw_request: Request, streams: list[RequestStream]
    ) -> list[RequestOutput]:
        """Final outputs of every stream; aborts all of them if the client disconnects first."""
        watcher = asyncio.create_task(_wait_disconnect(raw_request))
        try:
            finals: list[RequestOutput] = []
            for stream in streams:
                waiter = asyncio.ensure_future(_last(stream))
                done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if waiter not in done:
                    waiter.cancel()
                    logger.info("client disconnected; aborting %s", stream.request_id)
                    raise APIError("client disconnected", 499)
                finals.append(waiter.result())
            return finals
        finally:
            watcher.cancel()
            self.abort_all(streams)

    async def stream(
        self,
        streams: list[RequestStream],
        base: dict,
        events: Callable[[int, RequestOutput], Iterable[dict]],
        stream_options: Any,
        first_chunks: Iterable[dict] = (),
        usage_details: Callable[[Usage], Usage] = lambda usage: usage,
    ) -> AsyncIterator[str]:
        """The SSE lines of a stream: ``first_chunks``, then one chunk per body (``{"choices":
        [...], ...}``) that ``events(position, output)`` gives as outputs come, the usage chunk
        once all finished (``include_usage``; with ``continuous_usage_stats`` too, every chunk
        carries the usage so far, as vLLM: neither without ``include_usage``; ``usage_details``
        completes each usage), and the error tail and ``[DONE]``. However it ends, the streams'
        engine requests end with it."""
        latest: dict[int, RequestOutput] = {}
        include = stream_options is not None and stream_options.include_usage
        continuous = include and stream_options.continuous_usage_stats

        def chunk(body: dict) -> str:
            if not continuous:
                return chunk_event(base, **body)
            usage = usage_of([latest[p] for p in sorted(latest)]) if latest else Usage()
            return chunk_event(base, **body, usage=usage_details(usage).model_dump())

        try:
            for body in first_chunks:
                yield chunk(body)
            async for p, out in merge(streams):
                latest[p] = out
                for body in events(p, out):
                    yield chunk(body)
            if include:
                usage = usage_details(usage_of([latest[p] for p in sorted(latest)]))
                yield chunk_event(base, [], usage=usage.model_dump())
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:
            logger.exception("stream failed")
            yield sse(APIError(str(exc), 500).body())
        finally:
            self.abort_all(streams)
        yield sse("[DONE]")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(
                f"logit_bias: {key!r} is not a token id; the keys are token ids", 400, "logit_bias"
            ) from None
    return out


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return last


async def _wait_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
