"""Speculative decoding end to end: greedy output is token-identical with and without it, in every
mode; drafts are accepted and rejected (a counting checkpoint makes acceptance certain); the KV
cache never keeps a draft's block; sampling keeps plain decoding's distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from prefixserve.core.errors import InvalidArgumentError, StepFailedError
from prefixserve.kv.hashing import extend_block_hashes
from tests.checkpoints import make_checkpoint
from tests.copy_checkpoint import make_counting_checkpoint

torch.set_num_threads(1)

# draft_row_price fixed: which drafts are proposed never depends on how long a step took (a
# measured price on a loaded machine can stop drafting, and the acceptance counts below with it)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "draft_row_price": 0.0}  # fmt: skip
# counts 10..29, jumps to 200, counts on: the model (t -> t + 1) follows the count, while the
# prompt's n-grams propose the jump after 29 and after 209: drafts accepted and rejected.
COUNTING = list(range(10, 30)) + list(range(200, 210)) + list(range(30, 45)) + [5, 6, 7]


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """Mostly counting, but the context moves the argmax at some positions (mix 0.2)."""
    return str(make_counting_checkpoint(tmp_path_factory.mktemp("counting"), mix=0.2))


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    return str(make_checkpoint("llama", tmp_path_factory.mktemp("spec-llama"), seed=1))


def run(model, prompts, params, spec=None, **engine):
    engine.setdefault("num_kv_blocks", 128)
    engine.setdefault("block_size", 4)
    llm = LLM(model, speculative_config=spec, **engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.llm_engine


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_same(model, prompts, params, spec=SPEC, **engine):
    plain, _ = run(model, prompts, params, **engine)
    spec, engine_ = run(model, prompts, params, spec=spec, **engine)
    assert tokens(spec) == tokens(plain)
    return plain, spec, engine_.stats().spec_decode


def test_counting_checkpoint_accepts_and_rejects_drafts_and_stays_exact(counting):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain, _, stats = assert_same(counting, [COUNTING], params)
    out = plain[0].outputs[0].token_ids
    assert out[:22] == list(range(8, 30))  # the model counts, as built
    assert stats["num_accepted_tokens"] > 10
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"]  # the jumps were rejected


def test_speculation_takes_fewer_steps(counting):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    _, plain = run(counting, [COUNTING], params)
    _, spec = run(counting, [COUNTING], params, spec=SPEC)
    assert spec.num_steps < plain.num_steps / 2


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 7},  # chunked prefill; drafts cut to the budget
        {"num_kv_blocks": 24},  # preemption
    ],
    ids=["cached", "uncached", "chunked", "preempting"],
)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_is_exact_in_every_engine_mode(counting, random_llama, engine, method):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [COUNTING, COUNTING[5:], list(range(100, 130)) + [99], [3, 4, 5, 3, 4, 5, 3, 4]]
    spec = dict(SPEC, method=method)
    for model in (counting, random_llama):
        # twice: the suffix method's second round also drafts from the first round's outputs
        assert_same(model, prompts + prompts, params, spec=spec, **engine)


def test_preemption_happened_in_the_tight_cache(counting):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [COUNTING, COUNTING[5:], list(range(100, 130)) + [99]]
    _, engine = run(counting, prompts, params, spec=SPEC, num_kv_blocks=24)
    assert engine.stats().num_preemptions > 0


def test_stops_max_tokens_and_logprobs_are_exact(counting):
    for params in (
        SamplingParams(max_tokens=13, temperature=0.0),  # ends inside an accepted run
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[17]),
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=3),
    ):
        plain, spec, stats = assert_same(counting, [COUNTING], params)
        assert stats["num_accepted_tokens"] > 0
        for p, s in zip(plain[0].outputs, spec[0].outputs):
            assert p.finish_reason == s.finish_reason and p.text == s.text
            if params.logprobs:
                for lp, ls in zip(p.logprobs, s.logprobs):
                    assert lp.keys() == ls.keys()
                    for t in lp:
                        assert lp[t] == pytest.approx(ls[t], abs=1e-4)
            if params.stop_token_ids:
                assert s.token_ids[-1] == 17 and s.finish_reason == "stop"


def test_stop_strings_are_exact(counting):
    plain, _ = run(counting, [COUNTING], SamplingParams(max_tokens=30, temperature=0.0))
    text = plain[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[stop])
    plain, spec, _ = assert_same(counting, [COUNTING], params)
    assert plain[0].outputs[0].text == spec[0].outputs[0].text
    assert plain[0].outputs[0].finish_reason == "stop"


def test_parallel_samples_speculate_per_sequence(counting):
    params = SamplingParams(n=3, max_tokens=30, temperature=0.0)
    _, spec, stats = assert_same(counting, [COUNTING], params)
    assert len(spec[0].outputs) == 3 and stats["num_accepted_tokens"] > 0


@pytest.mark.parametrize("jump_forward", [True, False])
def test_grammar_drafts_are_checked_and_exact(random_llama, jump_forward):
    """Drafts run under the grammar (each row masked as plain decoding masks it); with
    jump-forward, verification stops where plain decoding would append forced text."""
    so = StructuredOutputsParams(regex=r"(ab|cd|ef){40}")  # no early end within max_tokens
    params = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=so)
    prompts = ["abcdefabcdefabcdef abcdefabcdef", "cdcdcdabab efef cdcd"]
    _, spec, stats = assert_same(random_llama, prompts, params, enable_jump_forward=jump_forward)
    assert stats["num_draft_tokens"] > 0
    for o in spec:
        assert o.outputs[0].text and set(o.outputs[0].text) <= set("abcdef")


def test_beam_search_is_refused(counting):
    llm = LLM(counting, num_kv_blocks=64, speculative_config=SPEC)
    with pytest.raises(InvalidArgumentError, match="beam search"):
        llm.beam_search([COUNTING], BeamSearchParams(beam_width=2, max_tokens=4))


def test_no_block_holding_a_rejected_draft_is_cached(counting):
    """Run with many rejections, then serve the prompt + output again from the prefix cache: the
    continuation equals a fresh engine's (a cached draft block would change it), and every cached
    block holds the tokens its hash names."""
    params = SamplingParams(max_tokens=30, temperature=0.0)
    llm = LLM(counting, num_kv_blocks=128, block_size=4, speculative_config=SPEC)
    first = llm.generate([COUNTING], params, use_tqdm=False)[0]
    again = COUNTING + first.outputs[0].token_ids
    second = llm.generate([again], params, use_tqdm=False)[0]
    fresh, _ = run(counting, [again], params, enable_prefix_caching=False)
    assert second.num_cached_tokens > len(COUNTING)
    assert second.outputs[0].token_ids == fresh[0].outputs[0].token_ids
    full = again + second.outputs[0].token_ids  # every token either request ever kept
    hashes: list = []
    extend_block_hashes(full, 4, (), hashes)
    chain = {h: tuple(full[i * 4 : (i + 1) * 4]) for i, h in enumerate(hashes)}
    pool = llm.llm_engine.scheduler.kv.pool
    assert pool._hash_to_block
    for block_hash, block in pool._hash_to_block.items():
        assert chain[block_hash] == block.token_ids


def test_large_batches_do_not_speculate(counting):
    spec = dict(SPEC, disable_by_batch_size=2)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    _, engine = run(counting, [COUNTING] * 3, params, spec=spec)
    assert engine.stats().spec_decode["num_drafts"] == 0
    _, engine = run(counting, [COUNTING], params, spec=spec)
    assert engine.stats().spec_decode["num_drafts"] > 0


def chi_squared(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-squared statistic over the categories seen, and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    cats = set(a) | set(b)
    for c in cats:
        x, y = a[c], b[c]
        stat += (math.sqrt(nb / na) * x - math.sqrt(na / nb) * y) ** 2 / (x + y)
    return stat, len(cats) - 1


def test_sampling_keeps_the_plain_distribution(counting):
    """Temperature 4 on the counting checkpoint: the next count has p ~ 0.7, the rest spreads over
    the vocab, so drafts are accepted often and rejected often. Over 1000 seeds, the tokens at
    output positions 1 and 2 (emitted by the rows after an accepted draft) follow the
    same distribution as without speculation: the two-sample chi-squared statistic over
    {the count, any other even token, any other odd token} (2 degrees of freedom) stays below
    13.8, its 0.999 quantile (a correct engine fails 1 run in 1000; accepting a third of the
    drafts it should reject scores about 30)."""
    seeds = range(1000)
    prompt = list(range(10, 60)) + [20]  # drafts 21 22 23 24 from the prompt's last chunk on
    per_seed = [
        SamplingParams(max_tokens=4, temperature=4.0, seed=s, ignore_eos=True) for s in seeds
    ]
    spec = dict(SPEC, disable_by_batch_size=1000)
    plain, _ = run(counting, [prompt] * len(per_seed), per_seed, num_kv_blocks=2048)
    specd, engine = run(counting, [prompt] * len(per_seed), per_seed, spec=spec, num_kv_blocks=2048)
    stats = engine.stats().spec_decode
    assert stats["num_accepted_tokens"] > 100
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"] + 50
    for pos in (1, 2):

        def category(out, pos=pos):
            ids = out.outputs[0].token_ids
            return "count" if ids[pos] == ids[pos - 1] + 1 else ids[pos] % 2

        a = Counter(category(o) for o in plain)
        b = Counter(category(o) for o in specd)
        stat, dof = chi_squared(a, b)
        assert dof == 2 and stat < 13.8, (pos, a, b, stat)


def test_suffix_drafts_from_the_tenants_earlier_outputs_only(counting):
    """The counting model's output here never repeats itself, so a request's own text has no
    draft for it; the same prompt again in the same tenant drafts from the earlier output, while
    another tenant (another cache_salt) gets no draft from it. All outputs stay exact, and the
    drafts do not depend on the steps' times (SPEC fixes ``draft_row_price``)."""
    spec = dict(SPEC, method="suffix", prompt_lookup_min=2)
    llm = LLM(counting, num_kv_blocks=128, block_size=4, speculative_config=spec)
    prompt = [300, 301]

    def generate(salt):
        params = SamplingParams(max_tokens=20, temperature=0.0, cache_salt=salt)
        before = llm.llm_engine.stats().spec_decode["num_accepted_tokens"]
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        return out, llm.llm_engine.stats().spec_decode["num_accepted_tokens"] - before

    first, accepted = generate("tenant-a")
    assert len(set(first)) == len(first) and accepted == 0
    assert generate("tenant-b") == (first, 0)
    for rows, seconds in ((1, 0.06), (8, 0.41)) * 32:  # a loaded machine: rows look dear
        llm.llm_engine.scheduler.proposer.observe_step(rows, seconds)
    again, accepted = generate("tenant-a")
    assert again == first and accepted > 10


