"""Segment reuse end to end on random checkpoints (Llama with llama3 rope scaling, Qwen2, Qwen3):
documents sent again in another order and place reuse their K/V; what is exact stays exact (off,
opted out, nothing found, a 100% recompute share, every later request that reads the prefix
cache); tenants never share; chunking, preemption, forks and the KV tiers hold with reused
segments, and no block leaks."""

from __future__ import annotations

import math

import pytest
import torch
from checkpoints import make_checkpoint

from prefixserve import LLM, SamplingParams

BS = 16
NL = 10  # "\n" in the test tokenizer: a break token
RATIO = 0.15


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(20, 700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOCS = [tokens(100 + i, 60) + [NL] for i in range(5)]
SYSTEM = [710] + tokens(7, 17) + [NL]  # one block and two tokens


def prompt(docs: list[int], question: int) -> list[int]:
    return SYSTEM + [t for d in docs for t in DOCS[d]] + tokens(question, 9)


def reused_of(docs_found: int) -> int:
    return docs_found * (61 - math.ceil(RATIO * 61))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(request.param)
    return str(make_checkpoint(request.param, folder, seed=2, max_position_embeddings=512))


def make(model: str, **kw) -> LLM:
    return LLM(model, **{"block_size": BS, "num_kv_blocks": 96, "max_model_len": 512, **kw})


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1, **kw)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None) -> list:
    return llm.generate(prompts, params or greedy(), use_tqdm=False)


def same(a, b) -> None:
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.token_ids == y.token_ids
        drift = max(abs(p[t] - q[t]) for p, q in zip(x.logprobs, y.logprobs) for t in q)
        assert drift <= 1e-4


def idle(llm: LLM) -> None:
    stats = llm.llm_engine.stats().kv_cache
    assert stats["used_blocks"] == 0, stats


def test_documents_in_another_order_and_place_are_reused(model):
    llm = make(model, segment_reuse=True, segment_recompute_ratio=RATIO)
    plain = make(model)
    first = run(llm, [prompt([0, 1, 2], 1)])[0]
    same(first, run(plain, [prompt([0, 1, 2], 1)])[0])  # nothing to reuse yet: exact
    assert first.num_reused_segment_tokens == 0
    second = run(llm, [prompt([2, 3, 0], 2)])[0]
    assert second.num_reused_segment_tokens == reused_of(2)  # docs 2 and 0; 3 is new
    assert second.num_cached_tokens == BS + reused_of(2)  # the system prompt's block + those
    stats = llm.llm_engine.stats().kv_cache
    assert stats["segment_hits"] == 2 and stats["segment_reused_tokens"] == reused_of(2)
    assert len(second.outputs[0].token_ids) == 6
    idle(llm)


def test_off_opted_out_or_all_recomputed_is_exact(model):
    plain = make(model)
    expected = run(plain, [prompt([0, 1], 1), prompt([1, 0], 2)])
    opted = make(model, segment_reuse=True)
    run(opted, [prompt([0, 1], 1)])
    got = run(opted, [prompt([1, 0], 2)], greedy(segment_reuse=False))[0]
    same(got, expected[1])
    assert got.num_reused_segment_tokens == 0
    whole = make(model, segment_reuse=True, segment_recompute_ratio=1.0)
    run(whole, [prompt([0, 1], 1)])
    got = run(whole, [prompt([1, 0], 2)])[0]
    same(got, expected[1])  # found, and every token recomputed in place
    assert whole.llm_engine.stats().kv_cache["segment_hits"] == 2
    assert got.num_reused_segment_tokens == 0


def test_reused_kv_never_enters_the_prefix_cache(model):
    """A later request that reads the prefix cache exactly (opted out) gets the same tokens as
    on an engine that never reused anything: blocks holding reused K/V were not registered."""
    llm = make(model, segment_reuse=True, segment_recompute_ratio=RATIO)
    plain = make(model)
    run(llm, [prompt([0, 1], 1)])
    second = prompt([1, 0], 2)
    run(llm, [second])
    follow = second + tokens(3, 20)
    got = run(llm, [follow], greedy(segment_reuse=False))[0]
    run(plain, [prompt([0, 1], 1), second])
    same(got, run(plain, [follow])[0])
    first_reused = len(SYSTEM) + math.ceil(RATIO * 61)
    assert got.num_cached_tokens <= first_reused // BS * BS
    idle(llm)


def test_tenants_and_salts_never_share_segments(model):
    llm = make(model, segment_reuse=True)
    run(llm, [prompt([0, 1], 1)], greedy(cache_salt="a"))
    assert run(llm, [prompt([1, 0], 2)], greedy(cache_salt="b"))[0].num_reused_segment_tokens == 0
    assert run(llm, [prompt([1, 0], 2)])[0].num_reused_segment_tokens == 0
    assert run(llm, [prompt([1, 0], 3)], greedy(cache_salt="a"))[0].num_reused_segment_tokens > 0


def test_chunking_does_not_change_a_reused_request(model):
    """Under --batch-invariant a request's tokens and logprobs are bit-identical however its
    prompt is chunked: spans and chunks interleave the same way at any token budget."""
    outs = []
    for budget in (2048, 8):
        llm = make(model, segment_reuse=True, batch_invariant=True, max_num_batched_tokens=budget)
        run(llm, [prompt([0, 1, 2], 1)])
        outs.append(run(llm, [prompt([2, 4, 1], 2)])[0])
        idle(llm)
    assert outs[0].num_reused_segment_tokens == outs[1].num_reused_segment_tokens > 0
    for x, y in zip(outs[0].outputs, outs[1].outputs):
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs


def test_forks_and_preemption_with_reused_segments(model):
    llm = make(model, segment_reuse=True, num_kv_blocks=40)
    run(llm, [prompt([0, 1], 1)])
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=3, ignore_eos=True)
    outs = run(llm, [prompt([1, 0], 2), prompt([0, 1, 3], 3), prompt([3, 1], 4)], sampled)
    assert all(len(c.token_ids) == 24 for o in outs for c in o.outputs)
    assert llm.llm_engine.stats().num_preemptions > 0
    assert outs[0].num_reused_segment_tokens > 0
    idle(llm)


def test_a_host_tier_holds_only_exact_blocks(model):
    llm = make(model, segment_reuse=True, num_kv_blocks=40, kv_offloading_size=0.05)
    run(llm, [prompt([0, 1], 1)])
    second = run(llm, [prompt([1, 0], 2)])[0]
    assert second.num_reused_segment_tokens > 0
    for d in (2, 3, 4):  # unrelated prompts push everything down to the host tier
        run(llm, [SYSTEM + DOCS[d] * 4 + tokens(d, 9)])
    plain = make(model)
    follow = list(second.prompt_token_ids) + list(second.outputs[0].token_ids) + tokens(5, 9)
    run(plain, [prompt([0, 1], 1), list(second.prompt_token_ids)])
    same(run(llm, [follow], greedy(segment_reuse=False))[0], run(plain, [follow])[0])
    idle(llm)
