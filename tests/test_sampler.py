"""Sampler: greedy, logprobs, filters (exact masks, statistics), penalties, seeds, banned tokens."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.core.sampling_params import SamplingParams
from prefixserve.sample.logits_processors import apply_penalties, process_logits
from prefixserve.sample.sampler import (
    Sampler,
    apply_top_k,
    filtered_probs,
    min_p_drop_mask,
    top_p_drop_mask,
)
from prefixserve.sample.sampling_metadata import SamplingMetadata

NEG_INF = float("-inf")


def metadata(
    params: list[SamplingParams],
    output_token_ids: list[list[int]] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    banned_token_ids: list[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        output_token_ids or [[] for _ in range(n)],
        prompt_token_ids or [[] for _ in range(n)],
        generators or {},
        banned_token_ids,
        "cpu",
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample_counts(
    logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0
) -> torch.Tensor:
    """Counts of tokens sampled from ``n`` copies of the 1-D ``logits``."""
    torch.manual_seed(seed)
    out = Sampler()(logits.expand(n, -1).contiguous(), metadata([params] * n))
    return torch.bincount(out.sampled_token_ids, minlength=logits.numel())


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(8, 1000, generator=seeded(0)) * 3
    md = metadata([SamplingParams(temperature=0.0, logprobs=k) for k in (0, 1, 5, 5, 0, 2, 3, 5)])
    assert md.all_greedy and md.max_num_logprobs == 5 and md.top_p is None and md.top_k is None
    out = Sampler()(logits, md)
    logprobs = torch.log_softmax(logits, dim=-1)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert (
        out.sampled_token_ids.dtype == torch.int64 and out.sampled_logprobs.dtype == torch.float32
    )
    expected = logprobs.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.sampled_logprobs, expected)
    top = logprobs.topk(5, dim=-1)
    assert out.topk_token_ids is not None and out.topk_logprobs is not None
    assert torch.equal(out.topk_token_ids, top.indices)
    torch.testing.assert_close(out.topk_logprobs, top.values)
    assert bool((out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all())


def test_no_logprobs_requested_gives_no_topk() -> None:
    out = Sampler()(torch.randn(2, 10), metadata([SamplingParams(), SamplingParams(temperature=0)]))
    assert out.topk_token_ids is None and out.topk_logprobs is None


def test_logprobs_ignore_penalties_temperature_and_filters() -> None:
    logits = torch.randn(3, 50, generator=seeded(1))
    params = SamplingParams(temperature=0.3, top_k=3, top_p=0.5, repetition_penalty=2.0, logprobs=2)
    out = Sampler()(logits, metadata([params] * 3, prompt_token_ids=[[1, 2]] * 3))
    logprobs = torch.log_softmax(logits, dim=-1)
    expected = logprobs.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.sampled_logprobs, expected)
    assert out.topk_logprobs is not None
    torch.testing.assert_close(out.topk_logprobs, logprobs.topk(2, dim=-1).values)


PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS = PROBS.log()


def kept(probs: torch.Tensor) -> list[int]:
    return (probs > 0).nonzero().flatten().tolist()


def filtered(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
    """The sampler's unnormalized probabilities after temperature, top-k, top-p and min-p."""
    return filtered_probs(logits, metadata(params), torch.arange(len(params)))


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    [
        (0, 1.0, [0, 1, 2, 3]),
        (2, 1.0, [0, 1]),
        (1, 1.0, [0]),
        (10, 1.0, [0, 1, 2, 3]),
        (0, 0.65, [0, 1]),
        (0, 0.1, [0]),
        (0, 0.95, [0, 1, 2, 3]),
        (3, 0.85, [0, 1, 2]),
        (2, 0.95, [0, 1]),
    ],
)
def test_top_k_top_p_exact_masks(top_k: int, top_p: float, expected: list[int]) -> None:
    order = [3, 1, 0, 2]
    logits = LOGITS[order].unsqueeze(0)  # shuffled: the mask must follow the values
    probs = filtered([SamplingParams(top_k=top_k, top_p=top_p)], logits)[0]
    assert sorted(order[i] for i in kept(probs)) == expected
    # Kept tokens keep their relative probabilities.
    survivors = PROBS[order] * (probs > 0)
    torch.testing.assert_close(probs / probs.sum(), survivors / survivors.sum())


