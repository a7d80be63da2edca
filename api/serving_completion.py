"""POST /v1/completions.

A request with P prompts and ``n`` choices becomes P engine requests; choice ``p * n + j`` is
sample ``j`` of prompt ``p``. With ``echo`` the prompt's text comes first in each choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from fastapi import Request
from prefixserve.api.protocol import (
    APIError,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from prefixserve.api.serving_base import BaseServing, DeltaTracker, chunk_event, usage_of
from prefixserve.api.structured_outputs import structured_outputs_of

from prefixserve.outputs import RequestOutput


class CompletionServing(BaseServing):
    async def create(self, req: CompletionRequest, raw_request: Request):
        model = self.check_model(req.model)
        prompts = await asyncio.to_thread(self._prompt_ids, req.prompt)
        structured, source = structured_outputs_of(req)
        if structured is not None:
            await self.check_grammar(structured, source)
        params = [self.make_params(req, req.max_tokens, req.logprobs, structured) for _ in prompts]
        request_id = random_id("cmpl-")
        streams = await self.add_all(request_id, prompts, params, "prompt")
        if req.stream:
            return self._stream(req, request_id, model, prompts, streams)
        finals = await self.collect(raw_request, streams)
        choices = []
        for p, final in enumerate(finals):
            for c in final.outputs:
                text = (self._echo(prompts[p]) if req.echo else "") + c.text
                lps = self._logprobs(c.logprobs, c.token_ids, 0) if c.logprobs is not None else None
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

    def _logprobs(self, entries: list[dict[int, float]], token_ids: list[int], offset: int) -> dict:
        """OpenAI's completion logprobs of ``token_ids``, whose text starts at ``offset``."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets, pos = [], offset
        for text in tokens:
            offsets.append(pos)
            pos += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.get(t) for e, t in zip(entries, token_ids)],
            "top_logprobs": [{self.token_text(k): v for k, v in e.items()} for e in entries],
            "text_offset": offsets,
        }

    def _stream(self, req, request_id, model, prompts, streams):
        base = {"id": request_id, "object": "text_completion", "model": model}
        tracker = DeltaTracker()

        def events(p: int, out: RequestOutput) -> Iterator[str]:
            if req.use_beam_search and not out.finished:
                return
            for c in out.outputs:
                d = tracker.delta(p * req.n + c.index, c, c.text)
                if d is None:
                    continue
                text = (self._echo(prompts[p]) if d.first and req.echo else "") + d.text
                lps = (
                    self._logprobs(d.logprobs, d.token_ids, d.text_offset)
                    if d.logprobs is not None
                    else None
                )
                choice = {
                    "index": d.index,
                    "text": text,
                    "logprobs": lps,
                    "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                }
                yield chunk_event(base, [choice])

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return self.stream(streams, base, events, include_usage)
