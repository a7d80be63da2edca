"""The one stream driver of every protocol: merge a request's engine streams, turn each output
into the protocol's events, end with the protocol's error tail, and let go of the engine.

::

    drive(streams, abort_all, events, error_events, idle_s=, first_idle_s=, first=)
      first                                   what the stream opens with
      merge(streams) -> (position, cumulative output) as they come
        -> events(position, output)           the encoder's events for it
        -> events(IDLE, None)                 after each idle_s of silence (first_idle_s first)
      an exception -> error_events(APIError)   once; anything but an APIError is a logged 500
      finally -> abort_all(streams)            finished, failed, or the client went away

Outputs are cumulative, so an encoder reads what a choice gained with ``DeltaTracker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from fastapi.responses import StreamingResponse

from prefixserve.api.engine_client import RequestStream
from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE = -1
"""The position ``events`` gets (with no output) after a period of silence."""


def event_stream(events: AsyncIterator[str], headers: dict[str, str] | None = None
                 ) -> StreamingResponse:  # fmt: skip
    """Server-sent events as the HTTP response."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **(headers or {})})  # fmt: skip


def as_api_error(exc: Exception) -> APIError:
    """``exc`` as the error a stream reports: itself, or a 500 (logged: a bug or an engine
    failure, not the client's doing)."""
    if isinstance(exc, APIError):
        return exc
    logger.exception("stream failed", exc_info=exc)
    return APIError(str(exc), 500)


async def drive(
    streams: list[RequestStream],
    abort_all: Callable[[list[RequestStream]], None],
    events: Callable[[int, RequestOutput | None], Iterable[T]],
    error_events: Callable[[APIError], Iterable[T]],
    idle_s: float | None = None,
    first_idle_s: float | None = None,
    first: Iterable[T] = (),
) -> AsyncIterator[T]:
    """The events of a request's streams (see the module doc)."""
    outputs = merge(streams)
    pending: asyncio.Future | None = None
    wait = first_idle_s
    try:
        for event in first:
            yield event
        while True:
            pending = pending or asyncio.ensure_future(anext(outputs, None))
            done, _ = await asyncio.wait({pending}, timeout=wait)
            wait = idle_s
            if not done:
                for event in events(IDLE, None):
                    yield event
                continue
            item, pending = pending.result(), None
            if item is None:
                return
            for event in events(*item):
                yield event
    except Exception as exc:
        for event in error_events(as_api_error(exc)):
            yield event
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
        await outputs.aclose()
        abort_all(streams)


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
