"""Direct tests of speculative decoding's own decisions: the config, n-gram lookup, which drafts
a sequence proposes (length, budget, grammar), the counters, and the KV cache's truncation."""

from __future__ import annotations

import pytest

from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.core.sequence import Request, Sequence
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.spec_decode.config import SpeculativeConfig
from prefixserve.spec_decode.metrics import SpecDecodeStats
from prefixserve.spec_decode.ngram import match_ngram
from prefixserve.spec_decode.output_index import BYTES_PER_NGRAM, BYTES_PER_TOKEN, OutputIndex
from prefixserve.spec_decode.proposer import DraftProposer, _grammar_prefix
from prefixserve.spec_decode.step_cost import StepCost
from prefixserve.spec_decode.tenant_indexes import TenantIndexes

LARGE = 1 << 30


def test_config_takes_vllms_dict_and_rejects_mistakes():
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3)
    assert EngineConfig().speculative_config is None  # off by default
    for bad in (
        {"method": "eagle", "num_speculative_tokens": 3},
        {"method": "ngram"},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
         "prompt_lookup_max": 2},
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mx": 2},
        {"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_cached_bytes": 0},
        {"method": "suffix", "num_speculative_tokens": 2,
         "suffix_decoding_max_cached_bytes_per_tenant": -1},
        {"method": "ngram", "num_speculative_tokens": 2, "draft_row_price": -0.5},
        {"method": "ngram", "num_speculative_tokens": 2, "draft_row_price": "free"},
        "ngram",
    ):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            EngineConfig(speculative_config=bad)


def test_ngram_takes_the_most_recent_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 8, 7, 2, 3]
    assert match_ngram(tokens, 2, 1, 3)[1] == [8, 7]  # "2 3" last seen at 6, then 8 7
    assert match_ngram(tokens, 9, 1, 3)[1] == [8, 7, 2, 3]  # runs to the end
    assert match_ngram([1, 2, 3, 4, 3], 2, 1, 1)[1] == [4, 3]
    assert match_ngram([5, 6, 7, 8], 3, 1, 3)[1] == []  # no earlier occurrence
    assert match_ngram([1, 2, 1, 2], 3, 3, 3)[1] == []  # no 3-gram match
    assert match_ngram([1, 2, 1, 2], 0, 1, 3)[1] == []


def test_ngram_prefers_longer_matches():
    tokens = [4, 5, 6, 0, 5, 6, 1, 4, 5, 6]
    assert match_ngram(tokens, 1, 1, 3)[1] == [0]  # "4 5 6" at 0 beats "5 6" at 4
    assert match_ngram(tokens, 1, 1, 2)[1] == [1]  # only up to 2-grams: the most recent "5 6"


def _request(tokens, max_total_tokens=100, params=None, n=1):
    params = params or SamplingParams(max_tokens=50, n=n)
    seq = Sequence(index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens))
    return Request("r", None, list(tokens), params, (), max_total_tokens, seqs=[seq]), seq


def test_proposer_caps_drafts_by_length_budget_and_step():
    proposer = DraftProposer(SpeculativeConfig("ngram", 4, 1, 2))
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    request, seq = _request(tokens)
    seq.num_computed_tokens = len(tokens) - 1
    assert proposer.propose(request, seq, 1, 10) == [2, 3, 4, 5]
    assert proposer.propose(request, seq, 1, 2) == [2, 3]  # the step's budget
    assert proposer.propose(request, seq, 0, 10) == []  # the step does not reach the last token
    request.max_total_tokens = len(tokens) + 3
    assert proposer.propose(request, seq, 1, 10) == [2, 3]  # room for the bonus token
    seq.num_computed_tokens = 2  # a prefill chunk that stops short of the last token
    assert proposer.propose(request, seq, 3, 10) == []
    assert proposer.propose(request, seq, len(tokens) - 2, 10) == [2, 3]  # the last chunk


def test_proposer_skips_forking_prompts_and_beams():
    proposer = DraftProposer(SpeculativeConfig("ngram", 4, 1, 2))
    request, seq = _request([1, 2, 1], n=2)
    assert proposer.propose(request, seq, 3, 10) == []
    request, seq = _request([1, 2, 1], params=BeamSearchParams(beam_width=2, max_tokens=4))
    assert proposer.propose(request, seq, 3, 10) == []


def test_batch_size_threshold():
    proposer = DraftProposer(SpeculativeConfig("ngram", 4, disable_by_batch_size=8))
    assert proposer.is_enabled(7) and not proposer.is_enabled(8)


