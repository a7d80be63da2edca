"""The front end's retention decisions (``api/frontend/tool_call_retention.py`` and
``api/openai/prompt_cache.py``), against a recording engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.frontend.tenancy import Tenant
from prefixserve.api.frontend.tool_call_retention import ToolCallRetention, session_of
from prefixserve.api.openai.prompt_cache import DAY_S, retention_of
from prefixserve.api.parsing.reply import Finish, TextDelta, ToolCallDelta, first_call
from prefixserve.core.sampling_params import SamplingParams


class RecordingEngine:
    names_kv_sessions = True

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def rename_kv(self, session, name):
        self.calls.append(("rename", session, name))

    async def release_kv(self, session):
        self.calls.append(("release", session))
        return 0


TENANT = Tenant("team-a", isolated=True)
SALT = TENANT.cache_salt("s")  # what the engine's parameters carry


def inputs(r: ToolCallRetention) -> SimpleNamespace:
    pause = r.pause("chatcmpl-1", TENANT, "s")
    return SimpleNamespace(params=SamplingParams(cache_salt=SALT, kv_retention=pause))


def run(retention: ToolCallRetention, *steps) -> None:
    async def main():
        for step in steps:
            step()
        await asyncio.sleep(0)  # the spawned calls run
        await asyncio.sleep(0)

    asyncio.run(main())


def test_a_request_offered_tools_carries_a_provisional_pause_of_its_tenant():
    (pause,) = ToolCallRetention(RecordingEngine()).pause("chatcmpl-1", TENANT, "s")
    assert pause.ttl_s is None and pause.include_output  # the learned TTL, prompt and reply
    assert pause.session == session_of(SALT, "~chatcmpl-1") and pause.tenant == "team-a"


def test_a_reply_that_stopped_on_a_call_names_its_pause_after_the_call():
    engine = RecordingEngine()
    r = ToolCallRetention(engine)
    run(r, lambda: r.paused(inputs(r), "stop", "call_1"))
    assert engine.calls == [("rename", f"{SALT}/~chatcmpl-1", f"{SALT}/call_1")]


@pytest.mark.parametrize("call_id, reason", [(None, "stop"), ("c", "length"), ("c", "abort")])
def test_a_reply_without_a_finished_call_releases_its_pause(call_id, reason):
    engine = RecordingEngine()
    r = ToolCallRetention(engine)
    run(r, lambda: r.paused(inputs(r), reason, call_id))
    assert engine.calls == [("release", f"{SALT}/~chatcmpl-1")]


def test_off_or_across_replicas_nothing_is_carried_or_called():
    off = ToolCallRetention(RecordingEngine(), enabled=False)
    replicas = RecordingEngine()
    replicas.names_kv_sessions = False
    for r in (off, ToolCallRetention(replicas)):
        assert r.pause("x", TENANT, "s") == () and r.resumes(TENANT, "s", ["a"]) == ()
        run(r, lambda r=r: r.paused(inputs(r), "stop", "call_1"))
    assert off.engine.calls == [] and replicas.calls == []


def test_results_name_the_sessions_they_resume_once_each():
    r = ToolCallRetention(RecordingEngine())
    assert r.resumes(Tenant(), None, ["a", "b", "a", None]) == ("/a", "/b")
    assert r.resumes(TENANT, "s", ["a"]) == (f"{SALT}/a",)


def test_first_call_of_parts():
    parts = [TextDelta("x"), ToolCallDelta(0, "{}", "c1", "f", True),
             ToolCallDelta(1, "{}", "c2", "g", True), Finish("stop")]  # fmt: skip
    assert first_call(parts) == "c1" and first_call(parts[:1]) is None


def test_prompt_cache_retention_values():
    assert retention_of(None, "n/r") == () and retention_of("in_memory", "n/r") == ()
    (day,) = retention_of("24h", "n/r")
    assert (day.ttl_s, day.write_through, day.include_output, day.session) == (
        DAY_S, True, True, "n/r")  # fmt: skip
    with pytest.raises(APIError) as info:
        retention_of("7d", "n/r")
    assert info.value.status == 400 and info.value.param == "prompt_cache_retention"
