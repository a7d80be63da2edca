"""Prefix-aware routing without Ray: what each replica's prefix cache holds, and where a request
should go. ``ray_router.py`` plugs this into Ray Serve; nothing here imports Ray.

::

    replica r's KV events ──▶ HashMirror(r).apply      held: the hashes r's block pool holds now
    a request routed to r  ──▶ HashMirror(r).predict    predicted: hashes r will hold once it runs
                                                        the request (until an event confirms or
                                                        drops them, or they pass their TTL)

    token ids + salt ──▶ request_block_hashes ──▶ per replica: Candidate(hit tokens, load tokens)
                                              ──▶ choose() ──▶ Decision(ranking, reason)

Tiers: an engine with tiers under its KV pool reports each block with the ``medium`` holding it
(``GPU``, ``CPU_TIER``, ``DISK``, ``SHARED``); the mirror keeps one set per medium, and a block
counts toward a replica's hit with its best medium's weight (``MEDIUM_WEIGHTS``: a block to load
is worth less than one in the pool). A ``SHARED`` block is in a server every replica reads, so
it counts for every replica, whoever announced it.

The hashes are the engine's own (``extend_block_hashes`` over the token ids with the cache salt
as extra key, then ``external_block_hash``), so a hit predicted here is the hit the engine's
``lookup`` finds, event lag aside (about one engine step).

Decision rule (``choose``), for the candidate replicas of one request:

- ``load``: the candidates' loads differ by more than ``imbalance_threshold`` tokens: the least
  loaded first, whatever it holds.
- ``cold``: no candidate holds the request's first block: least loaded first, then the one
  holding fewer blocks (new prefixes spread over the caches).
- ``prefix``: else by score ``hit_tokens - load_weight * load_tokens``: the prompt tokens a
  replica would not compute against the work already queued there. The weight is well below 1:
  queued work and the new request share steps, while a prefix recomputed elsewhere costs its
  whole prefill and evicts another prefix there. If the best score belongs to a replica that
  holds nothing of the prompt, the reason is ``load``.

Affinity (``route(..., affinity_key=)``: OpenAI's ``prompt_cache_key``, scoped to the tenant): a
hint, never a block hash. Unless the loads decided (``load``), the replica the key last went to
goes first when it would hit as many tokens as the best candidate (``affinity``): a cold prompt,
or a tie on what is cached (every replica holds the shared system prompt), goes where the key's
earlier requests went; a replica that holds more of the prompt still wins. The router keeps the
last ``MAX_AFFINITY_KEYS`` keys (least recently routed dropped first), each as a 16-byte digest
(``affinity_digest``), never the key itself: the table is at most a few MiB whatever the keys.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from prefixserve.core.errors import require
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    external_block_hash,
)

PREFIX, LOAD, COLD, AFFINITY = "prefix", "load", "cold", "affinity"
MAX_AFFINITY_KEYS = 65536
MEDIUM_WEIGHTS = {MEDIUM_GPU: 1.0, "CPU_TIER": 0.9, "DISK": 0.6, "SHARED": 0.4}
"""What a held block saves, by the medium holding it: loading from host memory costs little,
from disk or a server more (measured per block by the engine: ``kv_tiers`` in its stats)."""
SHARED = "SHARED"
REASONS = (PREFIX, LOAD, COLD, AFFINITY)
ROUTERS = ("prefix", "pow2", "ray-prefix")
"""``prefix``: this module's rule; ``pow2``: Ray's power-of-two choices; ``ray-prefix``: Ray's
``PrefixCacheAffinityRouter`` (text prefixes it routed, no feedback from the engines)."""


def request_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[ExternalBlockHash]:
    """The external hashes of the prompt blocks the engine's lookup may hit: the full blocks
    but one token (at least one prompt token is always computed), chained as the engine does."""
    num_blocks = max(0, (len(token_ids) - 1) // block_size)
    hashes: list[int] = []
    extra_keys = (cache_salt,) if cache_salt is not None else ()
    extend_block_hashes(token_ids[: num_blocks * block_size], block_size, extra_keys, hashes)
    return [external_block_hash(h) for h in hashes]


class HashMirror:
    """The block hashes one replica's prefix cache holds, rebuilt from its KV events, and those
    the router expects it to hold soon.

    Invariant: after applying a replica's events in order, ``held_in(medium)`` equals the
    external hashes that medium holds (``KVEventRecorder``'s promise; the pool is ``GPU``), and
    ``held`` is their union. ``AllBlocksCleared`` empties every medium but ``SHARED`` (the
    replica clears its own pool and tiers, not the shared server). A predicted hash leaves
    ``predicted`` when a ``BlockStored`` confirms it (it is then held), a ``BlockRemoved`` that
    leaves it in no medium or an ``AllBlocksCleared`` drops it, or ``predict_ttl_s`` passes.
    Thread-safe: an event thread applies, the router reads.
    """

    def __init__(
        self, predict_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.predict_ttl_s = predict_ttl_s
        self._clock = clock
        self._media: dict[str, set[ExternalBlockHash]] = {}
        self._predicted: dict[ExternalBlockHash, float] = {}  # hash -> expiry
        self._lock = threading.Lock()

    def apply(self, events: Iterable[KVEvent]) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self._in(event.medium).update(event.block_hashes)
                    for h in event.block_hashes:
                        self._predicted.pop(h, None)
                elif isinstance(event, BlockRemoved):
                    self._in(event.medium).difference_update(event.block_hashes)
                    for h in event.block_hashes:
                        if not self._holds(h):
                            self._predicted.pop(h, None)
                elif isinstance(event, AllBlocksCleared):
                    for medium, held in self._media.items():
                        if medium != SHARED:
                            held.clear()
                    self._predicted.clear()

    def _in(self, medium: str | None) -> set[ExternalBlockHash]:
        return self._media.setdefault(medium or MEDIUM_GPU, set())

    def _holds(self, h: ExternalBlockHash) -> bool:
        return any(h in held for held in self._media.values())

    def clear(self) -> None:
        """Forget everything (the replica's event stream had a gap we cannot fill)."""
        with self._lock:
            self._media.clear()
            self._predicted.clear()

    def predict(self, hashes: Iterable[ExternalBlockHash]) -> None:
        """The replica was just sent a request with these block hashes."""
        expiry = self._clock() + self.predict_ttl_s
        with self._lock:
            for h in hashes:
                if h not in self._in(MEDIUM_GPU):
                    self._predicted[h] = expiry

    def hit_blocks(self, hashes: Sequence[ExternalBlockHash]) -> int:
        """How many of ``hashes``, from the first, the replica holds or is predicted to hold."""
        return len(self._weights(hashes, ()))

    def hit_weight(
        self, hashes: Sequence[ExternalBlockHash], shared: Sequence[set[ExternalBlockHash]] = ()
    ) -> float:
        """The blocks of ``hashes`` the replica holds, from the first, each weighted by its best
        medium (``MEDIUM_WEIGHTS``; a predicted block as ``GPU``); ``shared``: the ``SHARED``
        sets of every replica, which this one reads too."""
        return sum(self._weights(hashes, shared))

    def _weights(
        self, hashes: Sequence[ExternalBlockHash], shared: Sequence[set[ExternalBlockHash]]
    ) -> list[float]:
        now = self._clock()
        out: list[float] = []
        with self._lock:
            media, predicted = list(self._media.items()), self._predicted
            for h in hashes:
                best = 1.0 if predicted.get(h, 0.0) > now else 0.0
                for medium, held in media:
                    if h in held:
                        best = max(best, MEDIUM_WEIGHTS.get(medium, 0.5))
                if best == 0.0 and any(h in s for s in shared):
                    best = MEDIUM_WEIGHTS[SHARED]
                if best == 0.0:
                    return out
                out.append(best)
        return out

    def held_in(self, medium: str) -> set[ExternalBlockHash]:
        """The live set of one medium (read without the lock: membership tests only)."""
        with self._lock:
            return self._in(medium)

    @property
    def held(self) -> frozenset[ExternalBlockHash]:
        """Every hash held in any medium."""
        with self._lock:
            return frozenset().union(*self._media.values())

    def num_blocks(self) -> int:
        """Blocks held plus live predictions (expired ones are dropped here)."""
        now = self._clock()
        with self._lock:
            expired = [h for h, t in self._predicted.items() if t <= now]
            for h in expired:
                del self._predicted[h]
            return len(set().union(*self._media.values())) + len(self._predicted)


@dataclass(frozen=True)
class RouterConfig:
    """``imbalance_threshold``: tokens of load difference past which the least loaded replica
    wins outright. ``load_weight``: what one token of queued work costs, in prompt tokens not
    recomputed (0.25: a cached prefix is worth waiting behind four times its length of work).
    ``predict_ttl_s``: how long a routed request's blocks count as held without an event."""

    imbalance_threshold: int = 8192
    load_weight: float = 0.25
    predict_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        require(self.imbalance_threshold >= 0, "imbalance_threshold", "must be >= 0 tokens")
        require(self.load_weight >= 0, "load_weight", "must be >= 0")
        require(self.predict_ttl_s > 0, "predict_ttl_s", "must be > 0 seconds")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One replica as a request sees it: prompt tokens it would not compute (``hit_tokens``),
    tokens of work routed to it and not finished (``load_tokens``), blocks it holds."""

    replica: str
    hit_tokens: int
    load_tokens: int
    num_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The candidates best first, and why the first one is first."""

    ranking: tuple[Candidate, ...]
    reason: str


def affinity_digest(affinity_key: str) -> bytes:
    """What the affinity table keys by: 16 bytes, whatever the key's length."""
    return hashlib.blake2b(affinity_key.encode(), digest_size=16).digest()


def with_affinity(decision: Decision, replica: str | None, config: RouterConfig) -> Decision:
    """``decision`` with ``replica`` first where the affinity rule (module docstring) says so."""
    ranking = decision.ranking
    loads = [c.load_tokens for c in ranking]
    if replica is None or max(loads) - min(loads) > config.imbalance_threshold:
        return decision
    chosen = next((c for c in ranking if c.replica == replica), None)
    if chosen is None or chosen is ranking[0] or chosen.hit_tokens < ranking[0].hit_tokens:
        return decision
    return Decision((chosen, *(c for c in ranking if c is not chosen)), AFFINITY)


def choose(candidates: Sequence[Candidate], config: RouterConfig) -> Decision:
    """Rank ``candidates`` (at least one) by the rule in the module docstring."""
    loads = [c.load_tokens for c in candidates]
    if max(loads) - min(loads) > config.imbalance_threshold:
        ranking = sorted(candidates, key=lambda c: (c.load_tokens, -c.hit_tokens))
        return Decision(tuple(ranking), LOAD)
    if all(c.hit_tokens == 0 for c in candidates):
        ranking = sorted(candidates, key=lambda c: (c.load_tokens, c.num_blocks))
        return Decision(tuple(ranking), COLD)
    w = config.load_weight
    ranking = sorted(candidates, key=lambda c: (w * c.load_tokens - c.hit_tokens, c.load_tokens))
    return Decision(tuple(ranking), PREFIX if ranking[0].hit_tokens > 0 else LOAD)


@dataclass(slots=True)
class _InFlight:
    """A request the router placed: where its load counts now, and what it was decided on."""

    decision: Decision
    hashes: Sequence[ExternalBlockHash]
    num_prompt_tokens: int
    num_output_tokens: int
    replica: str
    load_tokens: int
    reserved_at: float
    routed: bool = False


@dataclass
class ReplicaCounters:
    """The router's view of one replica: its in-flight load and its decisions so far."""

    load_tokens: int = 0
    requests: Counter[str] = field(default_factory=Counter)  # reason -> requests routed
    predicted_hit_tokens: int = 0


class PrefixRouterState:
    """Everything the prefix router knows: a mirror, a load and counters per replica.

    ``route`` ranks the replicas for a request and reserves the first at once: its blocks become
    predicted there and its work joins that replica's load, so the next decision sees both even
    before this request reaches the replica (a burst of one new prefix stays together; distinct
    new prefixes spread). ``on_routed`` records where it really went (the first choice, or a
    later one if that was full: the reservation moves) and counts the decision: its reason, or
    ``load`` for a later choice. ``on_completed`` takes its work off. A reservation never routed
    (the caller gave up) is released after ``predict_ttl_s``. A replica that leaves
    (``remove_replica``) takes its mirror, load and requests with it; one that comes back under
    the same name starts empty. Thread-safe.
    """

    def __init__(
        self, config: RouterConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or RouterConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._mirrors: dict[str, HashMirror] = {}
        self._counters: dict[str, ReplicaCounters] = {}
        self._in_flight: dict[str, _InFlight] = {}
        # affinity_digest(key) -> the replica it last went to, least recently routed first
        self._affinity: OrderedDict[bytes, str] = OrderedDict()

    def mirror(self, replica: str) -> HashMirror:
        """The replica's mirror, created empty on first use."""
        with self._lock:
            return self._mirror(replica)

    def _mirror(self, replica: str) -> HashMirror:
        mirror = self._mirrors.get(replica)
        if mirror is None:
            mirror = self._mirrors[replica] = HashMirror(self.config.predict_ttl_s, self._clock)
            self._counters.setdefault(replica, ReplicaCounters())
        return mirror

    def replicas(self) -> list[str]:
        """The replicas with a mirror now (seen and not removed since)."""
        with self._lock:
            return list(self._mirrors)

    def remove_replica(self, replica: str) -> None:
        with self._lock:
            self._mirrors.pop(replica, None)
            counters = self._counters.get(replica)
            if counters is not None:
                counters.load_tokens = 0
            for rid in [r for r, f in self._in_flight.items() if f.replica == replica]:
                del self._in_flight[rid]

    def candidates(
        self, replicas: Sequence[str], hashes: Sequence[ExternalBlockHash], block_size: int
    ) -> list[Candidate]:
        """Each replica's hit (in tokens) and load for a request with these block hashes."""
        with self._lock:
            mirrors = [self._mirror(r) for r in replicas]
            loads = [self._counters[r].load_tokens for r in replicas]
            shared = [m.held_in(SHARED) for m in self._mirrors.values()]
        return [
            Candidate(r, round(m.hit_weight(hashes, shared) * block_size), load, m.num_blocks())
            for r, m, load in zip(replicas, mirrors, loads)
        ]

    def route(
        self,
        request_id: str,
        replicas: Sequence[str],
        hashes: Sequence[ExternalBlockHash],
        block_size: int,
        num_prompt_tokens: int,
        num_output_tokens: int = 0,
        uses_prefix_cache: bool = True,
        affinity_key: str | None = None,
    ) -> Decision:
        """Rank ``replicas`` (at least one) and reserve the first for the request. Deciding
        again for the same request (its first choice was full) replaces its reservation.
        A request that does not read the prefix cache (``uses_prefix_cache`` False: it scores
        its prompt) hits nowhere, but its blocks are still predicted where it goes (the engine
        caches them once computed). ``affinity_key``: the affinity rule (module docstring)."""
        self.on_completed(request_id)
        self._release_stale()
        candidates = self.candidates(replicas, hashes, block_size)
        if not uses_prefix_cache:
            candidates = [replace(c, hit_tokens=0) for c in candidates]
        decision = choose(candidates, self.config)
        if affinity_key is not None:
            digest = affinity_digest(affinity_key)
            with self._lock:
                decision = with_affinity(decision, self._affinity.get(digest), self.config)
                self._affinity[digest] = decision.ranking[0].replica
                self._affinity.move_to_end(digest)
                if len(self._affinity) > MAX_AFFINITY_KEYS:
                    self._affinity.popitem(last=False)
        first = decision.ranking[0]
        entry = _InFlight(decision, hashes, num_prompt_tokens, num_output_tokens, first.replica,
                          0, self._clock())  # fmt: skip
        with self._lock:
            self._in_flight[request_id] = entry
            self._charge(entry, first)
        self.mirror(first.replica).predict(hashes)
        return decision

    def on_routed(self, request_id: str, replica: str) -> None:
        with self._lock:
            entry = self._in_flight.get(request_id)
            if entry is None or entry.routed:
                return
            entry.routed = True
            chosen = next((c for c in entry.decision.ranking if c.replica == replica), None)
            hit = chosen.hit_tokens if chosen is not None else 0
            if replica != entry.replica:
                self._uncharge(entry)
                entry.replica = replica
                self._charge(entry, chosen or Candidate(replica, 0, 0))
            counters = self._counters.setdefault(replica, ReplicaCounters())
            first = entry.decision.ranking[0].replica == replica
            counters.requests[entry.decision.reason if first else LOAD] += 1
            counters.predicted_hit_tokens += hit
        self.mirror(replica).predict(entry.hashes)

    def on_completed(self, request_id: str) -> None:
        with self._lock:
            entry = self._in_flight.pop(request_id, None)
            if entry is not None:
                self._uncharge(entry)

    def _charge(self, entry: _InFlight, candidate: Candidate) -> None:
        entry.load_tokens = entry.num_prompt_tokens - candidate.hit_tokens + entry.num_output_tokens
        self._counters.setdefault(entry.replica, ReplicaCounters()).load_tokens += entry.load_tokens

    def _uncharge(self, entry: _InFlight) -> None:
        counters = self._counters.get(entry.replica)
        if counters is not None:
            counters.load_tokens = max(0, counters.load_tokens - entry.load_tokens)

    def _release_stale(self) -> None:
        deadline = self._clock() - self.config.predict_ttl_s
        with self._lock:
            stale = [r for r, e in self._in_flight.items()
                     if not e.routed and e.reserved_at < deadline]  # fmt: skip
            for request_id in stale:
                self._uncharge(self._in_flight.pop(request_id))

    def snapshot(self) -> dict[str, dict]:
        """Per replica ever seen: live or not, blocks in its mirror, load, decisions by reason
        and predicted hit tokens (counters stay after a replica leaves, as Prometheus wants)."""
        with self._lock:
            mirrors = dict(self._mirrors)
            counters = {r: (c.load_tokens, dict(c.requests), c.predicted_hit_tokens)
                        for r, c in self._counters.items()}  # fmt: skip
        return {
            r: {
                "live": r in mirrors,
                "mirrored_blocks": mirrors[r].num_blocks() if r in mirrors else 0,
                "load_tokens": load,
                "requests": {reason: requests.get(reason, 0) for reason in REASONS},
                "predicted_hit_tokens": hit,
            }
            for r, (load, requests, hit) in counters.items()
        }
