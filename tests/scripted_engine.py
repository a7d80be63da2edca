"""An ``EngineClient`` whose replies are scripted text, for testing the protocol fronts over HTTP
with exact model output (a random-weight model never writes a given tool call).

``ScriptedEngine(tokenizer, replies)``: each added request takes the next reply, a list of text
pieces streamed as outputs of the request's kind (the last one finishes with ``finish_reason``, "stop" by
default, "length" when the reply is given as ``Reply(pieces, "length")``); it records every
prompt and its parameters (``requests``); with ``overloaded`` every request is refused with a
503. ``scripted_client(engine, **config)`` serves the real
app (``build_app``) on it in process and yields an ``httpx.Client``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient

from prefixserve.api.engine_client import EngineClient, EngineOverloadedError, RequestStream
from prefixserve.api.server import ServerConfig, build_app
from prefixserve.core.outputs import CompletionOutput, RequestOutput
from prefixserve.core.sampling_params import RequestOutputKind
from prefixserve.models.builtin import builtin_tokenizer


@dataclass
class Reply:
    pieces: list[str]
    finish_reason: str = "stop"
    stop_reason: str | int | None = None


@dataclass
class ScriptedEngine(EngineClient):
    tokenizer: Any = field(default_factory=builtin_tokenizer)
    replies: list[Reply | list[str]] = field(default_factory=list)
    model_name: str = "scripted"
    max_model_len: int = 4096
    prefix_cache_block_size: int | None = 16
    dead: BaseException | None = None
    requests: list[tuple[list[int], Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    overloaded: bool = False  # admit refuses with a 503
    released: list[str] = field(default_factory=list)  # retention sessions released
    renamed: list[tuple[str, str]] = field(default_factory=list)  # (session, its new name)
    routing_keys: list[str | None] = field(default_factory=list)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.tokenizer.eos_token_id})

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def prepare(self, prompt: list[int], params: Any) -> SimpleNamespace:
        return SimpleNamespace(prompt_token_ids=list(prompt), params=params, grammar=None)

    def admit(self, count: int) -> None:
        if self.overloaded:
            raise EngineOverloadedError("the queue is full")

    async def release_kv(self, session: str) -> int:
        self.released.append(session)
        return 0

    async def rename_kv(self, session: str, name: str) -> None:
        self.renamed.append((session, name))

    async def add(self, request_id: str, prepared: Any, *, timeout: float | None = None,
                  routing_key: str | None = None):  # fmt: skip
        self.requests.append((prepared.prompt_token_ids, prepared.params))
        self.routing_keys.append(routing_key)
        reply = self.replies.pop(0) if self.replies else Reply(["ok"])
        reply = reply if isinstance(reply, Reply) else Reply(reply)
        kind = prepared.params.output_kind
        stream = RequestStream.create(request_id, output_kind=kind)
        stream.settle_accepted(None)
        text, sent, prompt = "", (0, 0), prepared.prompt_token_ids
        for i, piece in enumerate(reply.pieces):
            text += piece
            last = i == len(reply.pieces) - 1
            if kind is RequestOutputKind.FINAL_ONLY and not last:
                continue
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            new_text, new_ids = text, ids
            if kind is RequestOutputKind.DELTA:
                new_text, new_ids, sent = text[sent[0] :], ids[sent[1] :], (len(text), len(ids))
            c = CompletionOutput(0, new_text, new_ids,
                                 finish_reason=reply.finish_reason if last else None,
                                 stop_reason=reply.stop_reason if last else None)  # fmt: skip
            stream.queue.put_nowait(RequestOutput(request_id, None, prompt, [c], last))
        await asyncio.sleep(0)
        return stream

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def fail_all(self, error: BaseException) -> None:
        pass


@contextmanager
def scripted_client(engine: ScriptedEngine, **config: Any) -> Iterator[TestClient]:
    app = build_app(engine, ServerConfig(served_model_names=["m"], **config))
    with TestClient(app) as client:
        yield client
