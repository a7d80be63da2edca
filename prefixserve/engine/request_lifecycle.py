"""The state machine of a request's sequences, from queued to finished: the one place that changes
a ``Request`` or ``Sequence`` after it was queued, apart from the scheduler's admission and
preemption bookkeeping (``num_computed_tokens`` reset, status).

After a step (``apply``), in this order per scheduled sequence::

    num_computed_tokens = the step's end                     (the forward wrote its pieces'
                                                              K/V, the reused spans between
                                                              them were copied at admission)
    sampled token(s):  n > 1 first sample -> fork the prompt sequence into n
                       append -> hash the blocks it fills -> advance the grammar
                       -> stops (StopChecker) -> a finished sequence frees its blocks
                       -> under a grammar, the text it forces next (jump-forward), as if sampled
    verified drafts:   append the accepted drafts and the token after them, one by one as above
                       (a stop or forced text ends it early) -> num_computed_tokens += kept drafts
                       -> free the blocks that held only rejected drafts -> register the blocks
                       now full of accepted tokens in the prefix cache
    beam steps:        fork beams chosen twice, free beams not chosen, append each beam's token
    a request whose processing raised: failed alone (``request.error``), its sequences aborted

The lifecycle finishes sequences; the scheduler retires a request from its queues once all of
its sequences are finished (``Scheduler.update_from_output``).
"""

from __future__ import annotations

import itertools
import logging

from prefixserve.core.config import EngineConfig
from prefixserve.core.scheduler_output import ScheduledSeq, SchedulerOutput
from prefixserve.core.sequence import Request, Sequence
from prefixserve.engine.stop_checker import StopChecker
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.sample.beam_search import BeamStep
from prefixserve.sample.sampling_step import SampledToken, SamplingResult, describe_error
from prefixserve.spec_decode.proposer import DraftProposer

logger = logging.getLogger(__name__)


