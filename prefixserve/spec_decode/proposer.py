"""Which draft tokens a decoding sequence proposes this step (the scheduler asks, per sequence).

A sequence speculates when its step reaches its last token (a decode; the last chunk of its
prompt; the text a grammar forced by jump-forward, which runs as one chunk, so the forced text and
the drafts after it are scored in the same step), unless it is an n > 1 prompt sequence about to
fork or the step's batch is at least ``disable_by_batch_size``. Its drafts are capped so that even if all are accepted, the bonus token
still fits the request's length limit (``max_total_tokens``) and the step's token budget. Under a
grammar the drafts are cut at the first token the matcher refuses, or that would terminate it,
and the matcher is rolled back: every draft scored is one the grammar allows.
"""

from __future__ import annotations

from prefixserve.sequence import Request, Sequence
from prefixserve.spec_decode.config import SpeculativeConfig
from prefixserve.spec_decode.metrics import SpecDecodeStats
from prefixserve.spec_decode.ngram import propose_ngram
from prefixserve.structured_outputs.grammar import Grammar


class DraftProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats(config.method)

    def is_enabled(self, num_running_seqs: int) -> bool:
        """Whether sequences speculate in a step that starts with this many running."""
        return num_running_seqs < self.config.disable_by_batch_size

    def propose(
        self, request: Request, seq: Sequence, num_new_tokens: int, max_drafts: int
    ) -> list[int]:
        """Draft tokens to score after ``seq``'s last token in a step that runs ``num_new_tokens``
        of its tokens (possibly none)."""
        reaches_last = num_new_tokens > 0 and num_new_tokens == seq.num_uncomputed_tokens
        if request.is_beam_search or request.awaits_fork or not reaches_last:
            return []
        k = min(
            self.config.num_speculative_tokens,
            max_drafts,
            request.max_total_tokens - seq.num_tokens - 1,
        )
        if k <= 0:
            return []
        cfg = self.config
        drafts = propose_ngram(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if drafts and seq.grammar is not None:
            drafts = _grammar_prefix(seq.grammar, drafts)
        return drafts

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verification's outcome (the lifecycle reports it)."""
        self.stats.observe(num_drafts, num_accepted)


def _grammar_prefix(grammar: Grammar, drafts: list[int]) -> list[int]:
    """The longest prefix of ``drafts`` the grammar accepts without terminating; state unchanged."""
    accepted = 0
    for token_id in drafts:
        if not grammar.accept_token(token_id):
            break
        accepted += 1
        if grammar.is_terminated():
            break
    terminated = accepted > 0 and grammar.is_terminated()
    if accepted:
        grammar.rollback(accepted)
    return drafts[: accepted - 1 if terminated else accepted]
