"""``RemoteEngine``: the ``AsyncEngine`` interface the HTTP handlers use, served by the engine
replicas of a Ray Serve deployment instead of one engine thread.

::

    handler ── add(id, token ids, params) ──▶ pump task ── handle.generate(EngineRequest) ──▶ router
       ▲                                          │          ──▶ replica: AsyncEngine.add, stream
       └── RequestStream.queue ◀── RequestOutput ─┘ ◀── ACCEPTED, RequestOutput, ... (finished)
    abort(id) / fail_all(error) ──▶ cancel the pump ──▶ Serve cancels the replica's generator,
                                                       whose ``finally`` aborts the engine request

Invariants: ``add`` returns once a replica's engine accepted the request, or raises the error it
refused it with (a typed 4xx, as ``AsyncEngine.add``); every stream then gets exactly one terminal
item. A replica that fails before the request produced any output (it died, restarted, or could
not be reached) is invisible to the client: the request is sent again, and the router, told of
the death, picks another replica. After the first output it cannot be resumed: the stream ends
with a 503 ``APIError`` (an OpenAI-shaped error event), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prefixserve.api.engine_client import (
    RETRY_AFTER_SECONDS,
    EngineClient,
    EngineOverloadedError,
    RequestStream,
)
from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.outputs import RequestOutput
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.engine.preprocessor import PreparedRequest, RequestPreprocessor, StepLimits
from prefixserve.scale_out.protocol import ACCEPTED, EngineRequest, SessionCall

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 4
SESSION_CALL_TIMEOUT_S = 10.0
_RETRY_BACKOFF_S = 0.2


@dataclass(frozen=True)
class EngineInfo:
    """What the ingress needs to know of the replicas' engine (``EngineReplica.describe``)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    block_size: int
    limits: StepLimits


