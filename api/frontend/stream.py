"""What every protocol's stream encoder shares. An encoder pulls its request's deltas and writes
its protocol's events::

    async with generation:                      closing aborts what did not finish: the client
        try:                                    went away, an error, or the end
            async for index, out in generation:     DELTA outputs: what each choice gained
                ... the protocol's events
        except Exception as exc:
            ... the protocol's error tail for as_api_error(exc)

``ChoiceTotals`` keeps what a choice's deltas added up to, for what needs the whole (text
offsets, the reply's token ids).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.outputs import CompletionOutput

logger = logging.getLogger(__name__)


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


class ChoiceTotals:
    """Per choice key, what its deltas added up to: the length of its text and its token ids.

    Invariant: after ``add`` of every delta of a choice, ``token_ids(key)`` is the choice's whole
    output and the offsets returned are where each delta's text starts in the whole text.
    """

    def __init__(self) -> None:
        self._chars: dict[int, int] = {}
        self._token_ids: dict[int, list[int]] = {}

    def add(self, key: int, delta: CompletionOutput) -> tuple[int, bool]:
        """Count ``delta`` into choice ``key``: where its text starts in the choice's text, and
        whether it is the choice's first."""
        first = key not in self._chars
        offset = self._chars.get(key, 0)
        self._chars[key] = offset + len(delta.text)
        self._token_ids.setdefault(key, []).extend(delta.token_ids)
        return offset, first

    def token_ids(self, key: int) -> list[int]:
        return self._token_ids.get(key, [])

    def num_tokens(self) -> int:
        """Every choice's tokens so far."""
        return sum(len(ids) for ids in self._token_ids.values())