class RequestLifecycle:
    """Appends, hashes, grammar advances, jump-forward, stops, forks and finishes sequences.

    Counters (monotonic): ``computed_prompt_tokens`` (prompt tokens run through the model, not
    served from the prefix cache) and ``generation_tokens``.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        stop_checker: StopChecker,
        proposer: DraftProposer | None = None,
    ) -> None:
        self.kv = kv_cache_manager
        self.proposer = proposer  # told each verification's outcome (metrics)
        self.stop_checker = stop_checker
        self.block_size = kv_cache_manager.block_size
        self.enable_caching = config.enable_prefix_caching
        self.enable_jump_forward = config.enable_jump_forward
        self.computed_prompt_tokens = 0
        self.generation_tokens = 0
        self._seq_ids = itertools.count()

    def register(self, request: Request) -> None:
        """Give a queued request's sequences their ids and block hashes."""
        for seq in request.seqs:
            seq.seq_id = next(self._seq_ids)
            self._hash_new_blocks(request, seq)

    def start_grammar(self, request: Request) -> None:
        """Give the request's first sequence its matcher and append the text the grammar forces
        first (prefilled with the prompt). Raises what the grammar raises."""
        seq = request.seqs[0]
        seq.grammar = request.structured_output.new_grammar()
        if self.enable_jump_forward and not request.is_beam_search:
            self._jump_forward(request, seq)

    def finish(self, request: Request, reason: str | None) -> None:
        """Finish the live sequences with ``reason`` (if given) and free every block (full ones
        stay cached, and each partial last block as a tail). Only ever called after a step's
        forward succeeded or between steps, so every computed token's K/V was written."""
        for seq in request.seqs:
            if reason is not None and not seq.is_finished:
                seq.finish_reason = reason
            self._free(request, seq)

    def apply(self, out: SchedulerOutput, result: SamplingResult) -> list[Request]:
        """Apply one successful step; returns the requests it touched (for their outputs),
        ``out.finished`` included. A request whose processing raises is failed alone."""
        for sched in out.scheduled:
            seq = sched.seq
            for start, n in sched.query_pieces():
                self.computed_prompt_tokens += max(0, min(seq.num_prompt_tokens, start + n) - start)
            seq.num_computed_tokens = sched.end
        touched: dict[str, Request] = {r.request_id: r for r in out.finished}
        for request, first, entries in result.prompt_logprobs:
            scored = request.prompt_logprobs
            assert first <= len(scored), "prompt logprobs arrive in position order"
            scored.extend(entries[len(scored) - first :])  # a recomputed chunk adds nothing new
        updates = [(sched.request, self._append_samples, sched.seq, tokens)
                   for sched, tokens in result.tokens]  # fmt: skip
        updates += [(sched.request, self._append_verified, sched, tokens)
                    for sched, tokens in result.verified]  # fmt: skip
        updates += [(request, self._apply_beam_step, step) for request, step in result.beams]
        failed = list(result.failed)
        for request, apply, *args in updates:
            touched[request.request_id] = request
            try:
                apply(request, *args)
            except Exception as exc:
                failed.append((request, describe_error(exc, "output processing")))
        for request, message in failed:
            touched[request.request_id] = request
            if request.error is None and not request.is_finished:
                logger.error("request %s failed: %s", request.request_id, message)
                request.error = message
                self.finish(request, "abort")
        return list(touched.values())

    # ---- one step's changes --------------------------------------------------------------------

    def _append_samples(self, request: Request, seq: Sequence, tokens: list[SampledToken]) -> None:
        """The sequence's sampled token; n tokens fork an n > 1 request's prompt sequence first.
        Then, under a grammar, the text it forces next (jump-forward)."""
        seqs = [seq] + [self._fork(request, seq) for _ in tokens[1:]]
        for s, token in zip(seqs, tokens):
            self._append_output(request, s, token.token_id, token.logprob, token.top_logprobs)
            if self.enable_jump_forward and s.grammar is not None:
                self._jump_forward(request, s)

    def _append_verified(
        self, request: Request, sched: ScheduledSeq, tokens: list[SampledToken]
    ) -> None:
        """A speculating sequence's tokens: its accepted drafts, then the token sampled after the
        last of them, each appended as if sampled alone. Where plain decoding would stop (a stop)
        or append forced text instead of sampling the next token (jump-forward), the rest is
        dropped, so the output is the one plain decoding makes. The kept drafts' K/V was written
        by the step, so they count as computed; the blocks that held only rejected drafts go back
        to the pool, and the blocks now full of accepted tokens are registered."""
        seq = sched.seq
        num_accepted = len(tokens) - 1
        accepted = [t.token_id for t in tokens[:-1]]
        assert accepted == sched.draft_token_ids[:num_accepted], "accepted drafts come first"
        if self.proposer is not None:
            self.proposer.observe(seq, len(sched.draft_token_ids), num_accepted)
        kept = 0
        for token in tokens:
            self._append_output(request, seq, token.token_id, token.logprob, token.top_logprobs)
            kept += 1
            if seq.is_finished:
                return
            if self.enable_jump_forward and seq.grammar is not None:
                num_tokens = seq.num_tokens
                self._jump_forward(request, seq)
                if seq.is_finished:
                    return
                if seq.num_tokens > num_tokens:  # forced text follows: sampling stops here
                    break
        seq.num_computed_tokens += min(kept, num_accepted)
        self.kv.truncate(seq.seq_id, seq.num_computed_tokens)
        if self.enable_caching:
            self.kv.cache_full_blocks(
                seq.seq_id, seq.token_ids, seq.block_hashes, seq.num_computed_tokens
            )

    def _append_output(
        self,
        request: Request,
        seq: Sequence,
        token_id: int,
        logprob: float,
        top_logprobs: list[tuple[int, float]],
    ) -> None:
        """One generated token: append and hash, advance the grammar, record logprobs, check the
        stops; a sequence that ends is freed at once."""
        self._append_token(request, seq, token_id)
        self.generation_tokens += 1
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            entry = {token_id: logprob}
            for tid, lp in top_logprobs:
                entry.setdefault(tid, lp)
            seq.logprobs.append(entry)
        reason = self.stop_checker.check(request, seq, token_id)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason
            self._free(request, seq)

    def _jump_forward(self, request: Request, seq: Sequence) -> None:
        """Append the tokens the grammar forces next, as if sampled (the next step runs them as
        one prefill chunk). Not for sequences that return logprobs (forced tokens have none);
        at least one token is left to sample before the length limit."""
        if seq.is_finished or seq.logprobs is not None:
            return
        room = request.max_total_tokens - seq.num_tokens - 1
        for token_id in seq.grammar.jump_forward_tokens()[: max(room, 0)]:
            self._append_output(request, seq, token_id, 0.0, [])
            if seq.is_finished:
                return

    def _apply_beam_step(self, request: Request, step: BeamStep) -> None:
        """Fork beams chosen more than once, free those not chosen, append each beam's token."""
        beams = request.live_seqs()
        request.finished_beams = step.finished
        if step.done:
            for seq in beams:
                seq.finish_reason = "length"
                self.kv.free(seq.seq_id)
            return
        chosen: set[int] = set()
        new_beams: list[tuple[Sequence, int, float]] = []
        for parent, token, score in step.continuations:
            if parent.seq_id in chosen:
                new_beams.append((self._fork(request, parent), token, score))
            else:
                chosen.add(parent.seq_id)
                new_beams.append((parent, token, score))
        for seq in beams:
            if seq.seq_id not in chosen:
                seq.finish_reason = "abort"
                self.kv.free(seq.seq_id)
        request.seqs = []
        for rank, (seq, token, score) in enumerate(new_beams):
            seq.index = rank
            seq.cumulative_logprob = score
            self._append_token(request, seq, token)
            request.seqs.append(seq)
        self.generation_tokens += len(new_beams)

    def _fork(self, request: Request, parent: Sequence) -> Sequence:
        """A new sequence of ``request`` sharing every block and all state of ``parent``."""
        child = parent.fork(next(self._seq_ids), index=len(request.seqs))
        self.kv.fork(parent.seq_id, child.seq_id)
        request.seqs.append(child)
        return child

    def _append_token(self, request: Request, seq: Sequence, token_id: int) -> None:
        """Append, hash the blocks it fills, and advance the sequence's grammar (if any)."""
        if seq.grammar is not None and not seq.grammar.accept_token(token_id):
            raise RuntimeError(f"token {token_id} was sampled, but its grammar does not allow it")
        seq.token_ids.append(token_id)
        self._hash_new_blocks(request, seq)

    def _free(self, request: Request, seq: Sequence) -> None:
        """Free a finished sequence's blocks, keeping its partial last block as a tail
        (``prefixserve.kv.partial_tail``): its computed tokens only, never a rejected draft."""
        self.kv.free_keeping_tail(
            seq.seq_id, seq.token_ids, seq.block_hashes, seq.num_computed_tokens, request.extra_keys
        )

    def _hash_new_blocks(self, request: Request, seq: Sequence) -> None:
        if self.enable_caching:
            extend_block_hashes(
                seq.token_ids, self.block_size, request.extra_keys, seq.block_hashes
            )
