"""Partial tails end to end on a random checkpoint: a continuation of a finished request (its
prompt and output resent, then new tokens) recomputes nothing but the previous output's last
token and the new tokens, and samples exactly what an engine without prefix caching samples.
Also with speculative decoding (rejected drafts never enter a tail), n > 1 samples, and after a
step that failed."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint

from prefixserve import LLM, SamplingParams
from prefixserve.core.errors import StepFailedError

BLOCK = 16
NEW = [11, 12, 13, 14, 15]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_checkpoint("llama", tmp_path_factory.mktemp("tail-model"), seed=7))


def _continue(llm: LLM, prompt: list[int], out_len: int):
    """A request, then its continuation: the first output and the continuation's output."""
    first = llm.generate([prompt], _greedy(out_len), use_tqdm=False)[0]
    follow = prompt + list(first.outputs[0].token_ids) + NEW
    return first, follow, llm.generate([follow], _greedy(6), use_tqdm=False)[0]


@pytest.mark.parametrize(
    ("prompt_len", "out_len"),
    [(37, 20), (10, 3), (32, 1), (5, 40)],  # tails: 8, 12 (no full block), none, 12 (output only)
)
def test_a_continuation_computes_only_what_it_adds(model, prompt_len, out_len):
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=64)
    _, follow, second = _continue(llm, _prompt(prompt_len, prompt_len), out_len)
    computed = prompt_len + out_len - 1  # the last sampled token was never fed to the model
    assert second.num_cached_tokens == computed
    stats = llm.cache_stats()
    assert stats["tail_hit_tokens"] == computed % BLOCK
    assert stats["tail_hits"] == (1 if computed % BLOCK else 0)
    plain = LLM(model, block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False)
    expected = plain.generate([follow], _greedy(6), use_tqdm=False)[0]
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert expected.num_cached_tokens == 0 and plain.cache_stats()["tail_blocks"] == 0


def test_a_continuation_with_speculative_decoding_is_exact(model):
    """ngram drafts on a repetitive prompt: some are rejected, none ends up in a tail."""
    prompt = [7, 8, 9, 10] * 9 + [7]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "draft_row_price": 0.0}
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=64, speculative_config=spec)
    first, follow, second = _continue(llm, prompt, 21)
    assert second.num_cached_tokens == len(prompt) + 21 - 1
    plain = LLM(model, block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False)
    expected = plain.generate([prompt], _greedy(21), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected.outputs[0].token_ids
    again = plain.generate([follow], _greedy(6), use_tqdm=False)[0]
    assert second.outputs[0].token_ids == again.outputs[0].token_ids


def test_each_of_n_samples_leaves_its_own_tail(model):
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=64)
    params = SamplingParams(n=3, max_tokens=9, temperature=1.0, seed=1, ignore_eos=True)
    prompt = _prompt(20, 3)
    outs = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert llm.cache_stats()["tail_blocks"] == len({tuple(o.token_ids[:-1]) for o in outs})
    for o in outs:
        follow = prompt + list(o.token_ids) + NEW
        again = llm.generate([follow], _greedy(2), use_tqdm=False)[0]
        assert again.num_cached_tokens == 20 + 9 - 1


def test_a_failed_step_keeps_the_tail_and_the_retry_is_exact(model):
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=64)
    prompt = _prompt(37, 4)
    first = llm.generate([prompt], _greedy(20), use_tqdm=False)[0]
    follow = prompt + list(first.outputs[0].token_ids) + NEW
    engine = llm.llm_engine
    real = engine.runner.execute

    def fail(out):
        engine.runner.execute = real
        raise RuntimeError("device fault")

    engine.runner.execute = fail
    with pytest.raises(StepFailedError):
        llm.generate([follow], _greedy(6), use_tqdm=False)
    stats = llm.cache_stats()
    assert stats["used_blocks"] == 0 and stats["tail_blocks"] == 1
    second = llm.generate([follow], _greedy(6), use_tqdm=False)[0]
    assert second.num_cached_tokens == 37 + 20 - 1
    plain = LLM(model, block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False)
    expected = plain.generate([follow], _greedy(6), use_tqdm=False)[0]
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids


def test_a_continuation_on_the_triton_backend_is_exact(model):
    """The tail copy through the Triton backend's copy kernel (interpreted on CPU)."""
    kw = dict(block_size=8, num_kv_blocks=64)
    llm = LLM(model, attention_backend="triton", **kw)
    _, follow, second = _continue(llm, _prompt(21, 9), 6)
    assert second.num_cached_tokens == 21 + 6 - 1 and llm.cache_stats()["tail_hit_tokens"] == 2
    plain = LLM(model, attention_backend="torch", enable_prefix_caching=False, **kw)
    expected = plain.generate([follow], _greedy(6), use_tqdm=False)[0]
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
