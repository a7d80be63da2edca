"""Continuous batching: the policy that decides which requests run, and how many tokens each.

``schedule()`` hands out a token budget (``max_num_batched_tokens``): running requests first, in
priority order, one token per decoding sequence (plus its draft tokens when it speculates,
``prefixserve.spec_decode``) or a chunk of a prompt still being prefilled; then
waiting requests are admitted while the budget, ``max_num_seqs`` and the KV cache allow. A waiting
request starts from its longest cached prefix, so only the rest is computed.

With tiers under the pool (``prefixserve.kv.tiers``), a request whose prefix continues in a
tier waits while its blocks load on the tier worker (started when it is queued); it keeps its
place in line, requests behind it pass, and it is admitted once the load was applied (a failed
load is a miss: those tokens are computed). With segment reuse (``segment_reuse``), a request's
prompt past its prefix hit may continue with segments computed in other prompts: their K/V is
copied at admission (``SchedulerOutput.segment_copies``, all spans at once), a share of each
is recomputed, and its sequence runs the stretches between reused spans as the pieces of one
step (``ScheduledSeq.pieces``), stepping over the spans (``Sequence.reuse_spans``); the
scheduler owns the segment index (``segments``): it plans from it and records each exactly
computed prompt in it. Retention a
request carries (``SamplingParams.kv_retention``) is applied to its prompt once the prompt is computed (so its
first output reports what was granted, ``RequestOutput.kv_retained_tokens``), and to its output
(``include_output``) when it is retired; a pause on a tool call (``ttl_s`` None) only to a reply
that stopped. The sessions it continues (``SamplingParams.kv_resume``) are released when it is
queued. Nothing of a request's retention is hashed again: its blocks' hashes are its own.

When the KV cache runs out for a running request, the lowest-priority running request (the last
one, never one already scheduled this step) is preempted: its blocks are freed (full ones stay
cached) and it goes back to the front of the waiting queue, to be recomputed later, mostly from the
prefix cache. No request is admitted in a step that preempted. A request is admitted or preempted
as a whole group (``n`` samples, beams).

The scheduler owns the queues (``waiting``, ``running``, ``requests``) and admission state
(``num_computed_tokens`` at admission and preemption, ``status``). Every other change to a request
or sequence is ``RequestLifecycle``'s: ``update_from_output()`` hands it the step's result, then
retires the requests whose sequences all finished. A step that failed is undone by
``abandon_step()``.

The scheduler sees the KV cache only through ``KVCacheManager`` and passes block ids on to the
model runner without looking inside them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import CacheCapacityError, InvalidArgumentError
from prefixserve.core.scheduler_output import ScheduledSeq, SchedulerOutput
from prefixserve.core.sequence import Request, RequestStatus, Sequence
from prefixserve.engine.request_lifecycle import RequestLifecycle
from prefixserve.engine.stop_checker import StopChecker
from prefixserve.kv.kv_cache_manager import KVCacheManager, PrefixHit
from prefixserve.kv.segments import SegmentPlan, SegmentReuse
from prefixserve.sample.sampling_step import SamplingResult
from prefixserve.spec_decode.proposer import DraftProposer

logger = logging.getLogger(__name__)

# Prefix-aware order: a request's priority is its cached prefix length in tokens plus this many
# tokens per second waited, so a request without any hit still gets admitted eventually.
AGING_TOKENS_PER_SECOND = 512.0
PREFIX_POLICY_WINDOW = 64

# one sequence's share of a step: (sequence, its tokens to run, draft tokens scored after them,
# the pieces they run as)
_Plan = tuple[Sequence, int, list[int], list[tuple[int, int]]]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Queue sizes (requests), monotonic token counters, and the KV cache's own figures."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    prompt_tokens: int  # received
    computed_prompt_tokens: int  # run through the model (not served from the prefix cache)
    generation_tokens: int
    kv_cache: dict[str, int | float]


@dataclass(frozen=True, slots=True)
class KVUsage:
    """How the live sequences use the KV cache (benchmarks read it after a step).

    ``table_blocks`` counts the distinct blocks in live block tables (it equals ``used_blocks``
    when nothing leaks); ``filled_slots`` the slots holding a computed token, each shared block
    once; ``unshared_blocks`` what the live sequences would hold without sharing.
    """

    used_blocks: int
    table_blocks: int
    filled_slots: int
    unshared_blocks: int
    num_live_seqs: int
    reserved_max_tokens: int  # sum of max_total_tokens over live sequences


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        stop_checker: StopChecker,
        segments: SegmentReuse | None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.segments = segments if config.enable_prefix_caching else None  # segment_reuse
        spec = config.speculative_config
        self.proposer = DraftProposer(spec) if spec is not None else None
        self.lifecycle = RequestLifecycle(config, kv_cache_manager, stop_checker, self.proposer)
        self.block_size = kv_cache_manager.block_size
        self.enable_caching = config.enable_prefix_caching
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self._first_admitted: list[Request] = []  # this step's first admissions (num_cached_tokens)

    # ---- requests ----------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_total_tokens: int, width: int) -> None:
        """Raise ``CacheCapacityError`` if ``width`` sequences of up to ``max_total_tokens``
        tokens sharing a ``num_prompt_tokens``-token prompt could never fit in the cache."""
        bs = self.block_size
        shared = num_prompt_tokens // bs
        needed = shared + width * (math.ceil(max_total_tokens / bs) - shared)
        if needed > self.kv.num_blocks - self.kv.watermark_blocks:
            raise CacheCapacityError(
                f"this request needs up to {needed} KV blocks ({width} sequences of up to "
                f"{max_total_tokens} tokens) but the cache has {self.kv.num_blocks}; lower "
                "max_tokens or n, or give the engine more KV blocks"
            )

    def add_request(self, request: Request) -> None:
        """Queue a validated request whose ``seqs`` holds its one prompt sequence."""
        if request.request_id in self.requests:
            raise InvalidArgumentError(
                f"request_id {request.request_id!r} is already in use", "request_id"
            )
        self.lifecycle.register(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.prompt_tokens += len(request.prompt_token_ids)
        request.kv_retained_tokens = [None] * len(request.kv_retention)
        for retention in request.kv_retention:
            if retention.session is not None:
                self.kv.observe_session(retention.session)
        for session in request.kv_resume:
            self.kv.observe_session(session)  # the gap since its pause: a TTL sample
            self.kv.release(session)  # the new turn reads the blocks; its reply may pause again
        self._start_kv_load(request)  # prefetch from the tiers while it waits in line

    def abort_request(self, request_id: str, error: str | None = None) -> Request | None:
        """Finish a request now (its live sequences with "abort"), failed with ``error`` if
        given; None if unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            request.error = error
            self._finish_request(request, "abort")
        return request

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def release_kv(self, session: str) -> int:
        return self.kv.release(session)

    def rename_kv(self, session: str, name: str) -> None:
        self.kv.rename(session, name)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs()) for r in self.running)

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv.tick()
        self.kv.apply_loads()
        out = SchedulerOutput()
        self._first_admitted.clear()
        budget = self.config.max_num_batched_tokens
        preempted = False
        speculate = self.proposer is not None and self.proposer.begin_step(self.num_running_seqs())
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            plan = self._plan_running(request, budget, speculate)
            while not self._append_slots(plan, out.block_copies):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            for seq, n, drafts, pieces in plan:
                if n > 0:
                    out.scheduled.append(ScheduledSeq(request, seq, n, drafts, _given(seq, pieces)))
                    budget -= n + len(drafts)
            i += 1
        if not preempted:
            self._admit_waiting(out, budget)
        out.block_tables = {s.seq.seq_id: self.kv.get_block_table(s.seq.seq_id)
                            for s in out.scheduled}  # fmt: skip
        return out

    def _plan_running(self, request: Request, budget: int, speculate: bool) -> list[_Plan]:
        """Per live sequence: how many of its tokens run, and the drafts scored after them."""
        plan: list[_Plan] = []
        for seq in request.live_seqs():
            pieces = self._pieces(seq, budget)
            n = sum(k for _, k in pieces)
            drafts = self.proposer.propose(request, seq, n, budget - n) if speculate else []
            plan.append((seq, n, drafts, pieces))
            budget -= n + len(drafts)
        # Beams advance in lockstep: a beam may reach its last token only if all of them do.
        lockstep = request.is_beam_search and len(plan) > 1
        if lockstep and not all(n == seq.num_uncomputed_tokens for seq, n, _, _ in plan):
            plan = [(seq, k, [], [(seq.num_computed_tokens, k)])
                    for seq, n, _, _ in plan
                    for k in (min(n, seq.num_uncomputed_tokens - 1),)]  # fmt: skip
        return plan

    @staticmethod
    def _pieces(seq: Sequence, budget: int) -> list[tuple[int, int]]:
        """The stretches ``(start, n)`` of ``seq`` to run within ``budget`` tokens: from
        ``num_computed_tokens`` on, each ending where a reused span starts (stepped over and
        taken off ``reuse_spans``: its K/V was copied at admission)."""
        pieces: list[tuple[int, int]] = []
        pos, spans = seq.num_computed_tokens, seq.reuse_spans
        while budget > 0:
            while spans and spans[0][0] == pos:
                pos = spans.pop(0)[1]
            stop = spans[0][0] if spans else seq.num_tokens
            n = min(stop - pos, budget)
            if n <= 0:
                break
            pieces.append((pos, n))
            pos, budget = pos + n, budget - n
            if pos < stop:
                break
        return pieces

    def _append_slots(self, plan: list[_Plan], copies: list[tuple[int, int]]) -> bool:
        """Reserve slots for every sequence of a running request's plan; False if one does not fit.

        Drafts get slots like any token, but the blocks registered in the prefix cache now are
        those full of the sequence's own tokens only: a block holding a draft is registered after
        the verifier accepted it (``RequestLifecycle``), never before.

        Copy-on-write copies are appended to ``copies`` as they are decided, even when a later
        sequence of the plan fails: the copied-to block is already in the sequence's table, and a
        retry after a preemption finds it exclusively held and asks for no second copy.
        """
        for seq, n, drafts, pieces in plan:
            if n == 0:
                continue
            end = pieces[-1][0] + pieces[-1][1]
            got = self.kv.append_slots(seq.seq_id, seq.num_computed_tokens,
                                       end - seq.num_computed_tokens + len(drafts))  # fmt: skip
            if got is None:
                return False
            copies.extend(got)
        for seq, n, _, pieces in plan:
            if n > 0:
                self._cache_blocks(seq, pieces[-1][0] + pieces[-1][1])
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        num_seqs = self.num_running_seqs()
        if self.config.scheduling_policy == "prefix":
            self._reorder_waiting_by_prefix()
        held: list[Request] = []  # keep their place in line, let those behind them pass
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not self._start_grammar(request, out):
                if not request.is_finished:  # a finished one already left the queue
                    held.append(self.waiting.popleft())
                continue
            if self._awaits_kv_load(request):
                held.append(self.waiting.popleft())
                continue
            group = request.live_seqs()
            if num_seqs + max(len(group), request.num_samples) > self.config.max_num_seqs:
                break
            admitted = self._admit(request, budget, out)
            if admitted is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            for sched in admitted:
                out.scheduled.append(sched)
                budget -= sched.num_new_tokens
            num_seqs += len(group)
        self.waiting.extendleft(reversed(held))

    def _start_kv_load(self, request: Request) -> None:
        """Ask the tiers for the blocks after the pool's hit (only for a request that reads the
        prefix cache); ``request.kv_load`` says whether it must wait."""
        seq = request.live_seqs()[0]
        use = self.enable_caching and request.num_prompt_logprobs is None
        started = use and self.kv.start_load(request, seq.token_ids, seq.block_hashes)
        request.kv_load = "loading" if started else "done"

    def _awaits_kv_load(self, request: Request) -> bool:
        """Whether the request waits for its blocks from the tiers (a load is started for a
        request requeued since its last one)."""
        if request.kv_load is None:
            self._start_kv_load(request)
        if request.kv_load == "loading":
            if not self.kv.load_finished(request):
                return True
            request.kv_load = "done"
        return False

    def _start_grammar(self, request: Request, out: SchedulerOutput) -> bool:
        """Whether the request's grammar (if any) is ready: its first sequence gets its matcher
        and the text the grammar forces first (prefilled with the prompt). A grammar still
        compiling: False. One that failed to compile, or forced text that ends the output
        (a stop string): False, and the request ends now (``out.finished``)."""
        so, seq = request.structured_output, request.seqs[0]
        if so is None or seq.grammar is not None:
            return True
        if not so.is_ready:
            return False
        try:
            self.lifecycle.start_grammar(request)
        except Exception as exc:
            request.error = str(exc)
        if request.error is not None or seq.is_finished:
            self._finish_request(request, "abort" if request.error else None)
            out.finished.append(request)
            return False
        return True

    def _admit(
        self, request: Request, budget: int, out: SchedulerOutput
    ) -> list[ScheduledSeq] | None:
        """Give every sequence of a waiting request its cached prefix and first chunk, or nothing.

        A prefix ending in a partial tail adds that tail's copy to ``out.block_copies``, reused
        segments their copies to ``out.segment_copies`` (only once the whole request is
        admitted: a rolled-back admission copies nothing). A preempted beam group is recomputed
        up to, not including, each beam's last token; the running path then runs the last
        tokens of all beams in one step (beams move in lockstep).
        """
        admitted: list[ScheduledSeq] = []
        hits: list[int] = []
        tail_copies: list[tuple[int, int]] = []
        segment_copies: list = []
        lockstep = request.is_beam_search and len(request.live_seqs()) > 1
        reused = 0
        for seq in request.live_seqs():
            hit = self._lookup(request, seq)
            plan = self._segment_plan(request, seq, hit.num_tokens)
            spans = [(span.start, span.end) for span in plan.spans] if plan is not None else []
            seq.num_computed_tokens, seq.reuse_spans = hit.num_tokens, spans
            remaining = seq.num_tokens - hit.num_tokens
            if lockstep:
                n = min(remaining - 1, budget)
                pieces = [(hit.num_tokens, n)]
            else:
                pieces = self._pieces(seq, budget)
                n = sum(k for _, k in pieces)
            chunked_out = n < remaining and not self.config.enable_chunked_prefill and not lockstep
            fits = (n > 0 or lockstep) and not chunked_out
            end = pieces[-1][0] + pieces[-1][1] if pieces else hit.num_tokens
            if not fits or not self.kv.allocate_for_prompt(
                seq.seq_id, hit, end - hit.num_tokens, tail_copies, plan, segment_copies
            ):
                self._roll_back([*admitted, ScheduledSeq(request, seq, 0)])
                return None
            admitted.append(ScheduledSeq(request, seq, n, pieces=_given(seq, pieces)))
            reused = plan.num_reused_tokens if plan is not None else 0
            hits.append(hit.num_tokens + reused)
            if plan is not None:  # its blocks before the first reused one are exact
                assert self.segments is not None
                self.segments.admitted(plan)
                bs = self.block_size
                exact = spans[0][0] // bs * bs if spans else seq.num_prompt_tokens
                self.segments.record(seq.token_ids, seq.block_hashes, exact, request.extra_keys)
            budget -= n
        out.block_copies.extend(tail_copies)
        out.segment_copies.extend(segment_copies)
        for sched in admitted:  # only now: a rolled-back admission must register nothing
            self._cache_blocks(sched.seq, sched.end)
        if request.num_cached_tokens is None:  # prompt tokens only: not jump-forward text
            request.num_cached_tokens = min(hits[0], len(request.prompt_token_ids))
            request.num_reused_segment_tokens = reused
            self._first_admitted.append(request)
        return [s for s in admitted if s.num_new_tokens > 0]

    def _segment_plan(self, request: Request, seq: Sequence, start: int) -> SegmentPlan | None:
        """The reused segments of ``seq``'s prompt after ``start`` (its prefix hit), for a
        request that reads the prefix cache with segment reuse on and not opted out (one
        sequence, no beams, chunked prefill on); None otherwise."""
        config = self.config
        use = (self.segments is not None and config.enable_chunked_prefill
               and getattr(request.params, "segment_reuse", None) is not False
               and not request.is_beam_search and request.num_prompt_logprobs is None
               and len(request.live_seqs()) == 1)  # fmt: skip
        if not use:
            return None
        return self.segments.plan(seq.token_ids, start, seq.num_prompt_tokens - 1,
                                  request.extra_keys, config.segment_recompute_ratio,
                                  self.kv.segment_source())  # fmt: skip

    def _roll_back(self, admitted: list[ScheduledSeq]) -> None:
        for sched in admitted:
            self.kv.free(sched.seq.seq_id)
            sched.seq.num_computed_tokens = 0
            sched.seq.reuse_spans = []

    def _lookup(self, request: Request, seq: Sequence) -> PrefixHit:
        """The cached prefix ``seq`` may start from; none for a request that scores its prompt
        (``prompt_logprobs``: a cached block has no logits, so every position is computed).
        Beam groups stop at full blocks: a beam readmitted in lockstep may run no token in its
        first step, so a tail copied for it would not run with that step."""
        use = self.enable_caching and request.num_prompt_logprobs is None
        extra_keys = request.extra_keys if use and not request.is_beam_search else None
        return self.kv.lookup(seq.token_ids, seq.block_hashes if use else [], extra_keys)

    def _reorder_waiting_by_prefix(self) -> None:
        """Sort the head of the queue by cached prefix length plus aging (``prefix`` policy)."""
        now = time.monotonic()
        window = [
            self.waiting.popleft() for _ in range(min(PREFIX_POLICY_WINDOW, len(self.waiting)))
        ]

        def priority(request: Request) -> float:
            cached = self._lookup(request, request.live_seqs()[0]).num_tokens
            return cached + AGING_TOKENS_PER_SECOND * (now - request.arrival_time)

        window.sort(key=priority, reverse=True)
        self.waiting.extendleft(reversed(window))

    def _preempt(self, request: Request) -> None:
        self._requeue(request)
        self.num_preemptions += 1
        logger.debug("preempted request %s", request.request_id)

    def _requeue(self, request: Request) -> None:
        """Free every block of the request and put it at the front of the waiting queue."""
        for seq in request.seqs:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.reuse_spans = []  # planned again at readmission
        request.status = RequestStatus.WAITING
        request.kv_load = None  # its next admission may load from the tiers again
        self.waiting.appendleft(request)

    def abandon_step(self, out: SchedulerOutput) -> None:
        """The step's forward raised, so none of its K/V was written. Unregister every block it
        registered in the prefix cache, and put each request it scheduled back at the front of
        the waiting queue in running order (recomputed, mostly from the cache, when next
        admitted). Requests the step finished before running (``out.finished``) stay finished."""
        self.kv.discard_step()
        scheduled = {id(s.request) for s in out.scheduled}
        for request in reversed([r for r in self.running if id(r) in scheduled]):
            self.running.remove(request)
            self._requeue(request)
        for request in self._first_admitted:  # its first admission did not happen
            request.num_cached_tokens = None
        self._first_admitted.clear()

    def _cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the sequence's blocks that are full once this step's tokens are written.

        Done at scheduling time, so a request admitted later in the same step already hits them:
        within one forward every layer stores the whole batch's K/V before any query reads it.
        The registrations stand once ``update_from_output`` runs; ``abandon_step`` undoes them.
        """
        if self.enable_caching:
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.block_hashes, num_tokens)

    # ---- after the forward --------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: SamplingResult) -> list[Request]:
        """Apply one successful step (``RequestLifecycle.apply``); retire the requests whose
        sequences all finished. Returns the requests it touched, finished ones included."""
        touched = self.lifecycle.apply(out, result)  # registers blocks of accepted drafts too
        self.kv.commit_step()  # the forward wrote this step's K/V: its registrations stand
        for request in touched:
            if not request.is_finished and all(s.is_finished for s in request.seqs):
                self._retire(request)
            elif request.kv_retention and not request.is_finished:
                self._retain(request, retiring=False)
        return touched

    def _finish_request(self, request: Request, reason: str | None) -> None:
        self.lifecycle.finish(request, reason)
        self._retire(request)

    def _retire(self, request: Request) -> None:
        """Take a request whose sequences are all finished out of the queues."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        if request.kv_load == "loading":
            self.kv.cancel_load(request)
        if request.error is None:
            self._retain(request, retiring=True)
        if self.proposer is not None:
            self.proposer.remember(request)  # suffix drafts for the tenant's later requests

    def _retain(self, request: Request, retiring: bool) -> None:
        """Apply the request's retentions not applied yet: to its prompt once it is computed (or
        it retires), ``include_output`` ones to its first sequence's whole text when it retires;
        a pause (``ttl_s`` None: on a tool call) only to a reply that stopped (EOS or a stop
        string), the only kind that can end in a call. Records the tokens each one retained."""
        if not request.kv_retention:
            return
        seq = request.seqs[0]
        prompt_done = retiring or seq.num_computed_tokens >= seq.num_prompt_tokens
        for i, retention in enumerate(request.kv_retention):
            applied = request.kv_retained_tokens[i] is not None
            if applied or not prompt_done or (retention.include_output and not retiring):
                continue
            if retention.ttl_s is None and seq.finish_reason != "stop":
                continue
            end = seq.num_tokens if retention.include_output else seq.num_prompt_tokens
            blocks = self.kv.retain(seq.token_ids[:end], seq.block_hashes, retention)
            request.kv_retained_tokens[i] = blocks * self.block_size

    # ---- figures -------------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            computed_prompt_tokens=self.lifecycle.computed_prompt_tokens,
            generation_tokens=self.lifecycle.generation_tokens,
            kv_cache={**self.kv.stats(), **(self.segments.stats() if self.segments else {})},
        )

    def kv_usage(self) -> KVUsage:
        bs = self.block_size
        filled: dict[int, int] = {}
        unshared = reserved = num_live = 0
        for request in self.running:
            for seq in request.live_seqs():
                num_live += 1
                reserved += request.max_total_tokens
                unshared += math.ceil(seq.num_computed_tokens / bs)
                for i, block_id in enumerate(self.kv.get_block_table(seq.seq_id)):
                    n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                    filled[block_id] = max(filled.get(block_id, 0), n)
        return KVUsage(
            used_blocks=self.kv.stats()["used_blocks"],
            table_blocks=len(filled),
            filled_slots=sum(filled.values()),
            unshared_blocks=unshared,
            num_live_seqs=num_live,
            reserved_max_tokens=reserved,
        )


def _given(seq: Sequence, pieces: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """``ScheduledSeq.pieces``: None for one piece from ``num_computed_tokens`` (the usual)."""
    one = len(pieces) == 1 and pieces[0][0] == seq.num_computed_tokens
    return None if one or not pieces else pieces