class FakeGrammar:
    """Accepts tokens < 10; token 5 terminates; records its state for the rollback check."""

    def __init__(self):
        self.accepted: list[int] = []

    def accept_token(self, token_id):
        if token_id >= 10 or self.is_terminated():
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self):
        return bool(self.accepted) and self.accepted[-1] == 5

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n :]


def test_grammar_cuts_drafts_and_rolls_back():
    g = FakeGrammar()
    g.accepted = [1]
    assert _grammar_prefix(g, [2, 3, 11, 4]) == [2, 3]  # cut at the refused token
    assert _grammar_prefix(g, [2, 5, 6]) == [2]  # a terminating draft is not scored
    assert _grammar_prefix(g, [12]) == []
    assert g.accepted == [1]  # state unchanged


def test_adaptive_k_follows_recent_acceptance():
    proposer = DraftProposer(SpeculativeConfig("ngram", 5, 1, 2))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    request, seq = _request(tokens)
    seq.num_computed_tokens = len(tokens) - 1
    assert len(proposer.propose(request, seq, 1, 10)) == 5
    proposer.observe(seq, 5, 0)  # all missed: skip one step, then one draft
    assert proposer.propose(request, seq, 1, 10) == []
    assert proposer.propose(request, seq, 1, 10) == [2]
    proposer.observe(seq, 1, 0)  # missed twice in a row: skip two steps
    assert [proposer.propose(request, seq, 1, 10) for _ in range(3)] == [[], [], [2]]
    proposer.observe(seq, 1, 1)  # a hit ends the back-off
    assert proposer.propose(request, seq, 1, 10) == [2, 3]
    proposer.observe(seq, 2, 0)
    assert proposer.propose(request, seq, 1, 10) == []
    assert proposer.propose(request, seq, 1, 10) == [2]
    proposer.observe(seq, 1, 1)  # all accepted: one more
    assert proposer.propose(request, seq, 1, 10) == [2, 3]
    proposer.observe(seq, 2, 2)
    proposer.observe(seq, 3, 3)
    proposer.observe(seq, 4, 4)
    proposer.observe(seq, 5, 5)  # capped at num_speculative_tokens
    assert len(proposer.propose(request, seq, 1, 10)) == 5
    proposer.observe(seq, 5, 2)
    assert len(proposer.propose(request, seq, 1, 10)) == 3
    other_request, other = _request(tokens)
    other.num_computed_tokens = len(tokens) - 1
    assert len(proposer.propose(other_request, other, 1, 10)) == 5  # per sequence


def test_output_index_longest_match_and_eviction():
    index = OutputIndex(max_outputs=2, min_n=1, max_n=3, max_bytes=LARGE)
    index.add([1, 2, 3, 4, 5])
    index.add([9, 2, 3, 7, 8])
    assert index.lookup([0, 2, 3], 2) == (2, [7, 8])  # the newest "2 3"
    assert index.lookup([1, 2, 3], 2) == (3, [4, 5])  # "1 2 3" is longer
    assert index.lookup([6], 2) == (0, [])
    index.add([5, 6, 7])  # forgets the first output and its n-grams
    assert len(index) == 2
    assert index.lookup([1, 2, 3], 2) == (2, [7, 8])  # "2 3" still points at the second
    assert index.lookup([4], 2) == (0, [])
    index.add([4])  # too short to hold an n-gram with a continuation
    assert len(index) == 2


def test_output_index_is_bounded_in_bytes():
    """Issue 30: the index was capped by count only (about 400 MB per tenant by default)."""
    one = OutputIndex(max_outputs=10, min_n=1, max_n=3, max_bytes=LARGE)
    one.add(list(range(50)))
    size = one.nbytes
    assert size == 50 * BYTES_PER_TOKEN + (49 + 48 + 47) * BYTES_PER_NGRAM
    index = OutputIndex(max_outputs=10, min_n=1, max_n=3, max_bytes=2 * size)
    for start in (0, 100, 200):
        index.add(list(range(start, start + 50)))
    assert len(index) == 2 and index.nbytes == 2 * size
    assert index.lookup([3, 4], 2) == (0, [])  # the first output went first
    index.add(list(range(1000)))  # larger than the whole bound: not indexed
    assert len(index) == 2 and index.nbytes == 2 * size


# An output of 5 tokens with 1- to 3-grams: 5 token slots and 4 + 3 + 2 n-grams.
FIVE = 5 * BYTES_PER_TOKEN + 9 * BYTES_PER_NGRAM


def _five(first: int) -> list[int]:
    return list(range(first, first + 5))


