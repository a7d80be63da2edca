"""POST /v1/completions.

A request with P prompts and ``n`` choices becomes P engine requests; choice ``p * n + j`` is
sample ``j`` of prompt ``p``. With ``echo`` the prompt's text comes first in each choice, and with
``logprobs`` too, the prompt tokens' logprobs come first in ``logprobs`` (``None`` for the first
token), as evaluation harnesses read them. ``prompt_logprobs`` gives vLLM's per-token dicts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

from fastapi import Request

from prefixserve.api.engine_client import Generation
from prefixserve.api.frontend.protocol import APIError, random_id
from prefixserve.api.frontend.serving import BaseServing
from prefixserve.api.frontend.stream import ChoiceTotals, event_stream
from prefixserve.api.frontend.structured_outputs import structured_outputs_of
from prefixserve.api.frontend.tenancy import tenant_of
from prefixserve.api.openai.chunks import Chunks, usage_of
from prefixserve.api.openai.field_support import check_supported
from prefixserve.api.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from prefixserve.core.outputs import CompletionOutput, RequestOutput


class CompletionServing(BaseServing):
    async def create(self, req: CompletionRequest, raw_request: Request):
        model = self.check_model(req.model)
        check_supported(req, "completions")
        prompts = await asyncio.to_thread(self._prompt_ids, req.prompt, req.add_special_tokens)
        structured, source = structured_outputs_of(req)
        params = [
            self.make_params(
                req.sampling_options(),
                req.max_tokens,
                req.logprobs,
                structured,
                _prompt_k(req),
                tenant_of(raw_request),
            )
            for _ in prompts
        ]
        request_id = random_id("cmpl-")
        generation = await self.generate(request_id, prompts, params, "prompt", source,
                                         stream=req.stream)  # fmt: skip
        with self.owned(generation):
            if req.stream:
                return event_stream(self._stream(req, request_id, model, generation))
        finals = await self.collect(raw_request, generation)
        choices = [self._choice(req, p * req.n, final, c) for p, final in enumerate(finals)
                   for c in final.outputs]  # fmt: skip
        return CompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage_of(finals)
        )

    def _prompt_ids(self, prompt, add_special_tokens: bool) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt or any(not p for p in prompt):
            raise APIError("prompt: must not be empty (nor hold an empty prompt)", 400, "prompt")
        tok = self.engine.tokenizer
        return [
            tok.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else list(p)
            for p in prompt
        ]

    def _echo(self, final: RequestOutput) -> str:
        return self.engine.tokenizer.decode(final.prompt_token_ids, skip_special_tokens=True)

    def _choice(
        self, req: CompletionRequest, first: int, final: RequestOutput, c: CompletionOutput
    ) -> CompletionChoice:
        echo = self._echo(final) if req.echo else ""
        return CompletionChoice(
            index=first + c.index,
            text=echo + c.text,
            logprobs=self._choice_logprobs(req, final, c.logprobs, c.token_ids, len(echo), True),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            **self._extras(req, final, c.token_ids, True),
        )

    def _extras(
        self, req: CompletionRequest, final: RequestOutput, token_ids: list[int], first: bool
    ) -> dict:
        """``prompt_logprobs``, ``prompt_token_ids`` (first event of a choice) and
        ``token_ids`` when asked for."""
        extras: dict = {}
        if req.prompt_logprobs is not None and first and final.prompt_logprobs is not None:
            extras["prompt_logprobs"] = self.prompt_logprobs(
                final.prompt_logprobs, req.prompt_logprobs, _prompt_k(req),
                req.return_tokens_as_token_ids,
            )  # fmt: skip
        if req.return_token_ids:
            extras["token_ids"] = token_ids
            if first:
                extras["prompt_token_ids"] = final.prompt_token_ids
        return extras

    def _choice_logprobs(
        self,
        req: CompletionRequest,
        final: RequestOutput,
        entries: list[dict[int, float]] | None,
        token_ids: list[int],
        offset: int,
        with_prompt: bool,
    ) -> dict | None:
        """OpenAI's completion ``logprobs`` of ``token_ids`` (whose text starts at ``offset``),
        preceded, with ``echo``, by the prompt's (``with_prompt``: this event carries the echo)."""
        if req.logprobs is None or entries is None:
            return None
        as_ids = req.return_tokens_as_token_ids
        lps = self._logprobs(entries, token_ids, offset, req.logprobs, as_ids)
        if not (req.echo and with_prompt) or final.prompt_logprobs is None:
            return lps
        prompt = self._logprobs(
            final.prompt_logprobs, final.prompt_token_ids, 0, req.logprobs, as_ids
        )
        return {key: prompt[key] + lps[key] for key in lps}

    def _logprobs(
        self,
        entries: list[dict[int, float] | None],
        token_ids: list[int],
        offset: int,
        k: int,
        as_ids: bool,
    ) -> dict:
        """``tokens``, ``token_logprobs``, ``top_logprobs`` (the token and the k most likely)
        and ``text_offset``; a None entry (the prompt's first token) gives None."""
        tokens = [self.token_text(t, as_ids) for t in token_ids]
        offsets, pos = [], offset
        for text in tokens:
            offsets.append(pos)
            pos += len(text)
        top = []
        for entry, token in zip(entries, token_ids):
            if entry is None:
                top.append(None)
                continue
            best = sorted(entry, key=entry.__getitem__, reverse=True)[:k]
            top.append(
                {self.token_text(t, as_ids): entry[t] for t in dict.fromkeys([token, *best])}
            )
        chosen = [e.get(t) if e is not None else None for e, t in zip(entries, token_ids)]
        return {
            "tokens": tokens,
            "token_logprobs": chosen,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _stream(self, req: CompletionRequest, request_id: str, model: str,
                generation: Generation) -> AsyncIterator[str]:  # fmt: skip
        base = {"id": request_id, "object": "text_completion", "model": model}
        chunks = Chunks(base, req.stream_options, len(generation.streams))
        return chunks.lines(generation, self._choice_events(req))

    def _choice_events(self, req: CompletionRequest):
        """The chunk bodies of each DELTA output of prompt ``p``: choice ``p * n + index``, its
        first chunk after the echo of the prompt (``echo``)."""
        totals = ChoiceTotals()
        echoes: dict[int, str] = {}  # per prompt: its text, decoded once

        def events(p: int, out: RequestOutput) -> Iterator[dict]:
            if req.echo and p not in echoes:
                echoes[p] = self._echo(out)
            for c in out.outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                index = p * req.n + c.index
                text_offset, first = totals.add(index, c)
                echo = echoes.get(p, "")
                offset = text_offset + len(echo)
                echo = echo if first else ""
                lps = self._choice_logprobs(req, out, c.logprobs, c.token_ids, offset, first)
                choice = {
                    "index": index,
                    "text": echo + c.text,
                    "logprobs": lps,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **self._extras(req, out, c.token_ids, first),
                }
                yield {"choices": [choice]}

        return events


def _prompt_k(req: CompletionRequest) -> int | None:
    """How many top tokens the engine scores per prompt position: ``prompt_logprobs``, and with
    ``echo`` the ``logprobs`` of the echoed prompt; None when neither asks."""
    wanted = [req.prompt_logprobs] + ([req.logprobs] if req.echo else [])
    wanted = [k for k in wanted if k is not None]
    return max(wanted) if wanted else None
