"""Anthropic ``cache_control`` (``api/anthropic/cache_control.py``): which breakpoints a request
has, where each ends, what it retains, and the usage split by TTL."""

from __future__ import annotations

import pytest

from prefixserve.api.anthropic.cache_control import (
    MAX_BREAKPOINTS,
    breakpoints,
    common_prefix,
    retentions,
    split_usage,
)
from prefixserve.api.anthropic.protocol import CountTokensRequest
from prefixserve.api.frontend.protocol import APIError

EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
TOOL = {"name": "ls", "input_schema": {"type": "object"}}


def request(**fields) -> CountTokensRequest:
    return CountTokensRequest(model="m", **{"messages": [{"role": "user", "content": "hi"}],
                                            **fields})  # fmt: skip


CONTENT = [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": HOUR},
           {"type": "text", "text": "c"}]  # fmt: skip


def test_breakpoints_in_prompt_order_with_their_cuts():
    req = request(
        tools=[TOOL, {**TOOL, "name": "cat", "cache_control": HOUR}],
        system=[{"type": "text", "text": "be brief", "cache_control": EPHEMERAL}],
        messages=[{"role": "user", "content": CONTENT}],
    )
    tool, system, message = breakpoints(req, drop_attribution=True)
    assert tool.ttl_s == 3600 and [t["function"]["name"] for t in tool.tools] == ["ls", "cat"]
    assert tool.messages == [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}]
    assert system.ttl_s == 300 and len(system.tools) == 2
    assert message.ttl_s == 3600
    assert message.messages[-1] == {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }


def test_a_tool_breakpoint_keeps_only_the_tools_up_to_it():
    req = request(tools=[{**TOOL, "cache_control": EPHEMERAL}, {**TOOL, "name": "cat"}])
    (mark,) = breakpoints(req, drop_attribution=True)
    assert [t["function"]["name"] for t in mark.tools] == ["ls"] and mark.messages == []


def test_no_breakpoints_without_cache_control():
    assert breakpoints(request(system="s", tools=[TOOL]), drop_attribution=True) == []


BAD_MARKS = [({"type": "persistent"}, "ephemeral"), ({"type": "ephemeral", "ttl": "2h"}, "ttl"),
             ("ephemeral", "ephemeral")]  # fmt: skip


@pytest.mark.parametrize("mark, needle", BAD_MARKS)
def test_a_malformed_mark_is_a_400_naming_it(mark, needle):
    req = request(system=[{"type": "text", "text": "s", "cache_control": mark}])
    with pytest.raises(APIError) as info:
        breakpoints(req, drop_attribution=True)
    assert info.value.status == 400 and "system[0].cache_control" in info.value.message
    assert needle in info.value.message


def test_more_than_four_breakpoints_is_a_400():
    blocks = [{"type": "text", "text": str(i), "cache_control": EPHEMERAL}
              for i in range(MAX_BREAKPOINTS + 1)]  # fmt: skip
    with pytest.raises(APIError, match="at most 4"):
        breakpoints(request(system=blocks), drop_attribution=True)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_retentions_skip_marks_that_cover_nothing():
    (r,) = retentions(((0, 300.0), (40, 3600.0)), "tenant")
    assert (r.ttl_s, r.num_tokens, r.session, r.include_output) == (3600.0, 40, "tenant", False)


def _split(num_prompt, num_read, marks, block_size=16, retained=None):
    """``split_usage``, every mark granted in full unless ``retained`` says otherwise."""
    if retained is None:
        retained = [min(p, num_prompt) // block_size * block_size for p, _ in marks if p > 0]
    u = split_usage(num_prompt, num_read, marks, block_size, retained=retained)
    assert (u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
            == num_prompt)  # fmt: skip
    c = u.cache_creation
    assert c.ephemeral_5m_input_tokens + c.ephemeral_1h_input_tokens == (
        u.cache_creation_input_tokens
    )
    return (u.input_tokens, c.ephemeral_5m_input_tokens, c.ephemeral_1h_input_tokens,
            u.cache_read_input_tokens)  # fmt: skip


def test_usage_without_marks_counts_every_written_full_block():
    assert _split(100, 0, []) == (4, 96, 0, 0)
    assert _split(100, 32, []) == (4, 64, 0, 32)
    assert _split(100, 0, [], block_size=None) == (100, 0, 0, 0)


def test_usage_splits_writes_by_the_longest_ttl_at_or_after_them():
    # 1h mark at 40 (written to 32), 5m mark at 90 (written to 80): [0, 32) 1h, [32, 80) 5m
    assert _split(100, 0, [(40, 3600.0), (90, 300.0)]) == (20, 48, 32, 0)
    # a 1h mark after a 5m one covers everything before it
    assert _split(100, 0, [(40, 300.0), (90, 3600.0)]) == (20, 0, 80, 0)
    # what was read is not written again
    assert _split(100, 48, [(40, 3600.0), (90, 300.0)]) == (20, 32, 0, 48)
    # read past the last mark: nothing written, the rest is input
    assert _split(100, 96, [(40, 3600.0)]) == (4, 0, 0, 96)


def test_usage_counts_only_what_the_engine_retained():
    # the 1h mark's retention was refused: what it marked is plain input, never 1h
    assert _split(100, 0, [(40, 3600.0)], retained=[0]) == (100, 0, 0, 0)
    assert _split(100, 0, [(40, 3600.0)], retained=[None]) == (100, 0, 0, 0)  # not applied
    # granted in part: 16 of the 32 marked tokens
    assert _split(100, 0, [(40, 3600.0)], retained=[16]) == (84, 0, 16, 0)
    # a refused 1h mark after a granted 5m one: its tokens count under the 5m mark alone
    assert _split(100, 0, [(40, 300.0), (90, 3600.0)], retained=[32, 0]) == (68, 32, 0, 0)
    # a mark at position 0 made no retention: the entries belong to the marks after it
    assert _split(100, 0, [(0, 300.0), (40, 3600.0)], retained=[32]) == (68, 0, 32, 0)
    assert _split(100, 0, [(40, 3600.0)], retained=()) == (100, 0, 0, 0)
