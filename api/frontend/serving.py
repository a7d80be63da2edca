"""What every protocol front shares below its wire format: model check, engine parameters,
admission, and collecting a non-streamed reply.

A request becomes one or more engine requests (one per prompt), admitted whole or refused whole
(503 when the waiting queue is full): one ``Generation``. Every check a client can fail runs
before ``generate``; every engine request a handler added is aborted when the handler ends before
it finished (client gone, error, timeout, cancellation): the handler closes the generation on any
exception until the reply takes it over (``collect``, or a stream encoder's ``async with``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from fastapi import Request

from prefixserve.api.engine_client import EngineClient, Generation
from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.frontend.request import SamplingOptions
from prefixserve.api.frontend.tenancy import NO_TENANT, Tenant
from prefixserve.core.errors import CacheCapacityError, InvalidArgumentError
from prefixserve.core.outputs import RequestOutput
from prefixserve.core.sampling_params import BeamSearchParams, RequestOutputKind
from prefixserve.kv.retention import KVRetention
from prefixserve.structured_outputs.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class BaseServing:
    """What every endpoint shares. ``request_timeout`` (seconds) bounds each request's time in
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
        options: SamplingOptions,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
        tenant: Tenant = NO_TENANT,
        kv_retention: tuple[KVRetention, ...] = (),
        kv_resume: tuple[str, ...] = (),
    ):
        """Engine parameters of a request's sampling ``options`` (the engine checks them
        against the context and the vocabulary); its cache salt is the ``tenant``'s
        (``frontend.tenancy``); ``kv_retention``: the prompt KV it keeps (not with beam
        search); ``kv_resume``: the retention sessions it continues."""
        req = options.params
        if self.require_cache_salt and not req.cache_salt:
            raise APIError(
                "cache_salt: this server requires a non-empty 'cache_salt' on every request "
                "(it isolates your prefix cache from other tenants); add one",
                400,
                "cache_salt",
            )
        cache_salt = tenant.cache_salt(req.cache_salt)
        try:
            if options.use_beam_search:
                self._check_beam_search(options, logprobs, prompt_logprobs)
                if kv_retention:
                    raise APIError("prompt_cache_retention: not supported with use_beam_search",
                                   400, "prompt_cache_retention")  # fmt: skip
                return BeamSearchParams(
                    beam_width=req.n,
                    max_tokens=max_tokens,
                    length_penalty=options.length_penalty,
                    ignore_eos=req.ignore_eos,
                    cache_salt=cache_salt,
                    stop_token_ids=req.stop_token_ids,
                    structured_outputs=structured_outputs,
                    stop=req.stop,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    skip_special_tokens=req.skip_special_tokens,
                )
            return dataclasses.replace(
                req,
                max_tokens=max_tokens,
                logprobs=logprobs,
                structured_outputs=structured_outputs,
                prompt_logprobs=prompt_logprobs,
                cache_salt=cache_salt,
                kv_retention=kv_retention,
                kv_resume=kv_resume,
            )
        except InvalidArgumentError as exc:
            raise APIError(str(exc), 400, exc.param) from exc

    @staticmethod
    def _check_beam_search(
        options: SamplingOptions, logprobs: int | None, prompt_logprobs: int | None
    ) -> None:
        """Beam search scores with the raw model: options it would not honour are refused
        (sampling controls at values other than their neutral ones included; ``seed`` is
        accepted, the search being deterministic)."""
        req = options.params
        given = {
            "temperature": "temperature" in options.given and req.temperature != 0,
            "top_p": req.top_p != 1,
            "top_k": req.top_k != 0,
            "min_p": req.min_p != 0,
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

    async def generate(
        self,
        request_id: str,
        prompts: list[list[int]],
        params_list: list,
        prompt_param: str,
        grammar_param: str | None = None,
        routing_key: str | None = None,
        stream: bool = False,
    ) -> Generation:
        """Prepare every prompt (tokens, validation, grammar compiled once), then add one engine
        request per prompt (``EngineClient.generate``), whose outputs are deltas when ``stream``,
        else the final one only. A refusal is a 400 before anything is queued (the engine's
        "prompt" parameter is reported as ``prompt_param``, a grammar that cannot compile as
        ``grammar_param``); a later one aborts those added. ``routing_key``:
        ``EngineClient.add``.

        Raises ``EngineOverloadedError`` (503) before adding anything when the queue is full.
        """
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        for params in params_list:
            params.output_kind = kind
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
        try:
            return await self.engine.generate(
                request_id, prepared, timeout=self.request_timeout, routing_key=routing_key
            )
        except (InvalidArgumentError, CacheCapacityError) as exc:
            param = getattr(exc, "param", None)
            raise APIError(str(exc), 400, prompt_param if param == "prompt" else param) from exc

    @staticmethod
    @contextlib.contextmanager
    def owned(generation: Generation) -> Iterator[None]:
        """Close ``generation`` if the block raises: what runs after ``generate`` until the
        reply (``collect`` or a stream encoder, which close it in their turn) owns it."""
        try:
            yield
        except BaseException:
            generation.close()
            raise

    async def collect(self, raw_request: Request, generation: Generation) -> list[RequestOutput]:
        """Each prompt's whole final output (deltas added up); closes ``generation``, so every
        request is aborted if the client disconnects first (a 499)."""
        finals: dict[int, RequestOutput] = {}

        async def read() -> None:
            async for index, out in generation:
                finals[index] = finals[index].add(out) if index in finals else out

        watcher = asyncio.create_task(_wait_disconnect(raw_request))
        reader = asyncio.ensure_future(read())
        try:
            done, _ = await asyncio.wait({reader, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if reader not in done:
                logger.info("client disconnected; aborting %s", request_ids(generation))
                raise APIError("client disconnected", 499)
            reader.result()
            return [finals[i] for i in sorted(finals)]
        finally:
            reader.cancel()
            watcher.cancel()
            generation.close()


def request_ids(generation: Generation) -> str:
    return ", ".join(s.request_id for s in generation.streams)


async def _wait_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
