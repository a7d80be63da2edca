"""``EngineClient``: everything the protocol fronts (chat and text completions, Responses,
Messages) may ask of an engine. They depend on this protocol only; ``AsyncEngine`` (one engine
thread in this process) and the scale-out ``RemoteEngine`` (engine replicas on Ray Serve)
implement it, as subclasses (``generate`` is written once, here, over ``admit``, ``add`` and
``abort``). What both hand out and raise lives here with the protocol, so neither imports the
other: ``RequestStream``, ``Generation`` and the errors (``EngineDeadError``, ``EngineOverloadedError`` 503,
``RequestTimeoutError`` 408, ``RequestFailedError`` 500).

::

    handler ── prepare(prompt, params) ──> PreparedRequest   (tokenized, validated, grammar submitted;
            │                                                  raises a typed 4xx error)
            ├─ generate(request_id, [prepared]) ──> Generation (admit, then add each prompt;
            │       async for (prompt index, output)         outputs in the params' output kind;
            │       close()                                  aborts what did not finish)
            │   built on the primitives:
            │   admit(count)                                  (503 when the queue is full)
            │   add(request_id, prepared, timeout=) ──> RequestStream of one request's outputs
            │   abort(request_id)                             (client gone, error, timeout)
            └─ release_kv / rename_kv                          (name or end a retention session;
                                                               retention itself rides on the
                                                               request: SamplingParams.kv_retention,
                                                               kv_resume)

Invariants every implementation keeps: ``add`` returns once the engine accepted the request or
raises the error it refused it with; every stream then ends with exactly one terminal item (a
finished output or an exception); ``abort`` of an unknown or finished id does nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.outputs import RequestOutput
from prefixserve.core.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
    from prefixserve.engine.preprocessor import PreparedRequest


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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    @classmethod
    def create(
        cls,
        request_id: str,
        timeout: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> RequestStream:
        """A stream whose ``accepted`` future belongs to the running loop; with ``timeout``
        (seconds from now) it raises ``RequestTimeoutError`` once that passes. ``output_kind``:
        the request's."""
        stream = cls(request_id, asyncio.get_running_loop().create_future())
        stream.output_kind = output_kind
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
            item = self._settle(await self._next())
            if isinstance(item, BaseException):
                raise item
            yield item

    async def get(self, timeout: float | None = None) -> RequestOutput | BaseException | None:
        """The next item as iteration gives it, its error returned rather than raised; None
        after ``timeout`` seconds without one (the item stays queued). Past the deadline, the
        ``RequestTimeoutError`` leaves the stream unfinished, as iteration does: the request is
        still to be aborted."""
        try:
            if timeout is None:
                return self._settle(await self._next())
            return self._settle(await asyncio.wait_for(self._next(), timeout))
        except asyncio.TimeoutError:
            return None
        except RequestTimeoutError as exc:
            return exc

    def get_nowait(self) -> RequestOutput | BaseException | None:
        """``get`` of an item already queued; None when none is."""
        return None if self.queue.empty() else self._settle(self.queue.get_nowait())

    def _settle(self, item: RequestOutput | BaseException) -> RequestOutput | BaseException:
        """An item as it leaves the stream: a finished output carrying an engine error becomes
        ``RequestFailedError``; a finished output or an error ends the stream."""
        if isinstance(item, RequestOutput) and item.finished and item.error is not None:
            item = RequestFailedError(f"the engine failed this request: {item.error}")
        self.finished = isinstance(item, BaseException) or item.finished
        return item

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


