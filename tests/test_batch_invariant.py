"""``batch_invariant``: a request's tokens and logprobs are bit-identical alone and inside batches
of 2, 5 and 8 other requests (which also changes how its prompt is chunked and which steps are
mixed), after its prefix was cached by another request, compiled or not; what it cannot promise
it refuses."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint

from prefixserve import LLM, SamplingParams
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")

# a small token budget: the probe's prompt is chunked differently in every batch
ENGINE = {"batch_invariant": True, "block_size": 8, "num_kv_blocks": 256,
          "max_num_batched_tokens": 40, "max_num_seqs": 16}  # fmt: skip
PROBE = [3 + (7 * i) % 200 for i in range(57)]
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, logprobs=5, ignore_eos=True)


def _others(n: int, seed: int) -> list[list[int]]:
    return [[(seed * 31 + i * 17 + j * 5) % 250 + 1 for j in range(9 + 13 * i)] for i in range(n)]


def _probe(llm: LLM, others: list[list[int]]) -> tuple[list[int], list[dict]]:
    prompts = [*others[: len(others) // 2], PROBE, *others[len(others) // 2 :]]
    out = llm.generate(prompts, PARAMS, use_tqdm=False)[len(others) // 2].outputs[0]
    return out.token_ids, out.logprobs


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_request_is_bit_identical_alone_and_in_any_batch(tmp_path, arch, enforce_eager):
    folder = make_checkpoint(arch, tmp_path / arch, seed=9)
    llm = LLM(str(folder), enforce_eager=enforce_eager, enable_prefix_caching=False, **ENGINE)
    alone = _probe(llm, [])
    for size in (2, 5, 8):
        assert _probe(llm, _others(size, seed=size)) == alone, size


KERNEL_OF = {"int8": "PackedW8A8", "int4": "PackedW4A8", "int4_sym": "PackedW4A8"}


@pytest.mark.parametrize("quantization", ["int8", "int4", "int4_sym"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_quantized_weights_on_int8_activations_are_batch_invariant(tmp_path, arch, quantization):
    """The integer kernels quantize each row on its own and sum in integers: a request's bits do
    not depend on its batch either (compiled; the vocabulary and MoE experts included)."""
    folder = make_checkpoint(arch, tmp_path / arch, seed=12)
    llm = LLM(str(folder), enforce_eager=False, enable_prefix_caching=False,
              quantization=quantization, **ENGINE)  # fmt: skip
    kernels = {type(m).__name__ for m in llm.llm_engine.runner.model.modules()}
    assert KERNEL_OF[quantization] in kernels
    alone = _probe(llm, [])
    for size in (2, 5, 8):
        assert _probe(llm, _others(size, seed=size)) == alone, size


def test_a_cached_prefix_gives_the_same_bits(tmp_path):
    folder = make_checkpoint("qwen2", tmp_path / "qwen2", seed=10)
    llm = LLM(str(folder), **ENGINE)
    alone = _probe(llm, [])
    llm.reset_prefix_cache()
    llm.generate([PROBE[:41] + [9, 9, 9]], PARAMS, use_tqdm=False)  # caches the probe's head
    cached = _probe(llm, _others(3, seed=1))
    assert cached == alone
    assert llm.cache_stats()["prefix_cache_hits"] >= 40


def test_what_cannot_be_invariant_is_refused(tmp_path):
    folder = make_checkpoint("llama", tmp_path / "llama", seed=11)
    with pytest.raises(InvalidArgumentError, match="batch_invariant"):
        LLM(str(folder), batch_invariant=True, dtype="bfloat16", num_kv_blocks=16)
    with pytest.raises(InvalidArgumentError, match="batch_invariant"):
        LLM(str(folder), batch_invariant=True, attention_backend="triton", num_kv_blocks=16)
