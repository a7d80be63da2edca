"""Chat and text completions' server-sent events: one ``chat.completion.chunk`` (or
``text_completion``) per body, usage chunks, the error tail and ``data: [DONE]``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from prefixserve.api.engine_client import RequestStream
from prefixserve.api.frontend.stream import IDLE, drive
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


async def chunk_stream(
    streams: list[RequestStream],
    abort_all: Callable[[list[RequestStream]], None],
    base: dict,
    events: Callable[[int, RequestOutput], Iterable[dict]],
    stream_options: Any,
    first_chunks: Iterable[dict] = (),
    usage_details: Callable[[Usage], Usage] = lambda usage: usage,
) -> AsyncIterator[str]:
    """The SSE lines of a stream: ``first_chunks``, then one chunk per body (``{"choices":
    [...], ...}``) that ``events(position, output)`` gives as outputs come, the usage chunk once
    all finished (``include_usage``; with ``continuous_usage_stats`` too, every chunk carries the
    usage so far, as vLLM: neither without ``include_usage``; ``usage_details`` completes each
    usage), and the error tail and ``[DONE]`` (``stream.drive``)."""
    latest: dict[int, RequestOutput] = {}
    include = stream_options is not None and stream_options.include_usage
    continuous = include and stream_options.continuous_usage_stats

    def usage() -> Usage:
        return usage_details(usage_of([latest[p] for p in sorted(latest)]) if latest else Usage())

    def chunk(body: dict) -> str:
        extra = {"usage": usage().model_dump()} if continuous else {}
        return chunk_event(base, **body, **extra)

    def on_output(p: int, out: RequestOutput | None) -> Iterable[str]:
        if p == IDLE or out is None:
            return
        latest[p] = out
        for body in events(p, out):
            yield chunk(body)
        if include and len(latest) == len(streams) and all(o.finished for o in latest.values()):
            yield chunk_event(base, [], usage=usage().model_dump())

    async for line in drive(streams, abort_all, on_output, lambda exc: [sse(exc.body())],
                            first=(chunk(body) for body in first_chunks)):  # fmt: skip
        yield line
    yield sse("[DONE]")
