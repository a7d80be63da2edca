"""Parallel sampling (n>1) and beam search on forked, copy-on-write sequences."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_generate_no_eos, load_hf_model, make_checkpoint

from prefixserve import LLM, BeamSearchParams, SamplingParams

BLOCK = 8


def _used_blocks_match_live_tables(engine) -> None:
    """Every block in use is held by a live sequence: nothing dropped still holds blocks."""
    usage = engine.kv_usage()
    assert usage.used_blocks == usage.table_blocks


# ---- n > 1 --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return LLM(num_kv_blocks=256, block_size=BLOCK)


def test_parallel_sampling_prefills_once_and_shares_blocks(tiny):
    engine = tiny.llm_engine
    prompt = list(range(100, 100 + 3 * BLOCK + 5))  # 3 full blocks + a partial one
    n = 4
    kv = engine.scheduler.kv
    before = engine.stats().computed_prompt_tokens
    engine.add_request(
        "fork-test", prompt, SamplingParams(n=n, max_tokens=6, temperature=1.0, seed=7)
    )
    engine.step()  # prefill, then the n samples fork
    request = engine.scheduler.requests["fork-test"]
    assert engine.stats().computed_prompt_tokens - before == len(prompt)
    tables = [kv.get_block_table(s.seq_id) for s in request.seqs]
    assert len(tables) == n
    assert all(t == tables[0] for t in tables)  # one table, shared by all samples
    pool = kv.pool
    assert all(pool.blocks[b].ref_cnt == n for b in tables[0])
    engine.step()  # first write into the shared partial block: copy-on-write
    tables = [kv.get_block_table(s.seq_id) for s in request.seqs]
    assert all(t[:3] == tables[0][:3] for t in tables)  # full prompt blocks still shared
    last_blocks = [t[3] for t in tables]
    assert len(set(last_blocks)) == n  # nobody writes a block another sequence holds
    _used_blocks_match_live_tables(engine)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_cache["used_blocks"] == 0


def test_parallel_sampling_is_reproducible_and_in_index_order(tiny):
    prompt = list(range(30, 60))
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11)
    first = tiny.generate([prompt], params, use_tqdm=False)[0]
    busy = tiny.generate(
        [list(range(5, 40)), prompt], [SamplingParams(n=2, max_tokens=8), params], use_tqdm=False
    )
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in busy[1].outputs] == [c.token_ids for c in first.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the samples differ
    # the first sample of an n=3 request is the n=1 request with the same seed
    single = tiny.generate(
        [prompt], SamplingParams(n=1, max_tokens=8, temperature=1.0, seed=11), use_tqdm=False
    )
    assert single[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_preempted_parallel_sampling_gives_the_same_results():
    prompts = [list(range(i, i + 20)) for i in range(0, 60, 10)]
    params = SamplingParams(n=3, max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)
    roomy = LLM(num_kv_blocks=512, block_size=BLOCK).generate(prompts, params, use_tqdm=False)
    tight = LLM(num_kv_blocks=30, block_size=BLOCK)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats().num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in roomy
    ]
    assert tight.cache_stats()["used_blocks"] == 0


# ---- beam search ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3_moe"])
def beam_case(request, tmp_path_factory):
    folder = make_checkpoint(
        request.param, tmp_path_factory.mktemp(f"beam-{request.param}"), seed=3
    )
    return folder, load_hf_model(folder)


def _hf_beams(model, prompt: list[int], width: int, max_new: int) -> list[list[int]]:
    out = hf_generate_no_eos(
        model,
        prompt,
        max_new,
        num_beams=width,
        num_return_sequences=width,
        early_stopping=False,
        length_penalty=1.0,
    )
    return [row[len(prompt) :].tolist() for row in out]


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers(beam_case, width):
    folder, hf = beam_case
    llm = LLM(str(folder), num_kv_blocks=256, block_size=BLOCK)
    gen = torch.Generator().manual_seed(width)
    prompts = [
        torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 8, 13)
    ]
    params = BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True)
    outs = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, outs):
        expected = _hf_beams(hf, prompt, width, 10)
        assert [c.token_ids for c in out.outputs] == expected
        scores = [c.cumulative_logprob for c in out.outputs]
        assert scores == sorted(scores, reverse=True)
    assert llm.cache_stats()["used_blocks"] == 0


def test_dropped_beams_free_their_blocks_during_the_run(tiny):
    engine = tiny.llm_engine
    engine.add_request(
        "beams", list(range(10, 30)), BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
        _used_blocks_match_live_tables(engine)
    assert engine.stats().kv_cache["used_blocks"] == 0


def test_preempted_beam_groups_give_the_same_results():
    prompts = [list(range(i, i + 12)) for i in range(0, 50, 10)]
    params = BeamSearchParams(beam_width=3, max_tokens=14, ignore_eos=True)
    roomy = LLM(num_kv_blocks=512, block_size=BLOCK).beam_search(prompts, params)
    tight = LLM(num_kv_blocks=24, block_size=BLOCK)
    outs = tight.beam_search(prompts, params)
    assert tight.llm_engine.stats().num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in roomy
    ]
    assert tight.cache_stats()["used_blocks"] == 0


# ---- beam search: stop strings and stop tokens ------------------------------------------------


def _greedy_beam(llm, prompt, **kw):
    params = BeamSearchParams(beam_width=1, max_tokens=14, **kw)
    return llm.beam_search([prompt], params)[0].outputs


@pytest.mark.parametrize("include", [False, True])
def test_beam_search_ends_a_hypothesis_at_a_stop_string(tiny, include):
    prompt = list(range(40, 60))
    free = _greedy_beam(tiny, prompt, ignore_eos=True)[0]  # one beam: the greedy continuation
    stop = free.text[len(free.text) // 2 :][:2]
    assert stop.strip(), free.text
    start = free.text.find(stop)
    [out] = _greedy_beam(tiny, prompt, ignore_eos=True, stop=[stop],
                         include_stop_str_in_output=include)  # fmt: skip
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == free.text[: start + (len(stop) if include else 0)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    wide = tiny.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=14,
                                                       ignore_eos=True, stop=stop))[0]  # fmt: skip
    assert all(stop not in c.text for c in wide.outputs)
    assert any(c.stop_reason == stop for c in wide.outputs)


def test_beam_search_stop_token_text_is_left_out(tiny):
    prompt = list(range(70, 90))
    free = _greedy_beam(tiny, prompt, ignore_eos=True)[0]
    k = next(
        i for i in range(2, len(free.token_ids)) if free.token_ids[i] not in free.token_ids[:i]
    )
    stop_id = free.token_ids[k]
    [out] = _greedy_beam(tiny, prompt, stop_token_ids=[stop_id])
    tok = tiny.get_tokenizer()
    assert out.token_ids == free.token_ids[: k + 1] and out.stop_reason == stop_id
    assert out.text == tok.decode(free.token_ids[:k], skip_special_tokens=True)
