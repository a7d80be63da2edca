"""The whole engine on the Triton backend (interpreted on CPU) gives the torch backend's tokens."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint

from prefixserve import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_engine_matches_torch_engine(arch, tmp_path):
    folder = str(make_checkpoint(arch, tmp_path / arch))
    shared = list(range(40, 40 + 20))
    prompts = [shared + [1, 2, 3], shared + [4, 5], list(range(7, 16))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)  # chunked + cache hits
    ref = LLM(folder, attention_backend="torch", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(folder, attention_backend="triton", **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.cache_stats()["used_blocks"] == 0