def test_prompt_logprobs_with_speculation(counting):
    """The prompt's last chunk speculates; its prompt logprobs are those of plain decoding."""
    params = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=2)
    plain, spec, stats = assert_same(counting, [COUNTING], params)
    assert stats["num_draft_tokens"] > 0
    for p, s in zip(plain[0].prompt_logprobs[1:], spec[0].prompt_logprobs[1:]):
        assert p.keys() == s.keys()
        for t in p:
            assert p[t] == pytest.approx(s[t], abs=1e-4)


def test_failed_speculative_step_leaves_no_draft_block(counting):
    """A step with drafts fails: none of its blocks stays registered, and the retry is exact."""
    params = SamplingParams(max_tokens=30, temperature=0.0)
    llm = LLM(counting, num_kv_blocks=128, block_size=4, speculative_config=SPEC)
    engine = llm.llm_engine
    real, failed = engine.runner.execute, []

    def execute(out):
        if not failed and sum(len(s.draft_token_ids) for s in out.scheduled) >= 3:
            failed.append(out.scheduled[0].seq.num_computed_tokens)  # written before it
            raise RuntimeError("device fault")
        return real(out)

    engine.runner.execute = execute
    with pytest.raises(StepFailedError):
        llm.generate([COUNTING], params, use_tqdm=False)
    assert failed and engine.cache_stats()["used_blocks"] == 0
    registered = {b.block_hash for b in engine.scheduler.kv.pool._hash_to_block.values()}
    assert failed[0] > len(COUNTING)  # it failed while decoding
    assert len(registered) == failed[0] // 4  # nothing past what earlier steps wrote and kept
    fresh, _ = run(counting, [COUNTING], params)
    again = llm.generate([COUNTING], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == fresh[0].outputs[0].token_ids


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    prompts=st.lists(
        st.lists(st.sampled_from([5, 6, 7, 8, 40, 41, 42, 300]), min_size=2, max_size=30),
        min_size=1,
        max_size=3,
    ),
    k=st.integers(1, 6),
    block_size=st.sampled_from([2, 4, 16]),
    budget=st.sampled_from([5, 16, 2048]),
    num_kv_blocks=st.sampled_from([40, 400]),
    n=st.integers(1, 2),
    method=st.sampled_from(["ngram", "suffix"]),
    caching=st.booleans(),
)
def test_greedy_exactness_property(counting, prompts, k, block_size, budget, num_kv_blocks, n,
                                   method, caching):  # fmt: skip
    """Any mix of prompts (a small alphabet, so n-grams repeat), k, block size, token budget,
    cache size, n and method: greedy output equals plain decoding's."""
    spec = dict(SPEC, method=method, num_speculative_tokens=k)
    params = SamplingParams(n=n, max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = {"block_size": block_size, "max_num_batched_tokens": budget,
              "num_kv_blocks": max(num_kv_blocks, 2 * 64 // block_size * len(prompts) * n),
              "enable_prefix_caching": caching}  # fmt: skip
    assert_same(counting, prompts, params, spec=spec, **engine)