def test_tenant_indexes_forget_the_least_recent_tenants_oldest_outputs_first():
    """Issue 30: the index was bounded per tenant only, and a client makes tenants at will."""
    indexes = TenantIndexes(10, 1, 3, tenant_max_bytes=LARGE, max_bytes=5 * FIVE)
    indexes.add("a", [_five(0), _five(10)])
    indexes.add("b", [_five(20)])
    indexes.add("c", [_five(30)])
    assert indexes.lookup("a", [1, 2], 1) == (2, [3])  # a is now the most recent: b, c, a
    assert indexes.nbytes == 4 * FIVE
    indexes.add("c", [_five(40), _five(50)])  # 6 outputs: b (least recent) loses its one
    assert indexes.nbytes == 5 * FIVE
    assert indexes.stats() == {"suffix_index_bytes": 5 * FIVE, "suffix_index_entries": 5,
                               "suffix_index_tenants": 2}  # fmt: skip
    assert indexes.lookup("b", [21, 22], 1) == (0, [])
    indexes.add("a", [_five(60)])  # order c, a: c loses its oldest output only
    assert indexes.lookup("c", [31, 32], 1) == (0, [])
    assert indexes.lookup("c", [41, 42], 1) == (2, [43])
    assert indexes.lookup("a", [1, 2], 1) == (2, [3])
    assert indexes.stats() == {"suffix_index_bytes": 5 * FIVE, "suffix_index_entries": 5,
                               "suffix_index_tenants": 2}  # fmt: skip


def test_tenant_indexes_drop_a_tenant_once_its_outputs_are_gone():
    indexes = TenantIndexes(10, 1, 3, tenant_max_bytes=LARGE, max_bytes=3 * FIVE)
    indexes.add("a", [_five(0)])
    indexes.add("b", [_five(10)])
    indexes.add("c", [_five(20), _five(30)])  # a's only output goes, and a with it
    assert len(indexes) == 2 and indexes.nbytes == 3 * FIVE
    indexes.add("c", [_five(40), _five(50)])  # c's own bound drops its oldest; then b goes
    assert len(indexes) == 1 and indexes.nbytes == 3 * FIVE
    assert indexes.lookup("c", [21, 22], 1) == (0, []) and indexes.lookup("c", [31], 1) == (1, [32])
    assert indexes.lookup("b", [11], 1) == (0, [])


def test_tenant_indexes_bound_each_tenant_and_the_number_of_tenants():
    indexes = TenantIndexes(10, 1, 3, tenant_max_bytes=2 * FIVE, max_bytes=LARGE, max_tenants=2)
    indexes.add("a", [_five(0), _five(10), _five(20)])  # a's own bound: its oldest goes
    assert indexes.nbytes == 2 * FIVE and indexes.lookup("a", [1], 1) == (0, [])
    indexes.add("b", [_five(30)])
    indexes.add("c", [_five(40)])  # a third tenant: a (least recent) goes
    assert indexes.stats() == {"suffix_index_bytes": 2 * FIVE, "suffix_index_entries": 2,
                               "suffix_index_tenants": 2}  # fmt: skip
    indexes.add("d", [[7]])  # too short for an n-gram with a continuation: no tenant held
    assert len(indexes) == 2


def test_tenant_indexes_never_hold_more_than_the_global_bound():
    """A tenant's own bound is capped by the global one, so an output larger than the global
    bound is not indexed and the newest output is never forgotten for room."""
    indexes = TenantIndexes(10, 1, 3, tenant_max_bytes=LARGE, max_bytes=FIVE)
    indexes.add("a", [list(range(100, 106))])  # 6 tokens: larger than FIVE
    assert indexes.stats()["suffix_index_bytes"] == 0 and len(indexes) == 0
    indexes.add("a", [_five(0)])
    indexes.add("b", [_five(10)])
    assert indexes.stats() == {"suffix_index_bytes": FIVE, "suffix_index_entries": 1,
                               "suffix_index_tenants": 1}  # fmt: skip
    assert indexes.lookup("b", [11], 1) == (1, [12])


def test_proposer_snapshot_reports_the_suffix_index():
    proposer = DraftProposer(SpeculativeConfig("suffix", 3, 1, 3))
    done, seq = _request([1, 2])
    seq.token_ids += _five(10)
    proposer.remember(done)
    snap = proposer.snapshot()
    assert snap["num_drafts"] == 0
    assert (snap["suffix_index_bytes"], snap["suffix_index_entries"],
            snap["suffix_index_tenants"]) == (FIVE, 1, 1)  # fmt: skip


