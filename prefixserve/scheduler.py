"""Continuous batching: which sequences run this step, and how many tokens each.

Every step hands out a token budget (``max_num_batched_tokens``): running requests first, in
priority order, one token per decoding sequence or a chunk of a prompt still being prefilled; then
waiting requests are admitted while the budget, ``max_num_seqs`` and the KV cache allow. A waiting
request starts from its longest cached prefix, so only the rest is computed.

When the KV cache runs out for a running request, the lowest-priority running request (the last
one, never one already scheduled this step) is preempted: its blocks are freed (full ones stay
cached) and it goes back to the front of the waiting queue, to be recomputed later, mostly from the
prefix cache. A request is admitted or preempted as a whole group (``n`` samples, beams).

The scheduler sees the KV cache only through ``KVCacheManager``; it never handles block ids.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from prefixserve.config import EngineConfig
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager, PrefixHit
from prefixserve.sequence import Request, RequestStatus, Sequence

logger = logging.getLogger(__name__)

# Prefix-aware order: a request's priority is its cached prefix length in tokens plus this many
# tokens per second waited, so a request without any hit still gets admitted eventually.
AGING_TOKENS_PER_SECOND = 512.0
PREFIX_POLICY_WINDOW = 64


@dataclass(slots=True)
class ScheduledSeq:
    """``num_new_tokens`` tokens of ``seq`` run this step, starting at ``seq.num_computed_tokens``."""

    request: Request
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so its next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.enable_caching = config.enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        for seq in request.seqs:
            self._hash_new_blocks(request, seq)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs()) for r in self.running)

    def finish_request(self, request: Request) -> None:
        """Remove a request from the queues and free all its blocks (full ones stay cached)."""
        for seq in request.seqs:
            self.kv.free(seq.seq_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    def free_seq(self, seq: Sequence) -> None:
        """Free one finished sequence of a still-running group (a dropped beam, a done sample)."""
        self.kv.free(seq.seq_id)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.kv.fork(parent.seq_id, child.seq_id)

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            plan = self._plan_running(request, budget)
            while not self._allocate(plan, out.block_copies):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            for seq, n in plan:
                if n > 0:
                    out.scheduled.append(ScheduledSeq(request, seq, n))
                    budget -= n
            i += 1

        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _plan_running(self, request: Request, budget: int) -> list[tuple[Sequence, int]]:
        plan = []
        for seq in request.live_seqs():
            n = min(seq.num_uncomputed_tokens, budget)
            plan.append((seq, n))
            budget -= n
        # Beams advance in lockstep: a beam may reach its last token only if all of them do.
        lockstep = request.is_beam_search and len(plan) > 1
        if lockstep and not all(n == seq.num_uncomputed_tokens for seq, n in plan):
            plan = [(seq, min(n, seq.num_uncomputed_tokens - 1)) for seq, n in plan]
        return plan

    def _allocate(self, plan: list[tuple[Sequence, int]], copies: list[tuple[int, int]]) -> bool:
        """Reserve slots for every sequence of a running request's plan; False if one does not fit.

        Copy-on-write copies are appended to ``copies`` as they are decided, even when a later
        sequence of the plan fails: the copied-to block is already in the sequence's table, and a
        retry after a preemption finds it exclusively held and asks for no second copy.
        """
        for seq, n in plan:
            if n == 0:
                continue
            got = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
            if got is None:
                return False
            copies.extend(got)
        for seq, n in plan:
            self._cache_blocks(seq, seq.num_computed_tokens + n)
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        num_seqs = self.num_running_seqs()
        if self.config.scheduling_policy == "prefix":
            self._reorder_waiting_by_prefix()
        while self.waiting and budget > 0:
            request = self.waiting[0]
            group = request.live_seqs()
            if num_seqs + max(len(group), request.num_samples) > self.config.max_num_seqs:
                break
            admitted = self._admit(request, budget)
            if admitted is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            for sched in admitted:
                out.scheduled.append(sched)
                budget -= sched.num_new_tokens
            num_seqs += len(group)

    def _admit(self, request: Request, budget: int) -> list[ScheduledSeq] | None:
        """Give every sequence of a waiting request its cached prefix and first chunk, or nothing.

        A preempted beam group is recomputed up to, not including, each beam's last token; the
        running path then runs the last tokens of all beams in one step (beams move in lockstep).
        """
        admitted: list[ScheduledSeq] = []
        hits: list[int] = []
        lockstep = request.is_beam_search and len(request.live_seqs()) > 1
        for seq in request.live_seqs():
            hit = self._lookup(seq)
            remaining = seq.num_tokens - hit.num_tokens
            n = min(remaining - 1 if lockstep else remaining, budget)
            chunked_out = n < remaining and not self.config.enable_chunked_prefill and not lockstep
            if (n <= 0 and not lockstep) or chunked_out:
                self._roll_back(admitted)
                return None
            if self.kv.allocate_slots(seq.seq_id, hit.num_tokens, n, hit=hit) is None:
                self._roll_back(admitted)
                return None
            seq.num_computed_tokens = hit.num_tokens
            admitted.append(ScheduledSeq(request, seq, n))
            hits.append(hit.num_tokens)
            budget -= n
        for sched in admitted:  # only now: a rolled-back admission must register nothing
            self._cache_blocks(sched.seq, sched.seq.num_computed_tokens + sched.num_new_tokens)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hits[0]
        return [s for s in admitted if s.num_new_tokens > 0]

    def _roll_back(self, admitted: list[ScheduledSeq]) -> None:
        for sched in admitted:
            self.kv.free(sched.seq.seq_id)
            sched.seq.num_computed_tokens = 0

    def _lookup(self, seq: Sequence) -> PrefixHit:
        hashes = seq.block_hashes if self.enable_caching else []
        return self.kv.lookup(seq.token_ids, hashes)

    def _reorder_waiting_by_prefix(self) -> None:
        now = time.monotonic()
        window = [
            self.waiting.popleft() for _ in range(min(PREFIX_POLICY_WINDOW, len(self.waiting)))
        ]

        def priority(request: Request) -> float:
            seq = request.live_seqs()[0]
            cached = self._lookup(seq).num_tokens
            return cached + AGING_TOKENS_PER_SECOND * (now - request.arrival_time)

        window.sort(key=priority, reverse=True)
        self.waiting.extendleft(reversed(window))

    def _preempt(self, request: Request) -> None:
        for seq in request.seqs:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted request %s", request.request_id)

    # ---- after the forward --------------------------------------------------------------------

    def update_computed(self, out: SchedulerOutput) -> int:
        """After the forward: advance ``num_computed_tokens`` of every scheduled sequence.

        Returns how many prompt tokens (not generated ones) this step computed.
        """
        prompt_tokens = 0
        for sched in out.scheduled:
            seq = sched.seq
            start = seq.num_computed_tokens
            seq.num_computed_tokens += sched.num_new_tokens
            prompt_tokens += max(0, min(seq.num_prompt_tokens, seq.num_computed_tokens) - start)
        return prompt_tokens

    def _cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the sequence's blocks that are full once this step's tokens are written.

        Done at scheduling time, so a request admitted later in the same step already hits them:
        within one forward every layer stores the whole batch's K/V before any query reads it.
        """
        if self.enable_caching:
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.block_hashes, num_tokens)

    def append_token(self, request: Request, seq: Sequence, token_id: int) -> None:
        seq.token_ids.append(token_id)
        self._hash_new_blocks(request, seq)

    def _hash_new_blocks(self, request: Request, seq: Sequence) -> None:
        if self.enable_caching:
            extend_block_hashes(
                seq.token_ids, self.block_size, request.extra_keys, seq.block_hashes
            )
