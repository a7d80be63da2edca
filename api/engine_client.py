"""``EngineClient``: everything the protocol fronts (chat and text completions, Responses,
Messages) may ask of an engine. They depend on this protocol only; ``AsyncEngine`` (one engine
thread in this process) and the scale-out ``RemoteEngine`` (engine replicas on Ray Serve)
implement it.

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

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prefixserve.api.async_engine import RequestStream
    from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
    from prefixserve.engine.preprocessor import PreparedRequest
    from prefixserve.kv.retention import KVRetention


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
        self, request_id: str, prompt: PreparedRequest, *, timeout: float | None = None,
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
