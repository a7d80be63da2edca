"""Retention: a request's prefix kept for a while as soft priority, never as an unbounded pin.

``KVRetention`` is what a request carries (``SamplingParams.kv_retention``; the protocol fronts
map Anthropic's ``cache_control`` TTLs and OpenAI's ``prompt_cache_retention`` onto it).
``RetentionTable`` is the engine's record of retained block hashes, kept as *sessions*::

    session    one tenant's retention of one prefix: key (tenant, the prefix's last hash), its
               hashes (the chain, head first), an expiry, and up to MAX_NAMES_PER_SESSION names
               (the handles that release it: a response id, a namespace, a tool call)
    retain(hashes, ttl, name, tenant)   the leading run of hashes within the tenant's share;
                                        the same prefix again refreshes its session (the later
                                        expiry wins, the name is added), it adds no session
    release(name)   the name leaves its sessions; a session left without names ends
    rename(old, new)   the sessions named ``old`` take the name ``new`` instead (a reply's
                    provisional pause named after the tool call it made)
    expire()        sessions whose time passed end
    drop(hashes)    blocks that left the pool and every tier: they leave every session

A hash is retained while a session holds it. Budget, max-min fair across tenants: every
tenant's count is the distinct hashes its sessions hold, and the counts sum to at most
``budget_blocks``. While the budget has room any tenant takes it; once it is full, a tenant
asking for a block takes one back from the tenant holding most, if that one holds more than one
block more than the asker (its least recently retained session's tail first), so tenants that
all want more end within one block of equal shares and no tenant is locked out by another. What
cannot be granted is counted in ``refused``; a grant taken back in ``revoked``.

Bounds: a session's key hash is one it holds (a session that loses it is re-keyed to its new
last hash, merging with the tenant's session of that prefix), so sessions number at most the
hashes held, at most ``budget_blocks``; a tenant keeps at most ``max_sessions_per_tenant`` (its
least recently retained ends first); the expiry heap is rebuilt once stale entries outnumber
sessions (``HEAP_SLACK``); pauses on tool calls are bounded in count (``MAX_PAUSES``) and age.

A retained hash is only a preference: the block pool evicts unretained blocks first and
retained ones under pressure, and every tier evicts them last; eviction, expiry and release all
go through the normal path, so a retained block is demoted to the next tier, never dropped where
a tier is below. Released blocks stay cached as ordinary blocks.

TTL learned from tool calls: a retention without ``ttl_s`` (an agent paused on a tool call)
gets ``ttl_for``: the 90th percentile of the gaps seen so far between such a pause and the
session's next request, times ``TTL_MARGIN``, within [``default_ttl_s``, ``max_ttl_s``]; the
default until ``MIN_GAP_SAMPLES`` gaps were seen, or when learning is off. A pause is
remembered at most ``max_ttl_s`` (bounded: a session that never returns is forgotten).

Threads: the engine thread changes the table; ``is_retained`` and ``tenant_of`` (dict lookups)
are also read by the tiers' worker.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prefixserve.core.errors import require
from prefixserve.kv.hashing import BlockHash

TTL_MARGIN = 1.5
MIN_GAP_SAMPLES = 3
GAP_WINDOW = 256
MAX_NAMES_PER_SESSION = 16
MAX_PAUSES = 65536
HEAP_SLACK = 64

SessionKey = tuple[str, BlockHash]  # (tenant, the last hash of the prefix)


@dataclass(frozen=True)
class KVRetention:
    """Keep the KV of a request's prefix for a while.

    ``ttl_s``: seconds (None: the TTL learned from tool-call gaps, capped by the engine's
    ``kv_retention_max_ttl_s``). ``num_tokens``: the prefix retained ends at this token position
    (a ``cache_control`` breakpoint; None: the whole prompt, or the whole sequence with
    ``include_output``). ``include_output``: retain the generated tokens too (the conversation
    as the next turn resends it). ``write_through``: write the blocks to the disk tier at once
    (long retentions such as OpenAI's ``prompt_cache_retention: "24h"``). ``session``: the name
    that releases it (``LLMEngine.release_kv(session)``); the TTL learner keys gaps by it.
    ``tenant``: whose share of the retention budget it counts against (the API key's tenant).
    """

    ttl_s: float | None = None
    num_tokens: int | None = None
    include_output: bool = False
    write_through: bool = False
    session: str | None = None
    tenant: str = ""

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
        require(isinstance(self.tenant, str), "kv_retention.tenant", "must be a string")


@dataclass(slots=True, eq=False)
class _Session:
    key: SessionKey
    expiry: float
    serial: int  # its place in the tenant's LRU, kept when it is re-keyed
    hashes: dict[BlockHash, None] = field(default_factory=dict)  # ordered: the chain
    names: dict[str, None] = field(default_factory=dict)  # ordered: oldest first
    anonymous: bool = False  # retained once without a name: no release ends it, only time

    @property
    def tenant(self) -> str:
        return self.key[0]


class RetentionTable:
    """Retention sessions, their hashes and the tenants' budget; see the module docstring."""

    def __init__(
        self,
        budget_blocks: int,
        default_ttl_s: float = 300.0,
        max_ttl_s: float = 3600.0,
        learn_ttl: bool = True,
        clock: Callable[[], float] = time.monotonic,
        max_sessions_per_tenant: int = 1024,
    ) -> None:
        self.budget_blocks = budget_blocks
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.learn_ttl = learn_ttl
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self._clock = clock
        self._sessions: dict[SessionKey, _Session] = {}
        self._holders: dict[BlockHash, set[SessionKey]] = {}  # the sessions holding each hash
        self._owner: dict[BlockHash, str] = {}  # a tenant holding each hash (the tiers' quota)
        self._refs: Counter[tuple[str, BlockHash]] = Counter()  # a tenant's sessions per hash
        self._usage: Counter[str] = Counter()  # distinct hashes each tenant holds
        self._used = 0  # sum of _usage
        self._by_tenant: dict[str, OrderedDict[int, _Session]] = {}  # least recent first
        self._names: dict[str, set[SessionKey]] = {}
        self._heap: list[tuple[float, int, SessionKey]] = []  # stale entries skipped
        self._order = itertools.count()
        self._paused: dict[str, float] = {}  # session -> when it paused on a tool call
        self._gaps: deque[float] = deque(maxlen=GAP_WINDOW)
        self.retained_total = 0  # hash retentions granted (monotonic)
        self.refused = 0  # hashes past the tenant's share
        self.revoked = 0  # grants taken back for another tenant's share
        self.dropped = 0  # hashes whose blocks left the pool and every tier
        self.expiries = 0
        self.released = 0

    def __len__(self) -> int:
        return len(self._holders)

    def is_retained(self, block_hash: BlockHash) -> bool:
        return block_hash in self._holders

    def tenant_of(self, block_hash: BlockHash) -> str | None:
        """A tenant retaining ``block_hash`` (the first of several), None if none does."""
        return self._owner.get(block_hash)

    def usage(self, tenant: str) -> int:
        """The distinct hashes ``tenant``'s sessions hold (its share of the budget in use)."""
        return self._usage.get(tenant, 0)

    def ttl_for(self, ttl_s: float | None) -> float:
        """``ttl_s`` capped, or the learned TTL for a pause on a tool call."""
        if ttl_s is not None:
            return min(ttl_s, self.max_ttl_s)
        if not self.learn_ttl or len(self._gaps) < MIN_GAP_SAMPLES:
            return min(self.default_ttl_s, self.max_ttl_s)
        gaps = sorted(self._gaps)
        p90 = gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))]
        return min(self.max_ttl_s, max(self.default_ttl_s, p90 * TTL_MARGIN))

    # ---- changes -------------------------------------------------------------------------------

    def retain(
        self,
        hashes: Iterable[BlockHash],
        ttl_s: float | None,
        session: str | None = None,
        tenant: str = "",
    ) -> tuple[list[BlockHash], list[BlockHash]]:
        """Protect the leading run of ``hashes`` (a chain, head first) that fits ``tenant``'s
        share until now + ``ttl_for(ttl_s)``, under the name ``session`` (None: anonymous, only
        the TTL ends it). ``ttl_s`` None marks ``session`` as paused on a tool call.
        Returns (the hashes granted, the hashes no longer retained: taken back from another
        tenant or from a session the tenant's bound ended)."""
        now = self._clock()
        expiry = now + self.ttl_for(ttl_s)
        if ttl_s is None and session is not None:
            self._pause(session, now)
        hashes = list(hashes)
        ended: list[BlockHash] = []
        granted: list[BlockHash] = []
        new = 0
        for h in hashes:
            if self._refs[(tenant, h)] == 0:
                if not self._make_room(tenant, new, ended):
                    break
                new += 1
            granted.append(h)
        self.refused += len(hashes) - len(granted)
        if not granted:
            return granted, ended
        key = (tenant, granted[-1])
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = _Session(key, expiry, next(self._order))
            self._push(s)
        elif expiry > s.expiry:
            s.expiry = expiry
            self._push(s)
        for h in granted:
            self._hold(s, h)
        if session is None:
            s.anonymous = True
        else:
            self._name(s, session)
        lru = self._by_tenant.setdefault(tenant, OrderedDict())
        lru[s.serial] = s
        lru.move_to_end(s.serial)
        while len(lru) > self.max_sessions_per_tenant:
            ended += self._end(next(iter(lru.values())))
        self.retained_total += new
        return granted, [h for h in ended if h not in self._holders]

    def observe_request(self, session: str) -> None:
        """A request of ``session`` arrived: if the session was paused on a tool call, the gap
        since is one sample for the learned TTL."""
        paused = self._paused.pop(session, None)
        if paused is not None:
            self._gaps.append(self._clock() - paused)

    def expire(self) -> list[BlockHash]:
        """End the sessions whose time passed; returns the hashes no longer retained. Pauses
        older than ``max_ttl_s`` are forgotten too (a session that never came back)."""
        now, out = self._clock(), []
        while self._paused and now - next(iter(self._paused.values())) > self.max_ttl_s:
            del self._paused[next(iter(self._paused))]
        while self._heap and self._heap[0][0] <= now:
            expiry, _, key = heapq.heappop(self._heap)
            s = self._sessions.get(key)
            if s is not None and s.expiry == expiry:
                out += self._end(s)
        self.expiries += len(out)
        return out

    def release(self, session: str) -> list[BlockHash]:
        """The name ``session`` releases what it retained: each of its sessions left without a
        name ends (a hash another session holds stays retained)."""
        self._paused.pop(session, None)
        out = []
        for key in self._names.pop(session, ()):
            s = self._sessions[key]
            del s.names[session]
            if not s.names and not s.anonymous:
                out += self._end(s)
        self.released += len(out)
        return out

    def rename(self, old: str, new: str) -> None:
        """The sessions named ``old`` are named ``new`` instead, a pause on a tool call with
        them (its start kept: the gap to the next turn runs from the reply's end)."""
        paused = self._paused.pop(old, None)
        if paused is not None:
            self._paused[new] = paused
        for key in self._names.pop(old, ()):
            s = self._sessions[key]
            del s.names[old]
            self._name(s, new)

    def drop(self, hashes: Iterable[BlockHash]) -> None:
        """These blocks left the pool and every tier: they leave the budget."""
        for h in hashes:
            self.dropped += h in self._holders
            while h in self._holders:
                s = self._sessions[next(iter(self._holders[h]))]
                self._unhold(s, h)
                self._rekey(s)

    def clear(self) -> None:
        """Forget every session (the cache they protected was reset)."""
        for s in list(self._sessions.values()):
            self._end(s)
        self._heap.clear()

    # ---- budget ----------------------------------------------------------------------------------

    def _make_room(self, tenant: str, reserved: int, ended: list[BlockHash]) -> bool:
        """Whether one more block fits for ``tenant`` (already ``reserved`` more in this call):
        a free one, or one taken back from the tenant holding most while that one holds more
        than one block more than ``tenant`` would."""
        while self._used + reserved >= self.budget_blocks:
            mine = self._usage.get(tenant, 0) + reserved
            victim = max((u for u in self._usage if u != tenant), key=self._usage.__getitem__,
                         default=None)  # fmt: skip
            if victim is None or self._usage[victim] <= mine + 1:
                return False
            s = next(iter(self._by_tenant[victim].values()))
            h = next(reversed(s.hashes))
            self._unhold(s, h)
            if h not in self._holders:
                ended.append(h)
            self.revoked += 1
            self._rekey(s)
        return True

    # ---- sessions --------------------------------------------------------------------------------

    def _hold(self, s: _Session, h: BlockHash) -> None:
        if h in s.hashes:
            return
        s.hashes[h] = None
        self._holders.setdefault(h, set()).add(s.key)
        ref = (s.tenant, h)
        self._refs[ref] += 1
        self._owner.setdefault(h, s.tenant)
        if self._refs[ref] == 1:
            self._usage[s.tenant] += 1
            self._used += 1

    def _unhold(self, s: _Session, h: BlockHash) -> None:
        del s.hashes[h]
        holders = self._holders[h]
        holders.discard(s.key)
        ref = (s.tenant, h)
        self._refs[ref] -= 1
        if not holders:
            del self._holders[h]
            del self._owner[h]
        elif self._refs[ref] == 0 and self._owner[h] == s.tenant:
            self._owner[h] = next(iter(holders))[0]
        if self._refs[ref] == 0:
            del self._refs[ref]
            self._usage[s.tenant] -= 1
            self._used -= 1
            if self._usage[s.tenant] == 0:
                del self._usage[s.tenant]

    def _name(self, s: _Session, name: str) -> None:
        s.names.pop(name, None)
        s.names[name] = None
        self._names.setdefault(name, set()).add(s.key)
        while len(s.names) > MAX_NAMES_PER_SESSION:
            oldest = next(iter(s.names))
            del s.names[oldest]
            self._unname(oldest, s.key)

    def _unname(self, name: str, key: SessionKey) -> None:
        keys = self._names.get(name)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._names[name]

    def _end(self, s: _Session) -> list[BlockHash]:
        """End ``s``; returns its hashes no other session holds."""
        out = []
        for h in list(s.hashes):
            self._unhold(s, h)
            if h not in self._holders:
                out.append(h)
        self._forget(s)
        return out

    def _forget(self, s: _Session) -> None:
        del self._sessions[s.key]
        lru = self._by_tenant[s.tenant]
        del lru[s.serial]
        if not lru:
            del self._by_tenant[s.tenant]
        for name in s.names:
            self._unname(name, s.key)

    def _rekey(self, s: _Session) -> None:
        """``s`` lost hashes: it ends when none are left, else it is keyed by its last hash (in
        place in its tenant's LRU), merged into the tenant's session of that prefix if any."""
        if not s.hashes:
            self._forget(s)
            return
        key = (s.tenant, next(reversed(s.hashes)))
        if key == s.key:
            return
        target = self._sessions.get(key)
        if target is None:
            for h in s.hashes:
                self._holders[h].discard(s.key)
                self._holders[h].add(key)
            for name in s.names:
                self._names[name].discard(s.key)
                self._names[name].add(key)
            del self._sessions[s.key]
            s.key = key
            self._sessions[key] = s
            self._push(s)
            return
        for h in s.hashes:  # held by the target before ``s`` lets go: no count touches zero
            self._hold(target, h)
        for name in s.names:
            self._name(target, name)
        target.anonymous |= s.anonymous
        if s.expiry > target.expiry:
            target.expiry = s.expiry
            self._push(target)
        self._end(s)

    def _push(self, s: _Session) -> None:
        heapq.heappush(self._heap, (s.expiry, next(self._order), s.key))
        if len(self._heap) > 2 * len(self._sessions) + HEAP_SLACK:
            self._heap = [(v.expiry, next(self._order), k) for k, v in self._sessions.items()]
            heapq.heapify(self._heap)

    def _pause(self, session: str, now: float) -> None:
        self._paused.pop(session, None)  # oldest pause first (``expire`` relies on it)
        self._paused[session] = now
        if len(self._paused) > MAX_PAUSES:
            del self._paused[next(iter(self._paused))]

    def stats(self) -> dict[str, float | int]:
        return {
            "retained_blocks": len(self._holders),
            "retention_budget_blocks": self.budget_blocks,
            "retention_used_blocks": self._used,
            "retention_tenants": len(self._usage),
            "retention_sessions": len(self._sessions),
            "retention_heap_entries": len(self._heap),
            "retained_total": self.retained_total,
            "retention_refused": self.refused,
            "retention_revoked": self.revoked,
            "retention_dropped": self.dropped,
            "retention_expiries": self.expiries,
            "retention_released": self.released,
            "retention_learned_ttl_s": self.ttl_for(None),
        }
