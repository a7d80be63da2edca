"""Compiled CPU decode steps (``prefixserve.runner.compiled_step``) against eager steps on the same
checkpoint: the same tokens and the same logprobs, to the bit (the compiled graph keeps every
reduction in the eager kernels), under prefix caching, chunked prefill, preemption, forks,
grammars and speculation; the graphs compile at start-up and never again; a replayed step is one
graph call from Python, whatever the depth; a failed capture leaves a working eager engine."""

from __future__ import annotations

import collections
import logging
import os
import sys

import pytest
import torch
from checkpoints import make_checkpoint
from torch._dynamo.utils import counters

from prefixserve import LLM, SamplingParams, StructuredOutputsParams
from prefixserve.kernels import cpu_ops
from prefixserve.runner.compiled_step import CompiledStepRunner

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")

# tight on purpose: prompts are prefilled in chunks and sequences are preempted
ENGINE = {"block_size": 8, "num_kv_blocks": 24, "max_num_batched_tokens": 24, "max_num_seqs": 8}


def _pair(folder, **kw) -> tuple[LLM, LLM]:
    compiled = LLM(str(folder), enforce_eager=False, **ENGINE, **kw)
    assert isinstance(compiled.llm_engine.runner.decode_replay, CompiledStepRunner)
    eager = LLM(str(folder), enforce_eager=True, **ENGINE, **kw)
    assert eager.llm_engine.runner.decode_replay is None
    return compiled, eager


def _prompts() -> list[list[int]]:
    system = list(range(100, 130))  # a shared prefix: later prompts hit it in the cache
    return [system + [5 + i, 17, 99 - i] * (1 + i % 3) for i in range(6)]


def _assert_same(compiled: LLM, eager: LLM, prompts, params) -> None:
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (compiled, eager)]
    for c, e in zip(*outs):
        for a, b in zip(c.outputs, e.outputs):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3_moe"])
def engines(request, tmp_path_factory):
    folder = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    return _pair(folder)


def test_greedy_with_caching_chunking_and_preemption_equals_eager(engines):
    compiled, eager = engines
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    before = compiled.llm_engine.runner.decode_replay.replayed_steps
    _assert_same(compiled, eager, _prompts(), params)
    stats = compiled.llm_engine.stats()
    assert stats.decode_replay["replayed_steps"] > before
    assert stats.num_preemptions > 0 and stats.kv_cache["prefix_cache_hits"] > 0


KERNEL_OF = {"int8": "PackedW8A8", "int4": "PackedW4A8", "int4_sym": "PackedW4A8"}


@pytest.mark.parametrize("quantization", ["int8", "int4", "int4_sym"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_quantized_weights_on_int8_activations_equal_eager(tmp_path, arch, quantization):
    """The integer kernels (activations quantized inside the op) in a compiled graph: the same
    bits as eager, the vocabulary matrix and MoE experts included."""
    folder = make_checkpoint(arch, tmp_path / arch, seed=4)
    compiled, eager = _pair(folder, quantization=quantization)
    kernels = {type(m).__name__ for m in compiled.llm_engine.runner.model.modules()}
    assert {"PackedW8A8", KERNEL_OF[quantization]} <= kernels
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    _assert_same(compiled, eager, _prompts(), params)


def test_forked_samples_and_grammars_equal_eager(engines):
    compiled, eager = engines
    forks = SamplingParams(n=3, max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    _assert_same(compiled, eager, _prompts()[:3], forks)
    choice = StructuredOutputsParams(choice=["alpha beta", "gamma", "delta epsilon zeta"])
    grammar = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=choice)
    _assert_same(compiled, eager, _prompts()[:4], grammar)


def test_speculative_decoding_equals_eager(tmp_path):
    folder = make_checkpoint("llama", tmp_path / "llama", seed=4)
    # draft_row_price fixed: both engines draft alike, whatever their steps take
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "draft_row_price": 0.0}  # fmt: skip
    compiled, eager = _pair(folder, speculative_config=spec)
    repeat = [[7, 8, 9, 10] * 6, [3, 4, 5] * 8]  # n-grams the proposer finds
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True)
    _assert_same(compiled, eager, repeat, params)