def test_top_k_per_row_with_disabled_rows() -> None:
    logits = LOGITS.expand(3, -1)
    assert torch.equal(apply_top_k(logits, torch.tensor([0, 0, 0])), logits)
    masked = apply_top_k(logits, torch.tensor([0, 1, 3]))
    assert [torch.isfinite(r).nonzero().flatten().tolist() for r in masked] == [
        [0, 1, 2, 3],
        [0],
        [0, 1, 2],
    ]
    params = [SamplingParams(top_k=k, top_p=p) for k, p in ((0, 1.0), (1, 1.0), (3, 0.5))]
    assert [kept(r) for r in filtered(params, logits)] == [[0, 1, 2, 3], [0], [0, 1]]


def reference_top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    ranked, ids = probs.sort(descending=True)
    drop_ranked = (ranked.cumsum(0) - ranked) >= top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(0, ids, drop_ranked)


@pytest.mark.parametrize("scale", [0.1, 8.0])  # flat: falls back to a full sort; peaked: does not
def test_top_p_large_vocab_matches_full_sort(scale: float) -> None:
    logits = torch.randn(4, 5000, generator=seeded(3)) * scale
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.99])
    drop = top_p_drop_mask(probs, top_p)
    for row, p in enumerate(top_p.tolist()):
        expected = (
            reference_top_p_drop(probs[row], p) if p < 1 else torch.zeros(5000, dtype=torch.bool)
        )
        assert torch.equal(drop[row], expected)


@pytest.mark.parametrize(
    ("min_p", "expected"), [(0.0, [0, 1, 2, 3]), (0.3, [0, 1, 2]), (0.6, [0, 1]), (1.0, [0])]
)
def test_min_p_exact_masks(min_p: float, expected: list[int]) -> None:
    probs = PROBS.unsqueeze(0)
    assert kept(~min_p_drop_mask(probs, torch.tensor([min_p]))[0]) == expected
    assert kept(filtered([SamplingParams(min_p=min_p)], LOGITS.unsqueeze(0))[0]) == expected


def test_filters_apply_after_temperature() -> None:
    # At temperature 0.5 the probabilities are ∝ p², so 0.2 and 0.1 fall below 0.3 * max.
    probs = filtered([SamplingParams(temperature=0.5, min_p=0.3)], LOGITS.unsqueeze(0))[0]
    assert kept(probs) == [0, 1]
    torch.testing.assert_close(probs[:2] / probs[:2].sum(), torch.tensor([16 / 25, 9 / 25]))


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        (SamplingParams(top_p=0.65), [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        (SamplingParams(min_p=0.3), [4 / 9, 3 / 9, 2 / 9, 0]),
        (SamplingParams(temperature=0.5), [16 / 30, 9 / 30, 4 / 30, 1 / 30]),
        (SamplingParams(), [0.4, 0.3, 0.2, 0.1]),
    ],
)
def test_sampling_statistics(params: SamplingParams, allowed: list[float]) -> None:
    n = 20000
    counts = sample_counts(LOGITS, params, n)
    expected = torch.tensor(allowed)
    assert bool((counts[expected == 0] == 0).all()), "a filtered token was sampled"
    # 5 standard deviations of a binomial count.
    tolerance = 5 * torch.sqrt(n * expected * (1 - expected)) + 1
    assert bool(((counts - n * expected).abs() <= tolerance).all()), counts


