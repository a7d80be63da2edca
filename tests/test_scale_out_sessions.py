"""Retention sessions across replicas, without Ray: the router pins a ``SessionCall`` to its
replica (``ReportingRouter.pinned``), and ``RemoteEngine`` sends one to every running replica,
sums what they released and survives one that does not answer. The live cluster's path is in
``tests/test_scale_out_ray.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import NamedTuple

import pytest
from aio import run

from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.sampling_params import SamplingParams
from prefixserve.engine.preprocessor import StepLimits
from prefixserve.scale_out import remote_engine
from prefixserve.scale_out.protocol import EngineRequest, SessionCall
from prefixserve.scale_out.remote_engine import EngineInfo, RemoteEngine
from prefixserve.scale_out.reporting_router import ReportingRouter


class ReplicaID(NamedTuple):
    unique_id: str


def replica(unique_id: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(unique_id))


def pending(arg) -> SimpleNamespace:
    return SimpleNamespace(args=[arg])


class Router(ReportingRouter):
    def __init__(self, running: list[str]) -> None:
        self.curr_replicas = {replica(r).replica_id: None for r in running}


def test_a_session_call_goes_to_its_replica_only():
    a, b = replica("a"), replica("b")
    router = Router(["a", "b"])
    assert router.pinned([a, b], pending(SessionCall("b", "release", "s"))) == [[b]]
    assert router.pinned([a, b], pending(SessionCall("a", "rename", "s", "t"))) == [[a]]


def test_a_busy_replica_is_waited_for_and_a_gone_one_is_anyone():
    a, b = replica("a"), replica("b")
    # "b" runs but is not a candidate now (at its request limit): Serve asks again
    assert Router(["a", "b"]).pinned([a], pending(SessionCall("b", "release", "s"))) == []
    # "c" left the deployment: its sessions went with it, the call is a no-op anywhere
    assert Router(["a", "b"]).pinned([a, b], pending(SessionCall("c", "release", "s"))) == [[a, b]]


def test_other_requests_are_not_pinned():
    router = Router(["a"])
    request = EngineRequest("r", [1, 2, 3], SamplingParams())
    assert router.pinned([replica("a")], pending(request)) is None
    assert router.pinned([replica("a")], SimpleNamespace(args=[])) is None
    assert router.pinned([replica("a")], None) is None


class Response:
    """A Serve ``DeploymentResponse`` stand-in: awaitable once, cancellable."""

    def __init__(self, answer) -> None:
        self.answer, self.cancelled = answer, False

    def __await__(self):
        return self._result().__await__()

    async def _result(self):
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "hang":
            await asyncio.sleep(3600)
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """A deployment handle whose ``kv_session`` answers ``answers[replica]``."""

    def __init__(self, answers: dict) -> None:
        self.answers, self.calls, self.responses = answers, [], []

    def options(self, method_name: str, stream: bool = False):
        return SimpleNamespace(remote=lambda call: self._remote(method_name, call))

    def _remote(self, method_name: str, call: SessionCall) -> Response:
        assert method_name == "kv_session"
        self.calls.append(call)
        self.responses.append(Response(self.answers[call.replica]))
        return self.responses[-1]


INFO = EngineInfo("m", 64, 10, frozenset(), 16, StepLimits(8, 64, True))


def engine(handle: Handle, replica_ids=None) -> RemoteEngine:
    return RemoteEngine(handle, tokenizer=None, info=INFO, replica_ids=replica_ids)


@run
async def test_release_goes_to_every_replica_and_sums_what_they_released():
    handle = Handle({"a": 3, "b": 0, "c": 5})
    remote = engine(handle, lambda: ["a", "b", "c"])
    assert remote.names_kv_sessions
    assert await remote.release_kv("tenant/s") == 8
    assert {(c.replica, c.op, c.session) for c in handle.calls} == {
        ("a", "release", "tenant/s"),
        ("b", "release", "tenant/s"),
        ("c", "release", "tenant/s"),
    }


@run
async def test_rename_goes_to_every_replica_with_the_new_name():
    handle = Handle({"a": 0, "b": 0})
    await engine(handle, lambda: ["a", "b"]).rename_kv("salt/~req-1", "salt/call-1")
    assert sorted((c.replica, c.op, c.name) for c in handle.calls) == [
        ("a", "rename", "salt/call-1"),
        ("b", "rename", "salt/call-1"),
    ]


@run
async def test_a_replica_that_fails_or_does_not_answer_counts_nothing(monkeypatch):
    monkeypatch.setattr(remote_engine, "SESSION_CALL_TIMEOUT_S", 0.05)
    handle = Handle({"a": 2, "dead": RuntimeError("actor died"), "stuck": "hang"})
    assert await engine(handle, lambda: ["a", "dead", "stuck"]).release_kv("s") == 2
    stuck = [r for c, r in zip(handle.calls, handle.responses) if c.replica == "stuck"]
    assert stuck[0].cancelled


@run
async def test_without_the_replicas_ids_sessions_cannot_be_named():
    remote = engine(Handle({}))
    assert not remote.names_kv_sessions
    with pytest.raises(APIError) as exc:
        await remote.release_kv("s")
    assert exc.value.status == 501
