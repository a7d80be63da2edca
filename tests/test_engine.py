"""The engine against transformers: same checkpoint, same greedy tokens, logprobs within 1e-3,
whatever the caching, chunking or preemption."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_generate_no_eos, load_hf_model, make_checkpoint

from prefixserve import LLM, SamplingParams
from prefixserve.core.errors import CacheCapacityError, InvalidArgumentError, PromptTooLongError

BLOCK = 16
PROMPT_LENS = (1, 15, 16, 17, 31, 32, 33, 50)
MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"])
def arch_case(request, tmp_path_factory):
    folder = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return folder, load_hf_model(folder)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _hf_greedy(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    out = hf_generate_no_eos(
        model, prompt, max_new, output_logits=True, return_dict_in_generate=True
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == max_new
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)
    ]
    return tokens, logprobs


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **kw)


def _assert_no_block_in_use(llm: LLM) -> None:
    stats = llm.cache_stats()
    assert stats["used_blocks"] == 0
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]


def test_greedy_matches_transformers(arch_case):
    folder, hf = arch_case
    llm = LLM(str(folder), block_size=BLOCK, num_kv_blocks=256)
    prompts = _prompts(hf.config.vocab_size)
    outs = llm.generate(prompts, _greedy(logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = _hf_greedy(hf, prompt, MAX_NEW)
        comp = out.outputs[0]
        assert comp.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        ours = [lp[t] for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3
        assert comp.finish_reason == "length"
    _assert_no_block_in_use(llm)


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=8),  # every prompt is chunked
        dict(num_kv_blocks=12, max_num_batched_tokens=64),  # so tight that sequences are preempted
        dict(scheduling_policy="prefix", max_num_seqs=3),
    ],
    ids=["no-prefix-cache", "chunked", "preempted", "prefix-policy"],
)
def test_same_tokens_whatever_the_schedule(arch_case, engine_kw):
    folder, hf = arch_case
    shared = _prompts(hf.config.vocab_size, seed=1)[-1]
    prompts = [shared + p for p in _prompts(hf.config.vocab_size, seed=2)[:5]] + _prompts(
        hf.config.vocab_size
    )
    reference = LLM(str(folder), block_size=BLOCK, num_kv_blocks=512).generate(
        prompts, _greedy(), use_tqdm=False
    )
    llm = LLM(str(folder), block_size=BLOCK, **{"num_kv_blocks": 512, **engine_kw})
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    if "num_kv_blocks" in engine_kw:
        assert llm.llm_engine.stats().num_preemptions > 0
    _assert_no_block_in_use(llm)


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(num_kv_blocks=128, block_size=BLOCK)


def test_num_cached_tokens_is_the_block_aligned_shared_prefix(tiny_llm):
    tiny_llm.reset_prefix_cache()
    shared = list(range(100, 100 + 45))  # 2 full blocks + 13 tokens
    first = tiny_llm.generate([shared + [1, 2, 3]], _greedy(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    second = tiny_llm.generate([shared + [4, 5]], _greedy(), use_tqdm=False)[0]
    assert second.num_cached_tokens == 32
    # the same prompt again: everything but the capped last block is cached
    again = tiny_llm.generate([shared + [1, 2, 3]], _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    salted = tiny_llm.generate(
        [shared + [1, 2, 3]], _greedy(cache_salt="tenant-b"), use_tqdm=False
    )[0]
    assert salted.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == first.outputs[0].token_ids


def test_requests_admitted_together_share_the_prefix(tiny_llm):
    """A request admitted in the same step as the one computing the prefix already hits it."""
    tiny_llm.reset_prefix_cache()
    shared = list(range(200, 200 + 64))
    outs = tiny_llm.generate([shared + [i] for i in range(4)], _greedy(), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]


def test_generated_blocks_are_cached_for_the_next_turn(tiny_llm):
    tiny_llm.reset_prefix_cache()
    prompt = list(range(300, 300 + 20))
    out = tiny_llm.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    turn2 = prompt + out.outputs[0].token_ids + [7, 8, 9]
    nxt = tiny_llm.generate([turn2], _greedy(), use_tqdm=False)[0]
    # 20 + 30 = 50 tokens were sent back; the last one's KV was never computed: 3 full blocks
    # and the partial tail of 1 token (prefixserve.kv.partial_tail) are cached
    assert nxt.num_cached_tokens == 49


def test_stop_conditions(tiny_llm):
    prompt = list(range(10, 40))
    base = tiny_llm.generate([prompt], _greedy(), use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    out = tiny_llm.generate([prompt], _greedy(stop_token_ids=[stop_tok]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    out = tiny_llm.generate(
        [prompt], _greedy(stop_token_ids=[stop_tok], min_tokens=MAX_NEW), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == MAX_NEW
    stop_str = base.text[5:8]
    if stop_str:
        out = tiny_llm.generate([prompt], _greedy(stop=[stop_str]), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop_str
        assert stop_str not in out.text and base.text.startswith(out.text)
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 5


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_llm):
    prompt = list(range(50, 70))
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    alone = tiny_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    noise = [list(range(i, i + 25)) for i in range(5)]
    batch = tiny_llm.generate(
        noise + [prompt],
        [SamplingParams(max_tokens=10, temperature=1.0)] * 5 + [params],
        use_tqdm=False,
    )
    assert batch[-1].outputs[0].token_ids == alone


def test_chat_applies_the_template(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "hello"}], _greedy(), use_tqdm=False)[0]
    expected = tiny_llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(expected, "input_ids") or isinstance(expected, dict):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) == MAX_NEW


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=0),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=2.0),
        dict(max_tokens=0),
        dict(logprobs=100),
        dict(stop=[""]),
        dict(presence_penalty=3.0),
        dict(repetition_penalty=0.0),
        dict(min_tokens=5, max_tokens=2),
        dict(stop_token_ids=[-1]),
        dict(cache_salt=""),
        dict(seed="x"),
    ],
)
def test_bad_sampling_params_raise_typed_errors(kwargs):
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(**kwargs)
    assert info.value.param is not None and info.value.param in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=12),
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=0),
        dict(dtype="int8"),
        dict(attention_backend="flash"),
        dict(device="tpu"),
        dict(num_kv_blocks=1),
        dict(scheduling_policy="lifo"),
        dict(max_model_len=0),
    ],
)
def test_bad_llm_arguments_raise_typed_errors(kwargs):
    with pytest.raises(InvalidArgumentError):
        LLM(**kwargs)


def test_bad_prompts_raise_and_leave_the_engine_clean(tiny_llm):
    vocab = tiny_llm.llm_engine.model_config.vocab_size
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        tiny_llm.generate([[vocab + 5]], _greedy(), use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="empty"):
        tiny_llm.generate([[]], _greedy(), use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="maximum context length is"):
        tiny_llm.generate(
            [[1] * (tiny_llm.llm_engine.max_model_len + 1)], _greedy(), use_tqdm=False
        )
    with pytest.raises(PromptTooLongError, match="you requested 4100 tokens"):
        tiny_llm.generate([[1] * 100], SamplingParams(max_tokens=4000), use_tqdm=False)
    with pytest.raises(CacheCapacityError):  # fits the context, never the 128-block cache
        tiny_llm.generate([[1] * 100], SamplingParams(max_tokens=3900, n=2), use_tqdm=False)
    with pytest.raises(InvalidArgumentError):
        tiny_llm.generate([[1, 2], [3]], [_greedy()], use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    _assert_no_block_in_use(tiny_llm)
    assert tiny_llm.generate([[1, 2, 3]], _greedy(), use_tqdm=False)[0].outputs[0].token_ids


# ---- one request's fault fails that request only ------------------------------------------


def _run_all(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _fault_case(tiny_llm, inject, bad_params: SamplingParams | None = None) -> dict:
    engine = tiny_llm.llm_engine
    for rid in ("ok-1", "bad", "ok-2"):
        params = bad_params if rid == "bad" and bad_params is not None else _greedy()
        engine.add_request(rid, list(range(5, 30)), params)
    inject(engine)
    finals = _run_all(engine)
    _assert_no_block_in_use(tiny_llm)
    assert finals["bad"].error and finals["bad"].finished
    for rid in ("ok-1", "ok-2"):
        assert finals[rid].error is None and len(finals[rid].outputs[0].token_ids) == MAX_NEW
    return finals


def test_a_detokenizer_failure_fails_only_its_request(tiny_llm, monkeypatch):
    def inject(engine):
        def boom(token_ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

        monkeypatch.setattr(engine.scheduler.requests["bad"].seqs[0].detokenizer, "update", boom)

    finals = _fault_case(tiny_llm, inject)
    assert "output processing" in finals["bad"].error


@pytest.mark.parametrize("value, where", [(float("nan"), slice(None)), (float("nan"), 5),
                                          (float("inf"), 5), (float("-inf"), 5)])  # fmt: skip
def test_nan_logits_fail_only_their_request(tiny_llm, monkeypatch, value, where):
    """A whole row of NaN, or one NaN or infinite logit in it (the check reads each row's sum)."""

    def inject(engine):
        execute = engine.runner.execute

        def poisoned(out):
            result = execute(out)
            logits = result.logits.clone()
            for i, sched in enumerate(result.samplers):
                if sched.request.request_id == "bad":
                    logits[i, where] = value
            return result._replace(logits=logits)

        monkeypatch.setattr(engine.runner, "execute", poisoned)

    finals = _fault_case(tiny_llm, inject)
    assert "non-finite" in finals["bad"].error


def test_a_sampler_failure_fails_only_its_request(tiny_llm, monkeypatch):
    """The batched sampler raises; the engine retries request by request and isolates the fault."""

    def inject(engine):
        sampler = engine.sampling_step.sampler

        def fragile(logits, metadata):
            if metadata.presence_penalty is not None and bool(
                (metadata.presence_penalty == 0.5).any()
            ):
                raise RuntimeError("injected sampler fault")
            return sampler(logits, metadata)

        monkeypatch.setattr(engine.sampling_step, "sampler", fragile)

    finals = _fault_case(tiny_llm, inject, bad_params=_greedy(presence_penalty=0.5))
    assert "sampling" in finals["bad"].error
