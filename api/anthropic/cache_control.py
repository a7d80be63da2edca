"""Anthropic's ``cache_control`` breakpoints: the prefixes a request retains, and its usage.

A breakpoint is ``{"type": "ephemeral"}`` (TTL 5 minutes) or ``{"type": "ephemeral", "ttl": "5m" |
"1h"}`` on a tool, a system block or a content block of a message, at most ``MAX_BREAKPOINTS`` a
request. It marks the prompt up to and including its block, in Anthropic's order (tools, system,
messages)::

    cut(breakpoint)   the conversation cut after its block: a tool's keeps the tools up to it and
                      the system prompt (templates render the tools inside the system turn), a
                      system block's the system blocks up to it and every tool, a message
                      block's everything before it and the message's blocks up to it
    position          the longest common prefix, in tokens, of the cut's rendering (no generation
                      prompt) and the request's prompt: where the marked prefix ends
    retention         KVRetention(ttl_s, num_tokens=position, session, tenant): the engine keeps
                      the full blocks of that prefix for the TTL, soft priority within the
                      tenant's share of its budget (``kv.retention``)

Usage (``split_usage``), which always sums to the prompt's length: ``cache_read_input_tokens``
were read from the prefix cache; ``cache_creation_input_tokens`` are the full blocks this request
wrote up to its last breakpoint, as far as the engine granted each breakpoint's retention
(``RequestOutput.kv_retained_tokens``), each counted under the longest TTL of a breakpoint at or
after it (``cache_creation.ephemeral_1h_input_tokens`` / ``ephemeral_5m_input_tokens``), or,
without breakpoints, every full block it wrote (the cache is automatic here; counted as 5m);
``input_tokens`` is the rest. So a retention the budget refused is plain input: usage never
claims a retention that did not happen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixserve.api.anthropic.prompt import chat_messages, convert_tools, system_messages
from prefixserve.api.anthropic.protocol import CacheCreation, CountTokensRequest, MessagesUsage
from prefixserve.api.frontend.protocol import APIError
from prefixserve.kv.retention import KVRetention

MAX_BREAKPOINTS = 4
TTLS_S = {"5m": 300.0, "1h": 3600.0}


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A ``cache_control`` mark: its TTL and the conversation cut after its block."""

    ttl_s: float
    messages: list[dict]
    tools: list[dict] | None


def breakpoints(req: CountTokensRequest, drop_attribution: bool) -> list[Breakpoint]:
    """Every breakpoint of ``req`` in prompt order; a 400 on a malformed one or too many. The
    marks are counted first: each one's cut copies the conversation before it, so the cap is
    checked before any cut is made (20,000 marks cost one pass, not 20,000 copies)."""
    found: list[Breakpoint] = []
    tools = req.tools or []
    system = [{"type": "text", "text": req.system}] if isinstance(req.system, str) else req.system
    system = system or []
    blocks = [*tools, *system]
    for message in req.messages:
        blocks += [] if isinstance(message.content, str) else message.content
    marked = sum(isinstance(b, dict) and b.get("cache_control") is not None for b in blocks)
    if marked > MAX_BREAKPOINTS:
        raise APIError(
            f"cache_control: at most {MAX_BREAKPOINTS} blocks may carry it, found {marked}",
            400,
            "cache_control",
        )
    for k, tool in enumerate(tools):
        if (ttl := _ttl(tool, f"tools[{k}]")) is not None:
            head = system_messages(system, drop_attribution)
            found.append(Breakpoint(ttl, head, convert_tools(tools[: k + 1])))
    for j, block in enumerate(system):
        if (ttl := _ttl(block, f"system[{j}]")) is not None:
            head = system_messages(system[: j + 1], drop_attribution)
            found.append(Breakpoint(ttl, head, convert_tools(tools) or None))
    for i, message in enumerate(req.messages):
        blocks = [] if isinstance(message.content, str) else message.content
        for j, block in enumerate(blocks):
            if (ttl := _ttl(block, f"messages[{i}].content[{j}]")) is not None:
                head = _cut_messages(req, i, j, drop_attribution)
                found.append(Breakpoint(ttl, head, convert_tools(tools) or None))
    return found


def _ttl(block: Any, at: str) -> float | None:
    """The TTL (seconds) of ``block``'s ``cache_control``, None without one."""
    mark = block.get("cache_control") if isinstance(block, dict) else None
    if mark is None:
        return None
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise APIError(f'{at}.cache_control: must be {{"type": "ephemeral"}}', 400, "cache_control")
    ttl = mark.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in TTLS_S:
        raise APIError(
            f"{at}.cache_control.ttl: must be one of {list(TTLS_S)}, got {ttl!r}",
            400,
            "cache_control",
        )
    return TTLS_S[ttl]


def _cut_messages(req: CountTokensRequest, i: int, j: int, drop_attribution: bool) -> list[dict]:
    message = req.messages[i]
    cut = message.model_copy(update={"content": message.content[: j + 1]})
    head = req.model_copy(update={"messages": [*req.messages[:i], cut]})
    return chat_messages(head, drop_attribution)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def retentions(marks: tuple[tuple[int, float], ...], session: str | None, tenant: str = ""
               ) -> tuple[KVRetention, ...]:  # fmt: skip
    """One retention per mark (position, TTL) that covers at least one token, named
    ``session``, counted against ``tenant``'s share of the budget (``Tenant.owner``)."""
    return tuple(KVRetention(ttl_s=ttl, num_tokens=pos, session=session, tenant=tenant)
                 for pos, ttl in marks if pos > 0)  # fmt: skip


def granted_marks(marks: Sequence[tuple[int, float]], retained: Sequence[int | None]
                  ) -> list[tuple[int, float]]:  # fmt: skip
    """Each mark cut to what the engine retained for it: ``retained`` holds one entry per
    retention ``retentions`` made (the marks past position 0, in order), None or missing where
    nothing was granted yet."""
    granted = iter(retained)
    return [(min(p, next(granted, None) or 0) if p > 0 else 0, ttl) for p, ttl in marks]


def split_usage(
    num_prompt: int,
    num_read: int,
    marks: list[tuple[int, float]],
    block_size: int | None,
    output_tokens: int = 0,
    retained: Sequence[int | None] = (),
) -> MessagesUsage:
    """The prompt split as the module docstring says. ``marks``: (position, TTL seconds) of each
    breakpoint; ``block_size``: of the prefix cache, None when it is off (nothing is written);
    ``retained``: the engine's ``RequestOutput.kv_retained_tokens`` (a mark it does not cover
    counts as refused)."""
    if not block_size:
        marks, ends = [], []
    else:  # each mark's written end: its full blocks, as far as the engine retained them
        marks = [(min(p, num_prompt) // block_size * block_size, ttl)
                 for p, ttl in granted_marks(marks, retained)]  # fmt: skip
        ends = [p for p, _ in marks] or [num_prompt // block_size * block_size]
    hour = five = 0
    start = num_read
    for end in sorted(set(ends)):
        if end <= start:
            continue
        longest = max((ttl for p, ttl in marks if p >= end), default=TTLS_S["5m"])
        if longest >= TTLS_S["1h"]:
            hour += end - start
        else:
            five += end - start
        start = end
    created = hour + five
    return MessagesUsage(
        input_tokens=num_prompt - num_read - created,
        output_tokens=output_tokens,
        cache_creation_input_tokens=created,
        cache_read_input_tokens=num_read,
        cache_creation=CacheCreation(
            ephemeral_5m_input_tokens=five, ephemeral_1h_input_tokens=hour
        ),
    )