class ReplicaFailedError(APIError):
    """The replica serving a request failed after it had started answering."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class RemoteEngine(EngineClient):
    """Stands in for ``AsyncEngine`` in ``build_app``: same methods, same stream type.

    ``handle`` is the engine deployment's handle; ``tokenizer`` the ingress's own (it tokenizes
    and renders chat templates once, so the router and the engine hash the same tokens).
    ``max_waiting`` bounds the requests sent but not yet accepted by any replica.
    ``replica_ids`` lists the running replicas (the ingress's router view): retention sessions
    are named and released on each of them; without it, they cannot be (a 501).
    """

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        info: EngineInfo,
        max_waiting: int | None = None,
        max_attempts: int = MAX_ATTEMPTS,
        replica_ids: Callable[[], list[str]] | None = None,
    ) -> None:
        self._generate = handle.options(method_name="generate", stream=True)
        self._kv_session = handle.options(method_name="kv_session")
        self._replica_ids = replica_ids
        self.tokenizer = tokenizer
        self.info = info
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.eos_token_ids = info.eos_token_ids
        self.prefix_cache_block_size = info.block_size  # replicas route by their prefix caches
        self.max_waiting = max_waiting
        self.max_attempts = max_attempts
        self.dead: BaseException | None = None
        self._live: dict[str, tuple[asyncio.Task, RequestStream]] = {}
        self._num_accepting = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._preprocessor: RequestPreprocessor | None = None  # built on first use

    # ---- the AsyncEngine interface ------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def stop(self) -> None:
        """End every request in flight with a 503 (thread-safe: the lifespan calls it off-loop)."""
        if self._loop is not None and not self._loop.is_closed():
            error = APIError("the server shut down before this request finished; retry it", 503)
            self._loop.call_soon_threadsafe(self.fail_all, error)
        if self._preprocessor is not None:
            self._preprocessor.structured_outputs.shutdown()

    def admit(self, count: int) -> None:
        EngineOverloadedError.check(
            self._num_accepting, count, self.max_waiting, "wait for a replica"
        )

    def prepare(
        self, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> PreparedRequest:
        """Prepare at the door, against the replicas' limits: the ingress tokenizes and truncates
        once, refuses bad input with a 400 before any replica sees it, and compiles the grammar
        (into its own cache) to refuse a bad one. The replica prepares the ids it gets again,
        which truncates nothing more and compiles the grammar into the replica's cache."""
        return self._get_preprocessor().process(prompt, params)

    def _get_preprocessor(self) -> RequestPreprocessor:
        if self._preprocessor is None:
            from prefixserve.structured_outputs.manager import StructuredOutputManager

            info = self.info
            grammars = StructuredOutputManager(
                self.tokenizer, info.vocab_size, sorted(info.eos_token_ids)
            )
            self._preprocessor = RequestPreprocessor(
                self.tokenizer, info.vocab_size, info.max_model_len, info.limits, grammars
            )
        return self._preprocessor

    async def add(
        self,
        request_id: str,
        prompt: PreparedRequest | str | Sequence[int],
        params: SamplingParams | BeamSearchParams | None = None,
        timeout: float | None = None,
        routing_key: str | None = None,
    ) -> RequestStream:
        prepared = prompt if isinstance(prompt, PreparedRequest) else self.prepare(prompt, params)
        stream = RequestStream.create(request_id, timeout, prepared.params.output_kind)
        request = EngineRequest(request_id, list(prepared.prompt_token_ids), prepared.params,
                                routing_key)  # fmt: skip
        pump = asyncio.create_task(self._pump(request, stream))
        self._live[request_id] = (pump, stream)
        pump.add_done_callback(lambda _: self._live.pop(request_id, None))
        self._num_accepting += 1
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        finally:
            self._num_accepting -= 1
        return stream

    def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live[0].cancel()

    def fail_all(self, error: BaseException) -> None:
        for pump, stream in list(self._live.values()):
            pump.cancel()
            self._fail(stream, error)

    # ---- retention sessions ---------------------------------------------------------------------
    # A request's own retention (cache_control, prompt_cache_retention, the tool-call pause,
    # kv_resume) travels in its params to the replica that serves it. Naming or releasing a
    # session later goes to every running replica (``SessionCall``, pinned by the router): the
    # one that holds it acts, the others hold no such session and do nothing.

    @property
    def names_kv_sessions(self) -> bool:
        return self._replica_ids is not None

    async def release_kv(self, session: str) -> int:
        return sum(await self._on_every_replica("release", session))

    async def rename_kv(self, session: str, name: str) -> None:
        await self._on_every_replica("rename", session, name)

    async def _on_every_replica(self, op: str, session: str, name: str | None = None) -> list[int]:
        """What each running replica answered a ``SessionCall``; a replica that did not answer
        within ``SESSION_CALL_TIMEOUT_S`` (it died or restarted) answers nothing: the sessions
        it held went with it, or run out their TTL."""
        if self._replica_ids is None:
            raise APIError("naming or releasing retained KV needs the replicas' ids", 501)

        from prefixserve.scale_out.ray_private import own_request_id  # Ray: only when called

        async def call(replica: str) -> int:
            with own_request_id():  # each call its own id, or Serve may swap their replicas
                response = self._kv_session.remote(SessionCall(replica, op, session, name))
            try:
                return await asyncio.wait_for(_awaited(response), SESSION_CALL_TIMEOUT_S)
            except Exception as exc:  # the replica, or the way to it, failed
                response.cancel()
                logger.warning("%s of KV session %r on replica %s failed: %s", op, session,
                               replica, _short(exc))  # fmt: skip
                return 0

        return list(await asyncio.gather(*(call(r) for r in self._replica_ids())))

    # ---- one request ---------------------------------------------------------------------------

    async def _pump(self, request: EngineRequest, stream: RequestStream) -> None:
        """Send the request (again, while nothing reached the client) and feed its stream."""
        delivered = False
        for attempt in range(1, self.max_attempts + 1):
            # a fresh engine id per attempt: a replica that only seemed gone may still hold one
            sent = (
                request
                if attempt == 1
                else replace(request, request_id=f"{request.request_id}~{attempt}")
            )
            responses = self._generate.remote(sent)
            try:
                async for item in responses:
                    if isinstance(item, BaseException):  # the engine refused or failed it
                        self._fail(stream, item)
                        return
                    if item == ACCEPTED:
                        stream.settle_accepted(None)
                        continue
                    delivered = True
                    stream.queue.put_nowait(self._restore(item, request))
                    if item.finished:
                        return
                raise RuntimeError("the replica ended the stream before the request finished")
            except asyncio.CancelledError:
                responses.cancel()
                raise
            except Exception as exc:  # the replica or the way to it failed
                if not delivered and attempt < self.max_attempts:
                    logger.warning(
                        "request %s: replica failed before answering (%s); sending it again",
                        request.request_id, _short(exc),
                    )  # fmt: skip
                    await asyncio.sleep(_RETRY_BACKOFF_S * attempt)
                    continue
                self._fail(stream, self._failure(exc, delivered))
                return

    @staticmethod
    def _restore(output: RequestOutput, request: EngineRequest) -> RequestOutput:
        if not output.prompt_token_ids:  # the ids sent: the replica leaves them out
            output.prompt_token_ids = request.prompt_token_ids
        return output

    @staticmethod
    def _failure(exc: BaseException, delivered: bool) -> APIError:
        when = "while streaming" if delivered else "before answering"
        return ReplicaFailedError(
            f"the engine replica serving this request failed {when} ({_short(exc)}); "
            "retry the request"
        )

    @staticmethod
    def _fail(stream: RequestStream, error: BaseException) -> None:
        if stream.accepted.done():
            stream.queue.put_nowait(error)
        else:
            stream.settle_accepted(error)


async def _awaited(response: Any) -> Any:
    """A Serve ``DeploymentResponse`` as a coroutine (what ``asyncio.wait_for`` takes)."""
    return await response


def _short(exc: BaseException) -> str:
    """A one-line description of a Ray error (their messages carry whole tracebacks)."""
    cause = getattr(exc, "cause", None)
    first = str(cause if cause is not None else exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0][:200]}" if first else type(exc).__name__