def test_repetition_penalty_as_transformers() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    md = metadata(
        [SamplingParams(repetition_penalty=2.0)],
        output_token_ids=[[1]],
        prompt_token_ids=[[0, 0, 4]],
    )
    expected = torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.25]])
    torch.testing.assert_close(apply_penalties(logits, md), expected)


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(2, 5)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
        SamplingParams(frequency_penalty=-1.0),
    ]
    md = metadata(params, output_token_ids=[[1, 1, 1, 3], [2, 2]], prompt_token_ids=[[0, 4], [0]])
    assert md.repetition_penalty is None
    expected = torch.tensor([[0.0, -2.5, 0.0, -1.5, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(apply_penalties(logits, md), expected)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    out = Sampler()(logits, metadata([params], output_token_ids=[[0]]))
    assert out.sampled_token_ids.tolist() == [1]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_banned_tokens_never_sampled(temperature: float) -> None:
    n = 500
    logits = torch.zeros(n, 6)
    logits[:, 0] = 10.0  # the favourite is banned
    banned = [[0, 5] for _ in range(n)]
    md = metadata([SamplingParams(temperature=temperature)] * n, banned_token_ids=banned)
    torch.manual_seed(0)
    sampled = Sampler()(logits, md).sampled_token_ids
    assert not bool(((sampled == 0) | (sampled == 5)).any())
    assert torch.isinf(process_logits(logits, md)[:, [0, 5]]).all()


def test_empty_banned_lists_take_the_fast_path() -> None:
    md = metadata([SamplingParams(temperature=0.0)] * 2, banned_token_ids=[[], []])
    assert md.banned_token_ids is None and not md.needs_processing


def run_steps(
    rows: list[tuple[SamplingParams, int | None]], logits: list[torch.Tensor]
) -> list[list[int]]:
    """Sample ``len(logits)`` steps; row i uses its own generator when given a seed."""
    generators = {i: seeded(seed) for i, (_, seed) in enumerate(rows) if seed is not None}
    md = metadata([p for p, _ in rows], generators=generators)
    return [Sampler()(step, md).sampled_token_ids.tolist() for step in logits]


def test_seeded_row_same_tokens_alone_or_in_any_batch() -> None:
    vocab, steps = 1000, 20
    base = [torch.randn(vocab, generator=seeded(100 + s)) for s in range(steps)]
    noise = [torch.randn(4, vocab) for _ in range(steps)]
    params = SamplingParams(temperature=1.0, top_p=0.9)
    alone = [t[0] for t in run_steps([(params, 7)], [b.unsqueeze(0) for b in base])]
    again = [t[0] for t in run_steps([(params, 7)], [b.unsqueeze(0) for b in base])]
    assert alone == again
    assert len(set(alone)) > 1  # it does sample
    others = [
        (SamplingParams(temperature=0.7), None),
        (SamplingParams(top_k=5), 3),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(min_p=0.1), None),
    ]
    for position in (0, 2, 4):
        rows = [*others[:position], (params, 7), *others[position:]]
        batch = [
            torch.cat([noise[s][:position], base[s].unsqueeze(0), noise[s][position:]])
            for s in range(steps)
        ]
        assert [t[position] for t in run_steps(rows, batch)] == alone


def test_different_seeds_differ() -> None:
    logits = [torch.zeros(1, 1000)] * 10
    params = SamplingParams()
    assert run_steps([(params, 1)], logits) != run_steps([(params, 2)], logits)


def test_mixed_greedy_and_random_batch() -> None:
    n, vocab = 64, 32000
    logits = torch.randn(n, vocab, generator=seeded(5))
    params = [
        SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_k=3) for i in range(n)
    ]
    md = metadata(params, generators={4: seeded(4)})
    out = Sampler()(logits, md)
    greedy = torch.arange(n) % 2 == 1
    assert torch.equal(out.sampled_token_ids[greedy], logits[greedy].argmax(dim=-1))
    top3 = logits[~greedy].topk(3, dim=-1).indices
    assert bool((top3 == out.sampled_token_ids[~greedy].unsqueeze(1)).any(dim=1).all())


def test_from_params_fast_paths() -> None:
    md = metadata([SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, logprobs=3)])
    assert not md.all_greedy and md.top_k is None and md.min_p is None and md.top_p is not None
    assert md.presence_penalty is md.frequency_penalty is md.repetition_penalty is None
    assert md.temperature.tolist() == [0.0, 1.0] and md.max_num_logprobs == 3


@given(
    data=st.data(),
    n=st.integers(1, 6),
    vocab=st.integers(2, 40),
)
@settings(max_examples=50, deadline=None)
def test_sampled_tokens_survive_every_filter(data: st.DataObject, n: int, vocab: int) -> None:
    params = [
        SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
            top_k=data.draw(st.integers(0, vocab + 2)),
            top_p=data.draw(st.sampled_from([1.0, 0.9, 0.5, 0.05])),
            min_p=data.draw(st.sampled_from([0.0, 0.1, 0.5])),
            presence_penalty=data.draw(st.sampled_from([0.0, 0.5])),
            repetition_penalty=data.draw(st.sampled_from([1.0, 1.3])),
            seed=data.draw(st.one_of(st.none(), st.integers(0, 100))),
        )
        for _ in range(n)
    ]
    outputs = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=5)) for _ in range(n)]
    banned = [
        data.draw(st.lists(st.integers(0, vocab - 1), max_size=vocab - 1, unique=True))
        for _ in range(n)
    ]
    generators = {i: seeded(p.seed) for i, p in enumerate(params) if p.seed is not None}
    md = metadata(params, outputs, [[0]] * n, generators, banned)
    logits = torch.randn(n, vocab, generator=seeded(data.draw(st.integers(0, 1000)))) * 4
    sampled = Sampler()(logits, md).sampled_token_ids
    processed = process_logits(logits, md)
    rows = torch.arange(n)
    allowed = filtered_probs(processed, md, rows) > 0
    for i, p in enumerate(params):
        token = int(sampled[i])
        assert token not in banned[i]
        if p.greedy:
            assert token == int(processed[i].argmax())
        else:
            assert bool(allowed[i, token]), (i, token)
    assert math.isfinite(float(Sampler()(logits, md).sampled_logprobs.sum()))
