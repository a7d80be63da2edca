"""``num_cached_tokens`` (``usage.prompt_tokens_details.cached_tokens``) counts prompt tokens found
in the prefix cache and nothing else: never text a grammar forced (jump-forward), never more than
the prompt, whatever the mode."""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from prefixserve.structured_outputs.tool_calls import tool_call_params

BLOCK = 16
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "n": {"type": "integer"}},
    "required": ["city", "n"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
                "required": ["unit"],
            },
        },
    }
]


def _params(mode: str):
    if mode == "json":
        return SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    if mode == "tool":
        return SamplingParams(max_tokens=40, structured_outputs=tool_call_params(TOOLS, None, False))
    if mode == "n2":
        return SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=3, ignore_eos=True)
    if mode == "beam":
        return BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True)
    return SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(block_size=BLOCK, num_kv_blocks=256)


@pytest.mark.parametrize("mode", ["plain", "json", "tool", "n2", "beam"])
@pytest.mark.parametrize("prompt_len", [33, 40, 48])
def test_cached_tokens_never_exceed_the_prompt(llm, mode, prompt_len):
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 400, (prompt_len,), generator=gen).tolist() + [ord(mode[0])]
    llm.reset_prefix_cache()
    run = llm.beam_search if mode == "beam" else llm.generate
    kwargs = {} if mode == "beam" else {"use_tqdm": False}
    first = run([prompt], _params(mode), **kwargs)[0]
    assert first.num_cached_tokens == 0
    for _ in range(2):  # repeats: the prompt and (for forced text) its output are cached now
        out = run([prompt], _params(mode), **kwargs)[0]
        n = len(out.prompt_token_ids)
        assert out.num_cached_tokens <= n
        # every full block of the prompt is a hit; past it only the prompt's own tail counts
        assert out.num_cached_tokens >= (n - 1) // BLOCK * BLOCK
