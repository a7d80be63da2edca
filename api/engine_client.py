"""``EngineClient``: everything the protocol fronts (chat and text completions, Responses,
Messages) may ask of an engine. They depend on this protocol only; ``AsyncEngine`` (one engine
thread in this process) and the scale-out ``RemoteEngine`` (engine replicas on Ray Serve)
implement it. What both hand out and raise lives here with the protocol, so neither imports the
other: ``RequestStream`` and the errors (``EngineDeadError``, ``EngineOverloadedError`` 503,
``RequestTimeoutError`` 408, ``RequestFailedError`` 500).

::

    handler ── prepare(prompt, params) ──> PreparedRequest   (tokenized, validated, grammar submitted;
            │                                                  raises a typed 4xx error)
            ├─ admit(count)                                    (503 when the queue is full)
            ├─ add(request_id, prepared, timeout=) ──> RequestStream of cumulative RequestOutputs
            ├─ abort(request_id)                               (client gone, error, timeout)
            └─ retain_kv / release_kv / resume_kv              (retention outside a request)

Invariants every implementation keeps: ``add`` returns once the engine accepted the request or
raises the error it refused it with; every stream then ends with exactly one terminal item (a
finished output or an exception); ``abort`` of an unknown or finished id does nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.outputs import RequestOutput

if TYPE_CHECKING:
    from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
    from prefixserve.engine.preprocessor import PreparedRequest
    from prefixserve.kv.retention import KVRetention


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; no request can be served any more."""


RETRY_AFTER_SECONDS = 1


class EngineOverloadedError(APIError):
    """The waiting queue is full: a 503 with ``Retry-After``; nothing of the request was queued."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @classmethod
    def check(cls, queued: int, count: int, limit: int | None, waiting: str) -> None:
        """Raise if ``count`` more requests would take the ``queued`` ones past ``limit`` (None:
        no limit); ``waiting`` says what they wait for, in the message."""
        if limit is not None and queued + count > limit:
            raise cls(
                f"the server is overloaded: {queued} requests {waiting} (limit {limit}); retry "
                f"after {RETRY_AFTER_SECONDS} s"
            )


class RequestTimeoutError(APIError):
    """The request ran past ``--request-timeout``; the engine aborted it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 408, err_type="timeout_error")


class RequestFailedError(APIError):
    """The engine failed this one request (its output carried ``error``); others keep running."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 500, err_type="internal_error")


@dataclass
class RequestStream:
    """Outputs of one request, in order; the last item is a finished output or an exception.

    Iteration raises ``RequestTimeoutError`` once ``deadline`` (``time.monotonic()``) passes and
    ``RequestFailedError`` for a finished output that carries an engine error.
    """

    request_id: str
    accepted: asyncio.Future
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    deadline: float | None = None
    timeout: float | None = None

    @classmethod
    def create(cls, request_id: str, timeout: float | None = None) -> RequestStream:
        """A stream whose ``accepted`` future belongs to the running loop; with ``timeout``
        (seconds from now) it raises ``RequestTimeoutError`` once that passes."""
        stream = cls(request_id, asyncio.get_running_loop().create_future())
        if timeout is not None:
            stream.deadline, stream.timeout = time.monotonic() + timeout, timeout
        return stream

    def settle_accepted(self, error: BaseException | None) -> None:
        """Resolve ``accepted``: the engine took the request (``error`` None) or refused it with
        ``error``. Only the first call counts; later ones are ignored."""
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._next()
            while not self.queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                item = self.queue.get_nowait()  # outputs are cumulative: skip to the latest
            if isinstance(item, RequestOutput) and item.finished and item.error is not None:
                item = RequestFailedError(f"the engine failed this request: {item.error}")
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    async def _next(self) -> RequestOutput | BaseException:
        if self.deadline is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), self.deadline - time.monotonic())
        except asyncio.TimeoutError:
            raise RequestTimeoutError(
                f"the request ran longer than the server's request timeout ({self.timeout:g} s) "
                "and was aborted; ask for fewer tokens (max_tokens, n) or retry later"
            ) from None


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Any
    eos_token_ids: frozenset[int]
    dead: BaseException | None  # set once the engine can serve nothing more

    def start(self) -> None:
        """Begin serving (called on the event loop, in the app's lifespan)."""

    def stop(self) -> None:
        """Stop serving; live requests end with an error (may be called off the loop)."""

    def prepare(
        self, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> PreparedRequest:
        """Tokenize and validate one request; raises a typed error naming the field."""

    def admit(self, count: int) -> None:
        """Raise ``EngineOverloadedError`` (503) if ``count`` more requests would overfill the
        queue."""

    async def add(
        self,
        request_id: str,
        prompt: PreparedRequest,
        *,
        timeout: float | None = None,
        routing_key: str | None = None,
    ) -> RequestStream:
        """Queue a prepared request; its stream once accepted (``timeout``: seconds it may
        take in all, then a 408; ``routing_key``: an affinity hint for the replica router,
        OpenAI's ``prompt_cache_key``)."""

    def abort(self, request_id: str) -> None:
        """End a request now; its blocks are freed."""

    def fail_all(self, error: BaseException) -> None:
        """End every live request with ``error`` (the end of a shutdown drain)."""

    async def retain_kv(
        self, token_ids: list[int], retention: KVRetention, cache_salt: str | None
    ) -> int:
        """Retain the cached blocks of ``token_ids`` outside a request (a reply that ended in a
        tool call); the number of blocks retained."""

    async def release_kv(self, session: str) -> int:
        """Drop what ``session`` retained; the number of blocks released."""

    async def resume_kv(self, sessions: list[str]) -> int:
        """The sessions' next turn arrived: their pauses end (a TTL sample each) and their
        retention is dropped; the number of blocks released."""
