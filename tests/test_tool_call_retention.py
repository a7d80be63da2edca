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
from prefixserve.core.outputs import CompletionOutput
from prefixserve.core.sampling_params import SamplingParams


class RecordingEngine:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def retain_kv(self, token_ids, retention, cache_salt):
        self.calls.append(("retain", token_ids, retention, cache_salt))
        return 1

    async def resume_kv(self, sessions):
        self.calls.append(("resume", sessions))
        return 0


def inputs(salt: str | None = "s") -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=[1, 2, 3], params=SamplingParams(cache_salt=salt),
                           tenant=Tenant("team-a", isolated=True))  # fmt: skip


def output(finish_reason: str = "stop") -> CompletionOutput:
    return CompletionOutput(index=0, text="", token_ids=[7, 8], cumulative_logprob=None,
                            logprobs=None, finish_reason=finish_reason)  # fmt: skip


def run(retention: ToolCallRetention, *steps) -> None:
    async def main():
        for step in steps:
            step()
        await asyncio.sleep(0)  # the spawned calls run
        await asyncio.sleep(0)

    asyncio.run(main())


def test_a_call_at_the_end_of_a_reply_retains_prompt_and_reply_under_its_session():
    engine = RecordingEngine()
    r = ToolCallRetention(engine)
    c = output()
    run(r, lambda: r.paused(inputs(), c.token_ids, c.finish_reason, "call_1"))
    ((kind, ids, retention, salt),) = engine.calls
    assert (kind, ids, salt) == ("retain", [1, 2, 3, 7, 8], "s")
    assert retention.ttl_s is None and retention.session == session_of("s", "call_1") == "s/call_1"
    assert retention.tenant == "team-a"  # its share of the retention budget


@pytest.mark.parametrize("call_id, reason, enabled", [(None, "stop", True),
                                                      ("c", "length", True),
                                                      ("c", "abort", True),
                                                      ("c", "stop", False)])  # fmt: skip
def test_nothing_is_retained_without_a_finished_call_or_when_off(call_id, reason, enabled):
    engine = RecordingEngine()
    r = ToolCallRetention(engine, enabled)
    c = output(reason)
    run(r, lambda: r.paused(inputs(), c.token_ids, c.finish_reason, call_id))
    assert engine.calls == []


def test_results_resume_their_sessions_once_each():
    engine = RecordingEngine()
    r = ToolCallRetention(engine)
    run(r, lambda: r.resumed(inputs(None), ["a", "b", "a", None]),
        lambda: r.resumed(inputs(), []))  # fmt: skip
    assert engine.calls == [("resume", ["/a", "/b"])]


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
