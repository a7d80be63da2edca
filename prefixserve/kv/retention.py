"""Retention: a request's prefix kept for a while as soft priority, never as an unbounded pin.

``KVRetention`` is what a request carries (``SamplingParams.kv_retention``; the protocol fronts
map Anthropic's ``cache_control`` TTLs and OpenAI's ``prompt_cache_retention`` onto it).
``RetentionTable`` is the engine's record of retained block hashes::

    retain(hashes, ttl, session)   hash -> expiry (the later one wins); session -> its hashes
    is_retained(hash)              expiry in the future
    expire()                       hashes whose time passed: protection dropped, returned
    release(session)               the session's hashes: protection dropped, returned

Invariants: at most ``budget_blocks`` hashes are retained at once (a retention past the budget
protects only what fits, the rest is counted in ``refused``); a retained hash is only a
preference: the block pool evicts unretained blocks first and retained ones under pressure, and
every tier evicts them last; eviction, expiry and release all go through the normal path, so a
retained block is demoted to the next tier, never dropped where a tier is below. Released blocks
stay cached as ordinary blocks (another session may share them, a system prompt say).

TTL learned from tool calls: a retention without ``ttl_s`` (an agent paused on a tool call)
gets ``ttl_for``: the 90th percentile of the gaps seen so far between such a pause and the
session's next request, times ``TTL_MARGIN``, within [``default_ttl_s``, ``max_ttl_s``]; the
default until ``MIN_GAP_SAMPLES`` gaps were seen, or when learning is off. A pause is
remembered at most ``max_ttl_s`` (bounded: a session that never returns is forgotten).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prefixserve.errors import require
from prefixserve.kv.hashing import BlockHash

TTL_MARGIN = 1.5
MIN_GAP_SAMPLES = 3
GAP_WINDOW = 256


@dataclass(frozen=True)
class KVRetention:
    """Keep the KV of a request's prefix for a while.

    ``ttl_s``: seconds (None: the TTL learned from tool-call gaps, capped by the engine's
    ``kv_retention_max_ttl_s``). ``num_tokens``: the prefix retained ends at this token position
    (a ``cache_control`` breakpoint; None: the whole prompt, or the whole sequence with
    ``include_output``). ``include_output``: retain the generated tokens too (the conversation
    as the next turn resends it). ``write_through``: write the blocks to the disk tier at once
    (long retentions such as OpenAI's ``prompt_cache_retention: "24h"``). ``session``: who owns
    it; ``LLMEngine.release_kv(session)`` drops it, and the TTL learner keys gaps by it.
    """

    ttl_s: float | None = None
    num_tokens: int | None = None
    include_output: bool = False
    write_through: bool = False
    session: str | None = None

    def __post_init__(self) -> None:
        require(
            self.ttl_s is None or (isinstance(self.ttl_s, (int, float)) and self.ttl_s > 0),
            "kv_retention.ttl_s",
            f"must be > 0 seconds or None, got {self.ttl_s!r}",
        )
        require(
            self.num_tokens is None or (isinstance(self.num_tokens, int) and self.num_tokens >= 1),
            "kv_retention.num_tokens",
            f"must be an integer >= 1 or None, got {self.num_tokens!r}",
        )
        require(
            self.session is None or (isinstance(self.session, str) and self.session != ""),
            "kv_retention.session",
            "must be a non-empty string or None",
        )


class RetentionTable:
    """Retained block hashes with their expiry and owner; see the module docstring."""

    def __init__(
        self,
        budget_blocks: int,
        default_ttl_s: float = 300.0,
        max_ttl_s: float = 3600.0,
        learn_ttl: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_blocks = budget_blocks
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.learn_ttl = learn_ttl
        self._clock = clock
        self._expiry: dict[BlockHash, float] = {}
        self._owners: dict[BlockHash, set[str]] = {}
        self._sessions: dict[str, set[BlockHash]] = {}
        self._heap: list[tuple[float, BlockHash]] = []  # (expiry, hash), stale entries skipped
        self._paused: dict[str, float] = {}  # session -> when it paused on a tool call
        self._gaps: deque[float] = deque(maxlen=GAP_WINDOW)
        self.retained_total = 0  # hash retentions granted (monotonic)
        self.refused = 0  # hashes past the budget
        self.expiries = 0
        self.released = 0

    def __len__(self) -> int:
        return len(self._expiry)

    def is_retained(self, block_hash: BlockHash) -> bool:
        expiry = self._expiry.get(block_hash)
        return expiry is not None and expiry > self._clock()

    def ttl_for(self, ttl_s: float | None) -> float:
        """``ttl_s`` capped, or the learned TTL for a pause on a tool call."""
        if ttl_s is not None:
            return min(ttl_s, self.max_ttl_s)
        if not self.learn_ttl or len(self._gaps) < MIN_GAP_SAMPLES:
            return min(self.default_ttl_s, self.max_ttl_s)
        gaps = sorted(self._gaps)
        p90 = gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))]
        return min(self.max_ttl_s, max(self.default_ttl_s, p90 * TTL_MARGIN))

    def retain(
        self, hashes: Iterable[BlockHash], ttl_s: float | None, session: str | None = None
    ) -> list[BlockHash]:
        """Protect ``hashes`` until now + ``ttl_for(ttl_s)``; returns those now retained (within
        the budget). ``ttl_s`` None marks ``session`` as paused on a tool call (gap learning)."""
        now = self._clock()
        expiry = now + self.ttl_for(ttl_s)
        if ttl_s is None and session is not None:
            self._paused.pop(session, None)  # oldest pause first (``expire`` relies on it)
            self._paused[session] = now
        granted = []
        for h in hashes:
            known = h in self._expiry
            if not known and len(self._expiry) >= self.budget_blocks:
                self.refused += 1
                continue
            if not known or expiry > self._expiry[h]:
                self._expiry[h] = expiry
                heapq.heappush(self._heap, (expiry, h))
            owner = session or ""  # anonymous retentions are never released by a session
            self._owners.setdefault(h, set()).add(owner)
            self._sessions.setdefault(owner, set()).add(h)
            self.retained_total += 0 if known else 1
            granted.append(h)
        return granted

    def observe_request(self, session: str) -> None:
        """A request of ``session`` arrived: if the session was paused on a tool call, the gap
        since is one sample for the learned TTL."""
        paused = self._paused.pop(session, None)
        if paused is not None:
            self._gaps.append(self._clock() - paused)

    def expire(self) -> list[BlockHash]:
        """Drop the retentions whose time passed; returns their hashes. Pauses older than
        ``max_ttl_s`` are forgotten too (a session that never came back)."""
        now, out = self._clock(), []
        while self._paused and now - next(iter(self._paused.values())) > self.max_ttl_s:
            del self._paused[next(iter(self._paused))]
        while self._heap and self._heap[0][0] <= now:
            expiry, h = heapq.heappop(self._heap)
            if self._expiry.get(h) == expiry:
                self._forget(h)
                out.append(h)
        self.expiries += len(out)
        return out

    def release(self, session: str) -> list[BlockHash]:
        """Drop what ``session`` retained (hashes other sessions also retain stay retained)."""
        self._paused.pop(session, None)
        out = []
        for h in self._sessions.pop(session, set()):
            owners = self._owners.get(h, set())
            owners.discard(session)
            if not owners:
                self._forget(h)
                out.append(h)
        self.released += len(out)
        return out

    def clear(self) -> None:
        self._expiry.clear()
        self._owners.clear()
        self._sessions.clear()
        self._heap.clear()

    def _forget(self, h: BlockHash) -> None:
        self._expiry.pop(h, None)
        for session in self._owners.pop(h, ()):
            hashes = self._sessions.get(session)
            if hashes is not None:
                hashes.discard(h)
                if not hashes:
                    del self._sessions[session]

    def stats(self) -> dict[str, float | int]:
        return {
            "retained_blocks": len(self._expiry),
            "retention_budget_blocks": self.budget_blocks,
            "retained_total": self.retained_total,
            "retention_refused": self.refused,
            "retention_expiries": self.expiries,
            "retention_released": self.released,
            "retention_learned_ttl_s": self.ttl_for(None),
        }
