"""Which draft tokens a decoding sequence proposes this step (the scheduler asks, per sequence).

A sequence speculates when its step reaches its last token (a decode; the last chunk of its
prompt; the text a grammar forced by jump-forward, which runs as one chunk, so the forced text and
the drafts after it are scored in the same step), unless it is an n > 1 prompt sequence about to
fork or the step's batch is at least ``disable_by_batch_size``. Its drafts are capped so that even
if all are accepted, the bonus token still fits the request's length limit (``max_total_tokens``)
and the step's token budget. Under a grammar the drafts are cut at the first token the matcher
refuses, or that would terminate it, and the matcher is rolled back: every draft scored is one the
grammar allows.

Adaptive k: a sequence starts at ``num_speculative_tokens``; after a verification that accepted
``a`` of its drafts it proposes at most ``a + 1`` next time (at least as many as before if it
accepted them all). After ``m`` verifications in a row that accepted nothing it skips the next
``min(2**(m-1), MAX_BACKOFF_STEPS)`` steps' drafts (its text is not copying anything now), so free
text pays little for speculation: one draft now and then.

What the batch pays: a draft adds a row to a step every running sequence waits for. Its ``i``-th
draft is accepted with probability about ``p**i``, ``p`` the sequence's acceptance rate (per
draft, an average over its recent verifications), and buys a token; the row costs the batch
``price`` tokens (``StepCost.row_price`` of a step of that many rows, measured; or the config's
fixed ``draft_row_price``). A sequence
drafts at most the ``k`` with ``p**k >= price``: with one stream rows are nearly free and any
match drafts; in a wide batch only sequences that are copying do.

Suffix drafts (``method="suffix"``) also search the recent outputs of the request's tenant
(``Request.extra_keys``: its ``cache_salt``): one tenant's outputs never draft another's, since
acceptance (visible as latency) would leak them. The indexes are bounded per tenant and across
tenants (``tenant_indexes.py``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from prefixserve.core.sequence import Request, Sequence
from prefixserve.spec_decode.config import SpeculativeConfig
from prefixserve.spec_decode.metrics import SpecDecodeStats
from prefixserve.spec_decode.ngram import match_ngram
from prefixserve.spec_decode.step_cost import FixedStepCost, StepCost
from prefixserve.spec_decode.tenant_indexes import TenantIndexes
from prefixserve.structured_outputs.grammar import Grammar

MAX_BACKOFF_STEPS = 16


ACCEPTANCE_PRIOR = 0.6  # a new sequence's acceptance rate per draft, before it is measured
ACCEPTANCE_DECAY = 0.5  # the weight of the older verifications in the running rate


@dataclass(slots=True)
class _Adaptive:
    """One sequence's draft budget: ``k`` drafts at most, none for ``backoff`` more steps;
    ``acceptance``: its running acceptance rate per draft."""

    k: int
    misses: int = 0  # verifications in a row that accepted nothing
    backoff: int = 0
    acceptance: float = ACCEPTANCE_PRIOR


class DraftProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats(config.method)
        self._adaptive: weakref.WeakKeyDictionary[Sequence, _Adaptive] = weakref.WeakKeyDictionary()
        self.suffix_index = TenantIndexes(
            config.suffix_decoding_max_cached_requests,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.suffix_decoding_max_cached_bytes_per_tenant,
            config.suffix_decoding_max_cached_bytes,
        )
        price = config.draft_row_price
        self.step_cost = StepCost() if price is None else FixedStepCost(price)
        self._row_price: float | None = None  # of the step being scheduled

    def is_enabled(self, num_running_seqs: int) -> bool:
        """Whether sequences speculate in a step that starts with this many running."""
        return num_running_seqs < self.config.disable_by_batch_size

    def begin_step(self, num_running_seqs: int) -> bool:
        """A step with this many running sequences is being scheduled: whether they speculate,
        and (for ``propose``) what a draft row costs the batch in it."""
        self._row_price = self.step_cost.row_price(max(1, num_running_seqs))
        return self.is_enabled(num_running_seqs)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A forward of ``rows`` rows took ``seconds`` (the engine reports every step)."""
        self.step_cost.observe(rows, seconds)

    def propose(
        self, request: Request, seq: Sequence, num_new_tokens: int, max_drafts: int
    ) -> list[int]:
        """Draft tokens to score after ``seq``'s last token in a step that runs ``num_new_tokens``
        of its tokens (possibly none)."""
        reaches_last = num_new_tokens > 0 and num_new_tokens == seq.num_uncomputed_tokens
        if request.is_beam_search or request.awaits_fork or not reaches_last:
            return []
        adaptive = self._adaptive.get(seq)
        if adaptive is not None and adaptive.backoff > 0:
            adaptive.backoff -= 1
            return []
        k = min(
            adaptive.k if adaptive is not None else self.config.num_speculative_tokens,
            max_drafts,
            request.max_total_tokens - seq.num_tokens - 1,
            self._affordable(adaptive.acceptance if adaptive is not None else ACCEPTANCE_PRIOR),
        )
        if k <= 0:
            return []
        cfg = self.config
        n, drafts = match_ngram(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if cfg.method == "suffix":
            tail = seq.token_ids[len(seq.token_ids) - cfg.prompt_lookup_max :]
            n_global, global_drafts = self.suffix_index.lookup(request.extra_keys, tail, k)
            if n_global > n:
                drafts = global_drafts
        if drafts and seq.grammar is not None:
            drafts = _grammar_prefix(seq.grammar, drafts)
        return drafts

    def _affordable(self, acceptance: float) -> int:
        """The most drafts whose last is still worth its row: ``acceptance**k >= price``."""
        price = self._row_price
        if price is None or price <= 0:
            return self.config.num_speculative_tokens
        if acceptance <= price:
            return 0
        if acceptance >= 1:
            return self.config.num_speculative_tokens
        return int(math.log(price) / math.log(acceptance))

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """One verification's outcome (the lifecycle reports it): counters and adaptive k."""
        self.stats.observe(num_drafts, num_accepted)
        if num_drafts == 0:
            return
        adaptive = self._adaptive.setdefault(seq, _Adaptive(self.config.num_speculative_tokens))
        rate = _per_draft_rate(num_drafts, num_accepted)
        adaptive.acceptance = ACCEPTANCE_DECAY * adaptive.acceptance + (1 - ACCEPTANCE_DECAY) * rate
        k = num_accepted + 1
        if num_accepted == num_drafts:
            k = max(k, adaptive.k)
        adaptive.k = min(k, self.config.num_speculative_tokens)
        adaptive.misses = adaptive.misses + 1 if num_accepted == 0 else 0
        if adaptive.misses:
            adaptive.backoff = min(2 ** (adaptive.misses - 1), MAX_BACKOFF_STEPS)

    def remember(self, request: Request) -> None:
        """Index a finished request's outputs for its tenant (``method="suffix"`` only)."""
        if self.config.method != "suffix" or request.error is not None:
            return
        self.suffix_index.add(request.extra_keys, [seq.output_token_ids for seq in request.seqs])

    def snapshot(self) -> dict[str, float | int | str]:
        """The counters (``SpecDecodeStats.snapshot``) and the suffix index's memory (zeros
        with ``method="ngram"``)."""
        return {**self.stats.snapshot(), **self.suffix_index.stats()}


def _per_draft_rate(num_drafts: int, num_accepted: int) -> float:
    """The per-draft rate ``p`` one verification points at: the first rejected draft (if any)
    was accepted with probability ``p**position``; ``p`` estimated as accepted / (accepted + 1),
    and (accepted + 0.5) / (drafts + 0.5) when every draft was accepted."""
    if num_accepted == num_drafts:
        return (num_accepted + 0.5) / (num_drafts + 0.5)
    return num_accepted / (num_accepted + 1)


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
