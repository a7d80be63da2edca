"""POST /v1/completions, and ``BaseServing``: what chat and text completions share.

A request with P prompts and ``n`` choices becomes P engine requests; choice ``p * n + j`` is
sample ``j`` of prompt ``p``. Outputs are cumulative, so a stream's delta is the new suffix of a
choice's text and token ids since the last event. Every engine request this handler added is
aborted when the handler ends before it finished (client gone, error, timeout, cancellation).
A request is admitted whole or refused whole (503 when the waiting queue is full).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from prefixserve.api.async_engine import AsyncEngine, RequestStream
from prefixserve.api.protocol import (
    APIError,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
    random_id,
)

from prefixserve.errors import CacheCapacityError, InvalidArgumentError
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


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


class BaseServing:
    """What both endpoints share: model check, parameters, admission, collection of outputs.

    ``request_timeout`` (seconds) bounds each request's time in the engine; ``require_cache_salt``
    refuses requests without a ``cache_salt`` (every tenant must name its cache namespace).
    """

    def __init__(
        self,
        engine: AsyncEngine,
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

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def make_params(self, req, max_tokens: int | None, logprobs: int | None, num_prompt: int):
        """Engine parameters; raises a 400 when the prompt plus max_tokens exceed the context."""
        if self.require_cache_salt and not req.cache_salt:
            raise APIError(
                "cache_salt: this server requires a non-empty 'cache_salt' on every request "
                "(it isolates your prefix cache from other tenants); add one",
                400,
                "cache_salt",
            )
        limit = self.engine.max_model_len
        if num_prompt >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {num_prompt} input tokens. Please reduce the length of the "
                "input.",
                400,
                "messages" if hasattr(req, "messages") else "prompt",
            )
        if max_tokens is None:
            max_tokens = limit - num_prompt
        elif isinstance(max_tokens, int) and max_tokens >= 1 and num_prompt + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the input, "
                f"{max_tokens} in the completion). Please reduce the length of the input "
                "or completion.",
                400,
                "max_tokens",
            )
        try:
            if req.use_beam_search:
                return BeamSearchParams(
                    beam_width=req.n,
                    max_tokens=max_tokens,
                    length_penalty=req.length_penalty,
                    ignore_eos=req.ignore_eos,
                    cache_salt=req.cache_salt,
                    stop_token_ids=list(req.stop_token_ids or []),
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
            )
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, exc.param) from exc

    async def add_all(
        self, request_id: str, prompts: list[list[int]], params_list: list
    ) -> list[RequestStream]:
        """Add one engine request per prompt; on any refusal abort those added and raise a 400.

        Raises ``EngineOverloadedError`` (503) before adding anything when the queue is full.
        """
        self.engine.admit(len(prompts))
        streams: list[RequestStream] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                streams.append(
                    await self.engine.add(
                        f"{request_id}-{i}", prompt, params, timeout=self.request_timeout
                    )
                )
        except (InvalidArgumentError, CacheCapacityError) as exc:
            self.abort_all(streams)
            raise APIError(str(exc), 400, getattr(exc, "param", None)) from exc
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


def completion_logprobs(
    serving: BaseServing, entries: list[dict[int, float]], token_ids: list[int], offset: int
) -> dict:
    tokens = [serving.token_text(t) for t in token_ids]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.get(t) for e, t in zip(entries, token_ids)],
        "top_logprobs": [{serving.token_text(k): v for k, v in e.items()} for e in entries],
        "text_offset": offsets,
    }


class CompletionServing(BaseServing):
    async def create(self, req: CompletionRequest, raw_request: Request):
        model = self.check_model(req.model)
        prompts = await asyncio.to_thread(self._prompt_ids, req.prompt)
        params = [self.make_params(req, req.max_tokens, req.logprobs, len(p)) for p in prompts]
        request_id = random_id("cmpl-")
        streams = await self.add_all(request_id, prompts, params)
        if req.stream:
            return self._stream(req, request_id, model, prompts, streams)
        finals = await self.collect(raw_request, streams)
        choices = []
        for p, final in enumerate(finals):
            for c in final.outputs:
                text = (self._echo(prompts[p]) if req.echo else "") + c.text
                lps = (
                    completion_logprobs(self, c.logprobs, c.token_ids, 0)
                    if c.logprobs is not None
                    else None
                )
                choices.append(
                    CompletionChoice(
                        index=p * req.n + c.index,
                        text=text,
                        logprobs=lps,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage_of(finals)
        )

    def _prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt or any(not p for p in prompt):
            raise APIError("prompt: must not be empty (nor hold an empty prompt)", 400, "prompt")
        tok = self.engine.tokenizer
        return [tok.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    def _echo(self, prompt_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(prompt_ids, skip_special_tokens=True)

    async def _stream(self, req, request_id, model, prompts, streams) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "text_completion", "model": model}
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        beam = req.use_beam_search
        try:
            async for p, out in merge(streams):
                if out.finished:
                    finals[p] = out
                elif beam:
                    continue
                for c in out.outputs:
                    index = p * req.n + c.index
                    if index in sent_text and sent_text[index] < 0:
                        continue
                    start, tstart = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    delta = c.text[start:]
                    if index not in sent_text and req.echo:
                        delta = self._echo(prompts[p]) + delta
                    new_ids = c.token_ids[tstart:]
                    if not delta and not new_ids and c.finish_reason is None:
                        continue
                    lps = (
                        completion_logprobs(self, c.logprobs[tstart:], new_ids, start)
                        if c.logprobs is not None
                        else None
                    )
                    sent_text[index] = -1 if c.finish_reason else len(c.text)
                    sent_tokens[index] = len(c.token_ids)
                    choice = {
                        "index": index,
                        "text": delta,
                        "logprobs": lps,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    yield sse({**base, "created": _now(), "choices": [choice]})
            if req.stream_options and req.stream_options.include_usage:
                usage = usage_of([finals[i] for i in sorted(finals)]).model_dump()
                yield sse({**base, "created": _now(), "choices": [], "usage": usage})
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:
            logger.exception("completion stream failed")
            yield sse(APIError(str(exc), 500).body())
        finally:
            self.abort_all(streams)
        yield sse("[DONE]")


def _now() -> int:
    return int(time.time())
