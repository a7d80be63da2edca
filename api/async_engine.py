"""Runs an ``LLMEngine`` in one background thread and serves it to asyncio handlers.

Threads and ownership::

    event loop (handlers)                       engine thread (sole owner of the LLMEngine)
    prepare() (tokenize, validate, grammar submitted: the engine's thread-safe preprocessor)
    add()   --> _pending adds  ------------->   engine.add_request  -> accepted | error
    abort() --> _pending aborts ------------>   engine.abort_request (between steps)
    release_kv() / rename_kv()                  engine.release_kv / ... (between steps, before
            --> _pending calls ------------->   the adds; the caller awaits the result)
    RequestStream.queue  <-- call_soon_threadsafe --  engine.step() outputs, one batch per step
    snapshot() <------------- the engine's latest ``EngineStats``, published every step

The server builds the engine on the engine thread itself (``AsyncEngine.launch``): loading,
compiling and every step then run on one thread, whose OpenMP team is the process's only one.
With a second team (the loading thread's, idle), libgomp counts more threads than cores and
throttles its spin-waits, and every parallel region of a step sleeps and wakes: a SmolLM2 decode
step took 75 ms instead of 45.

Invariants: only the engine thread touches the engine; handlers never block on it (they await
their stream's queue); every stream receives exactly one terminal item (a finished output, an
error, or the engine's death). If the loop raises, ``dead`` holds the error, every live stream is
failed, and ``on_death`` is called so the server can stop and exit non-zero.

A step that raises (``StepFailedError``) fails the requests it scheduled, each with a 500; the
engine rolled it back, so nothing it registered stays cached, and the loop keeps serving.

Admission and failures: ``admit(count)`` refuses (``EngineOverloadedError``) once the adds not yet
applied plus the engine's waiting queue would pass ``max_waiting``; once added, a request is never
dropped. A finished output carrying ``error`` (the engine failed that one request) ends its stream
with a 500 ``internal_error``; a stream past its deadline ends with a 408 and its request is
aborted; ``fail_all`` aborts every live request with one error (the end of a shutdown drain).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from prefixserve.api.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from prefixserve.core.errors import StepFailedError
from prefixserve.core.outputs import RequestOutput
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.engine.llm_engine import EngineStats, LLMEngine
from prefixserve.engine.output_processor import ProgressObserver
from prefixserve.engine.preprocessor import PreparedRequest

logger = logging.getLogger(__name__)


class AsyncEngine(EngineClient):
    """Owner of the engine thread. ``observer(progress, now)`` (``OutputProcessor.observer``:
    every touched request's progress, each step) runs on that thread;
    ``on_death(exc)`` runs on the event loop once the engine loop died."""

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.eos_token_ids = engine.eos_token_ids
        config = engine.config  # the prefix cache's block size; None when it is off
        self.prefix_cache_block_size = config.block_size if config.enable_prefix_caching else None
        self.on_death = on_death
        self.dead: BaseException | None = None
        self._cond = threading.Condition()
        self._adds: list[
            tuple[
                RequestStream,
                PreparedRequest | str | list[int],
                SamplingParams | BeamSearchParams | None,
            ]
        ] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[LLMEngine], Any], Future]] = []
        self._fail_all: BaseException | None = None
        self._num_waiting = 0
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._go = threading.Event()  # ``launch``ed: the thread waits for ``start`` (or ``stop``)
        self._snapshot = engine.stats()

    @classmethod
    def launch(cls, build: Callable[[], LLMEngine], **kwargs) -> AsyncEngine:
        """An ``AsyncEngine`` whose ``LLMEngine`` is ``build()``-t on the engine thread, which
        then waits for ``start`` and runs the loop (see the module docstring for why). Returns
        once the engine is built; raises what ``build`` raised."""
        built: Future[AsyncEngine] = Future()

        def engine_thread() -> None:
            try:
                engine = cls(build(), **kwargs)
            except BaseException as exc:
                built.set_exception(exc)
                return
            engine._thread = threading.current_thread()
            built.set_result(engine)
            engine._go.wait()
            engine._run()

        threading.Thread(target=engine_thread, name="prefixserve-engine", daemon=True).start()
        return built.result()

    @property
    def observer(self) -> ProgressObserver | None:
        """Set before ``start``: the engine's ``OutputProcessor.observer``."""
        return self.engine.output_processor.observer

    @observer.setter
    def observer(self, observer: ProgressObserver | None) -> None:
        self.engine.output_processor.observer = observer

    # ---- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._thread is None:  # built elsewhere: the loop gets a thread of its own
            self._thread = threading.Thread(
                target=self._run, name="prefixserve-engine", daemon=True
            )
            self._thread.start()
        self._go.set()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._go.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._cond:
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(EngineDeadError("the engine stopped"))
        self.engine.shutdown()

    def admit(self, count: int) -> None:
        """Raise ``EngineOverloadedError`` if ``count`` more requests would overfill the queue."""
        if self.max_waiting is None:
            return
        with self._cond:
            queued = len(self._adds) + self._num_waiting
        EngineOverloadedError.check(queued, count, self.max_waiting, "are waiting")

    def prepare(
        self, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> PreparedRequest:
        """Tokenize and validate a request on the caller's thread, submitting its grammar (the
        engine's ``RequestPreprocessor`` is thread-safe); raises its typed error."""
        return self.engine.preprocessor.process(prompt, params)

    async def add(
        self,
        request_id: str,
        prompt: PreparedRequest | str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
        timeout: float | None = None,
        routing_key: str | None = None,
    ) -> RequestStream:
        """Queue a request (prepared, or a prompt with its ``params``); returns its stream once
        the engine accepted it, else raises its error. ``routing_key`` matters only where there
        are replicas to choose from (``RemoteEngine``).

        With ``timeout`` (seconds from now) the stream raises ``RequestTimeoutError`` past it.
        """
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead!r}")
        asked = prompt.params if isinstance(prompt, PreparedRequest) else params or SamplingParams()
        stream = RequestStream.create(request_id, timeout, asked.output_kind)
        with self._cond:
            self._adds.append((stream, prompt, params))
            self._cond.notify()
        try:
            await stream.accepted  # raises the engine's typed error if add_request refused it
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort; applied before its next step. Unknown ids are ignored."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    async def release_kv(self, session: str) -> int:
        """``LLMEngine.release_kv`` between steps."""
        return await self._call(lambda e: e.release_kv(session))

    async def rename_kv(self, session: str, name: str) -> None:
        """``LLMEngine.rename_kv`` between steps."""
        await self._call(lambda e: e.rename_kv(session, name))

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead!r}")
        future: Future = Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def fail_all(self, error: BaseException) -> None:
        """Abort every live request; each of their streams ends with ``error``."""
        with self._cond:
            self._fail_all = error
            self._cond.notify()

    def snapshot(self) -> EngineStats:
        """The engine's figures as of its last step; the KV tiers' as of now (their worker
        goes on storing while the engine idles, and ``KVTierManager.stats`` is thread-safe)."""
        with self._cond:
            snapshot = self._snapshot
        tiers = self.engine.kv_tiers
        return snapshot if tiers is None else replace(snapshot, kv_tiers=tiers.stats())

    # ---- engine-thread side ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._adds
                        or self._aborts
                        or self._calls
                        or self._fail_all is not None
                        or self._stopping
                        or self.engine.has_unfinished_requests()
                    ):
                        self._cond.wait()
                    if self._stopping:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                    fail_all, self._fail_all = self._fail_all, None
                for fn, future in calls:
                    _settle(future, fn, self.engine)
                for stream, prompt, params in adds:
                    self._add(stream, prompt, params)
                if fail_all is not None:
                    self._abort_streams(fail_all)
                self._count_waiting()
                finals = [o for o in map(self.engine.abort_request, aborts) if o is not None]
                outputs = self._step() if self.engine.has_unfinished_requests() else []
                self._publish(finals + outputs)
                self._count_waiting()
        except BaseException as exc:
            logger.exception("engine loop died")
            self._die(exc)

    def _step(self) -> list[RequestOutput]:
        """One engine step. A step that failed was rolled back by the engine; its requests are
        failed here (their streams end with a 500) rather than retried, so that a request that
        breaks the forward cannot break it again, and the loop goes on serving the others."""
        try:
            return self.engine.step()
        except StepFailedError as exc:
            logger.exception("engine step failed; failing its %d requests", len(exc.request_ids))
            failed = (self.engine.abort_request(rid, str(exc)) for rid in exc.request_ids)
            return exc.outputs + [o for o in failed if o is not None]

    def _add(self, stream: RequestStream, prompt, params) -> None:
        try:
            self.engine.add_request(stream.request_id, prompt, params)
        except Exception as exc:
            self._loop.call_soon_threadsafe(stream.settle_accepted, exc)
            return
        self._streams[stream.request_id] = stream
        self._loop.call_soon_threadsafe(stream.settle_accepted, None)

    def _count_waiting(self) -> None:
        num_waiting = self.engine.stats().num_waiting
        with self._cond:
            self._num_waiting = num_waiting

    def _abort_streams(self, error: BaseException) -> None:
        streams = list(self._streams.values())
        for stream in streams:
            self.engine.abort_request(stream.request_id)
        self._streams.clear()
        self._loop.call_soon_threadsafe(_deliver, [(s, error) for s in streams])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                self._streams.pop(output.request_id, None)
            deliveries.append((stream, output))
        snapshot = self.engine.stats()
        with self._cond:
            self._snapshot = snapshot
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _die(self, exc: BaseException) -> None:
        self.dead = exc
        error = EngineDeadError(f"the engine loop died: {exc!r}")
        streams = list(self._streams.values())
        self._streams.clear()
        with self._cond:
            pending = [s for s, _, _ in self._adds]
            self._adds.clear()
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(error)
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(_deliver, [(s, error) for s in streams])
        for stream in pending:
            self._loop.call_soon_threadsafe(stream.settle_accepted, error)
        if self.on_death is not None:
            self._loop.call_soon_threadsafe(self.on_death, exc)


def _settle(future: Future, fn: Callable[[LLMEngine], Any], engine: LLMEngine) -> None:
    """Run one call on the engine thread; its result or error goes to the awaiting handler."""
    try:
        future.set_result(fn(engine))
    except Exception as exc:
        future.set_exception(exc)


def _deliver(deliveries: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in deliveries:
        stream.queue.put_nowait(item)