def test_suffix_index_is_per_tenant():
    proposer = DraftProposer(SpeculativeConfig("suffix", 3, 1, 2))
    done, seq = _request([1, 2])
    seq.token_ids += [10, 11, 12, 13]
    done.extra_keys = ("salt-a",)
    proposer.remember(done)
    for salt, expected in ((("salt-a",), [12, 13]), (("salt-b",), []), ((), [])):
        request, seq = _request([7, 10, 11])
        request.extra_keys = salt
        seq.num_computed_tokens = 2
        assert proposer.propose(request, seq, 1, 10) == expected


def test_stats_count_verifications_with_drafts():
    stats = SpecDecodeStats("ngram")
    stats.observe(4, 3)
    stats.observe(2, 0)
    stats.observe(0, 0)  # no drafts: not a verification
    snap = stats.snapshot()
    assert (snap["num_drafts"], snap["num_draft_tokens"], snap["num_accepted_tokens"]) == (2, 6, 3)
    assert snap["acceptance_rate"] == 0.5 and snap["mean_acceptance_length"] == 2.5


def test_truncate_frees_blocks_past_the_kept_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4, watermark=0.0)
    hit = kv.lookup([1] * 6, [])
    assert kv.allocate_for_prompt("s", hit, 6)
    assert kv.append_slots("s", 6, 7) == []  # the last token + 6 drafts: positions 6..12
    assert len(kv.get_block_table("s")) == 4
    free_before = kv.pool.num_free_blocks
    kv.truncate("s", 8)  # 1 draft accepted: positions 0..7 kept
    assert len(kv.get_block_table("s")) == 2
    assert kv.pool.num_free_blocks == free_before + 2
    kv.truncate("s", 8)  # idempotent
    assert len(kv.get_block_table("s")) == 2


def test_step_cost_fits_the_weights_and_the_rows():
    cost = StepCost(window=8)
    assert cost.row_price(8) is None  # nothing seen
    for rows in (1, 1, 1):
        cost.observe(rows, 0.020)
    assert cost.row_price(8) is None  # one row count: b undetermined
    for rows, seconds in ((1, 0.020), (5, 0.024), (9, 0.028), (33, 0.052)):
        cost.observe(rows, seconds)  # 19 ms + 1 ms a row
    a, b = cost.fit()
    assert a == pytest.approx(0.019) and b == pytest.approx(0.001)
    assert cost.row_price(1) == pytest.approx(0.001 / 0.020)  # one stream: rows nearly free
    assert cost.row_price(32) == pytest.approx(0.032 / 0.051)  # a wide batch: a row costs a lot


def test_the_batch_price_of_a_row_caps_drafts():
    """A sequence drafts while its acceptance rate to the k-th power covers what a row costs the
    batch: all with one stream, fewer in a wide batch, none when it does not copy."""
    proposer = DraftProposer(SpeculativeConfig("ngram", 5, 1, 3))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    request, seq = _request(tokens)
    seq.num_computed_tokens = len(tokens) - 1
    for rows, seconds in ((1, 0.020), (6, 0.025), (32, 0.051)):
        proposer.observe_step(rows, seconds)  # about 19 ms + 1 ms a row
    assert proposer.begin_step(1)
    assert len(proposer.propose(request, seq, 1, 16)) == 5  # one stream: rows nearly free
    assert proposer.begin_step(16)  # a row costs ~0.46 tokens: 0.6 (the prior) covers one draft
    assert len(proposer.propose(request, seq, 1, 16)) == 1
    proposer.observe(seq, 1, 1)  # the sequence copies: its rate goes up, and its drafts
    proposer.observe(seq, 2, 2)
    assert proposer.begin_step(16)
    assert len(proposer.propose(request, seq, 1, 16)) == 5  # acceptance ~0.9: all affordable


@pytest.mark.parametrize("price, drafts", [(0.0, 5), (0.5, 1), (0.7, 0)])
def test_a_fixed_row_price_ignores_the_steps_times(price, drafts):
    """``draft_row_price`` replaces the measured price: steps that make a row look dear (or
    free) change nothing, so what a sequence drafts does not depend on timing."""
    proposer = DraftProposer(SpeculativeConfig("ngram", 5, 1, 3, draft_row_price=price))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    request, seq = _request(tokens)
    seq.num_computed_tokens = len(tokens) - 1
    for rows, seconds in ((1, 0.001), (6, 0.5), (32, 3.0)):
        proposer.observe_step(rows, seconds)  # measured, a row would cost ~1 token of the step
    for batch in (1, 16):
        assert proposer.begin_step(batch)
        assert len(proposer.propose(request, seq, 1, 16)) == drafts  # prior 0.6: p**k >= price
