"""Chat and text completions' server-sent events: one ``chat.completion.chunk`` (or
``text_completion``) per body, usage chunks, the error tail and ``data: [DONE]`` (``Chunks``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from prefixserve.api.engine_client import Generation
from prefixserve.api.frontend.stream import as_api_error
from prefixserve.api.openai.protocol import PromptTokensDetails, Usage
from prefixserve.core.outputs import RequestOutput


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def chunk_event(base: dict, choices: list[dict], **extra) -> str:
    """One streamed chunk: ``base`` (id, object, model) with a fresh ``created``."""
    return sse({**base, "created": int(time.time()), "choices": choices, **extra})


def usage_of(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    reused = sum(o.num_reused_segment_tokens for o in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=cached, reused_segment_tokens=reused
        ),
    )


class Chunks:
    """The SSE lines of one chat or text completion stream over ``num_prompts`` engine requests:
    chunks (``base``: id, object, model; each with a fresh ``created``), the usage chunk once
    every request finished (``include_usage``; with ``continuous_usage_stats`` every chunk
    carries the usage so far, as vLLM: neither without ``include_usage``; ``usage_details``
    completes each usage), the error tail and ``[DONE]`` (``lines``)."""

    def __init__(self, base: dict, stream_options: Any, num_prompts: int,
                 usage_details: Callable[[Usage], Usage] = lambda usage: usage) -> None:  # fmt: skip
        self.base, self.num_prompts, self.usage_details = base, num_prompts, usage_details
        self.include = stream_options is not None and stream_options.include_usage
        self.continuous = self.include and stream_options.continuous_usage_stats
        self._prompts: dict[int, RequestOutput] = {}  # each request's latest output
        self._completion_tokens = 0
        self._finished: set[int] = set()

    def observe(self, index: int, out: RequestOutput) -> None:
        """Count the DELTA output ``out`` of request ``index``."""
        self._prompts[index] = out
        self._completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if out.finished:
            self._finished.add(index)

    def usage(self) -> Usage:
        prompts = self._prompts.values()
        prompt = sum(len(o.prompt_token_ids) for o in prompts)
        details = PromptTokensDetails(
            cached_tokens=sum(o.num_cached_tokens for o in prompts),
            reused_segment_tokens=sum(o.num_reused_segment_tokens for o in prompts),
        )
        return self.usage_details(Usage(
            prompt_tokens=prompt, completion_tokens=self._completion_tokens,
            total_tokens=prompt + self._completion_tokens, prompt_tokens_details=details,
        ))  # fmt: skip

    def chunk(self, body: dict) -> str:
        """A chunk of ``body`` (``{"choices": [...], ...}``)."""
        extra = {"usage": self.usage().model_dump()} if self.continuous else {}
        return chunk_event(self.base, **body, **extra)

    def final_usage(self) -> str | None:
        """The usage chunk, once every request finished (with ``include_usage``)."""
        if not self.include or len(self._finished) < self.num_prompts:
            return None
        return chunk_event(self.base, [], usage=self.usage().model_dump())

    async def lines(
        self,
        generation: Generation,
        bodies: Callable[[int, RequestOutput], Iterable[dict]],
        first: Iterable[dict] = (),
    ) -> AsyncIterator[str]:
        """The stream: ``first`` bodies, then each output's (``bodies(request index, delta)``)
        as they come, the usage chunk, the error tail on a failure, ``[DONE]``. It holds
        ``generation``: however the stream ends, what did not finish is aborted."""
        async with generation:
            try:
                for body in first:
                    yield self.chunk(body)
                async for index, out in generation:
                    self.observe(index, out)
                    for body in bodies(index, out):
                        yield self.chunk(body)
                    if (usage := self.final_usage()) is not None:
                        yield usage
            except Exception as exc:
                yield sse(as_api_error(exc).body())
        yield sse("[DONE]")