def test_graphs_compile_at_start_up_and_never_again(tmp_path):
    folder = make_checkpoint("qwen3", tmp_path / "qwen3", seed=5)
    llm = LLM(str(folder), enforce_eager=False, **ENGINE)
    replay = llm.llm_engine.runner.decode_replay
    assert set(replay.capture_seconds) == {"1", f"2-{ENGINE['max_num_seqs']}"}
    compiled_graphs = counters["stats"]["unique_graphs"]
    for batch in (1, 2, 5, 8, 3):  # every batch size, contexts of every length, mixed steps
        prompts = [[11 + i] * (3 + 9 * i) for i in range(batch)]
        params = SamplingParams(max_tokens=6 + batch, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    assert replay.replayed_steps > 0
    assert counters["stats"]["unique_graphs"] == compiled_graphs  # nothing recompiled


def _python_in_replays(llm: LLM) -> list[collections.Counter]:
    """Per replayed step: the Python function calls made inside ``replay`` ("calls"), and those
    of them that dispatch a torch op from Python ("ops": ``torch.ops`` and custom-op frames)."""
    replay, seen = llm.llm_engine.runner.decode_replay, []
    inner = replay.replay

    def counting(*args):
        calls: collections.Counter = collections.Counter()

        def profile(frame, event, arg):
            path = frame.f_code.co_filename
            if event == "call":
                calls["calls"] += 1
                calls["ops"] += path.endswith(os.path.join("torch", "_ops.py")) or (
                    os.path.join("torch", "_library") in path
                )

        sys.setprofile(profile)
        try:
            return inner(*args)
        finally:
            sys.setprofile(None)
            seen.append(calls)

    replay.replay = counting
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    del replay.replay
    return seen


def test_a_one_stream_step_is_one_graph_call_whatever_the_depth(tmp_path):
    """A replayed one-stream step enters Python once, for the graph call: no op is dispatched
    from Python inside it (the generated C++ calls every op through the dispatcher) and the
    Python it runs (Dynamo's entry with no guards, the wrapper's argument list) does not grow
    with depth."""
    llms = {}
    for depth in (2, 4):
        folder = make_checkpoint("llama", tmp_path / str(depth), seed=1, num_hidden_layers=depth)
        llms[depth] = LLM(str(folder), enforce_eager=False, **ENGINE)
    seen = {depth: _python_in_replays(llm) for depth, llm in llms.items()}
    for depth, steps in seen.items():
        assert len(steps) == 4, depth  # every decode step of the one stream replayed
        assert all(step["ops"] == 0 for step in steps), depth
    assert seen[2][-1]["calls"] == seen[4][-1]["calls"]


def test_a_failed_capture_leaves_an_eager_engine(tmp_path, monkeypatch, caplog):
    folder = make_checkpoint("llama", tmp_path / "llama", seed=6)

    def broken(self, kv_caches):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(CompiledStepRunner, "capture", broken)
    with caplog.at_level(logging.WARNING, logger="prefixserve.runner.model_runner"):
        llm = LLM(str(folder), enforce_eager=False, **ENGINE)
    assert llm.llm_engine.runner.decode_replay is None
    assert [r.message for r in caplog.records if "eagerly" in r.message]
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.llm_engine.stats().decode_replay is None


def test_other_dtypes_are_not_compiled(tmp_path):
    folder = make_checkpoint("llama", tmp_path / "llama", seed=8)
    llm = LLM(str(folder), enforce_eager=False, dtype="bfloat16", num_kv_blocks=16)
    assert llm.llm_engine.runner.decode_replay is None
    assert torch.bfloat16 == llm.llm_engine.runner.dtype