class Generation:
    """The engine requests of one API request (one per prompt), read as one stream.

    ``next()`` (or ``async for``) gives ``(prompt index, output)`` as outputs come, in the kind
    the requests asked for (``RequestOutputKind``); several outputs of one request that arrived
    together come as one (DELTA ones added up, ``RequestOutput.add``; of CUMULATIVE ones the
    latest). It ends once every request finished, and raises the first error a request ended
    with. Invariant: whoever holds a Generation closes it (``close``, or leaving ``async with``),
    and closing aborts every request not finished, however the reading ended.
    """

    def __init__(self, engine: EngineClient, streams: list[RequestStream]) -> None:
        self.engine, self.streams = engine, streams
        self._ready: deque[tuple[int, RequestOutput | BaseException]] = deque()
        self._wake = asyncio.Event()
        self._remaining = len(streams)
        self._pumps: list[asyncio.Task] | None = None  # started by the first read
        self._held: list[BaseException] = []  # of one request: its error, read behind an output

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._ready.append((index, out))
                self._wake.set()
        except Exception as exc:  # the request's error, after its outputs
            self._ready.append((index, exc))
            self._wake.set()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        item = await self.next()
        while item is None:
            item = await self.next()
        return item

    async def next(self, timeout: float | None = None) -> tuple[int, RequestOutput] | None:
        """The next output; None after ``timeout`` seconds without one. Raises
        ``StopAsyncIteration`` once every request finished."""
        if self._remaining == 0:
            raise StopAsyncIteration
        if len(self.streams) == 1 and isinstance(self.streams[0], RequestStream):
            return await self._next_of_one(timeout)
        if self._pumps is None:
            self._pumps = [
                asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self.streams)
            ]
        while not self._ready:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        index, item = self._ready.popleft()
        delta = self.streams[index].output_kind is RequestOutputKind.DELTA
        while (
            isinstance(item, RequestOutput)
            and not item.finished
            and self._ready
            and self._ready[0][0] == index
            and isinstance(later := self._ready[0][1], RequestOutput)
        ):
            self._ready.popleft()
            item = item.add(later) if delta else later
        if isinstance(item, BaseException):
            raise item
        self._remaining -= item.finished
        return index, item

    async def _next_of_one(self, timeout: float | None) -> tuple[int, RequestOutput] | None:
        """``next`` of a generation of one request, read from its stream without a pump task:
        one task wake-up per output instead of two (the event loop's hops per streamed token
        are what a step waits for, see ``AsyncEngine``). Outputs already queued behind the
        first are taken with it, as the pumps' ``_ready`` would."""
        stream = self.streams[0]
        item = self._held.pop() if self._held else await stream.get(timeout)
        if item is None:
            return None
        delta = stream.output_kind is RequestOutputKind.DELTA
        while isinstance(item, RequestOutput) and not item.finished:
            later = stream.get_nowait()
            if later is None:
                break
            if isinstance(later, BaseException):
                self._held.append(later)
                break
            item = item.add(later) if delta else later
        if isinstance(item, BaseException):
            raise item
        self._remaining -= item.finished
        return 0, item

    def close(self) -> None:
        """Stop reading and abort every request not finished (idempotent)."""
        for pump in self._pumps or ():
            pump.cancel()
        for stream in self.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Any
    eos_token_ids: frozenset[int]
    dead: BaseException | None  # set once the engine can serve nothing more
    # whether a session can be named or released after its request (across replicas: where the
    # ingress knows the replicas, to ask each of them)
    names_kv_sessions: bool = True

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

    async def generate(
        self,
        request_id: str,
        prompts: list[PreparedRequest],
        *,
        timeout: float | None = None,
        routing_key: str | None = None,
    ) -> Generation:
        """Admit and add one engine request per prompt (``<request_id>-<i>``), all or none: a
        refusal (503, or the error a request was refused with) aborts those added and raises.
        ``timeout`` and ``routing_key``: ``add``'s."""
        self.admit(len(prompts))
        streams: list[RequestStream] = []
        try:
            for i, prepared in enumerate(prompts):
                streams.append(await self.add(f"{request_id}-{i}", prepared, timeout=timeout,
                                              routing_key=routing_key))  # fmt: skip
        except BaseException:
            for stream in streams:
                self.abort(stream.request_id)
            raise
        return Generation(self, streams)

    async def release_kv(self, session: str) -> int:
        """Drop what ``session`` retained; the number of blocks released."""

    async def rename_kv(self, session: str, name: str) -> None:
        """What ``session`` retained is held under ``name`` instead (a reply's provisional
        pause, named after the tool call it made)."""
