"""The whole engine on the Triton backend (interpreted on CPU) gives the torch backend's tokens."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint

from prefixserve import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
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


def test_cascade_engine_matches_transformers(tmp_path, monkeypatch):
    """Shared prefixes, nested (a preamble for all, a document per set), decoded through the
    cascade kernels (forced: at these shapes ``cascade_pays`` never would), give transformers'
    greedy tokens and logprobs."""
    from checkpoints import hf_generate_no_eos, load_hf_model

    from prefixserve.attention import triton_backend

    calls = []
    real = triton_backend.cascade_decode_attention

    def spy(query, *args, **kwargs):
        calls.append(args[4].num_groups)  # the CascadeGroups argument
        return real(query, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "cascade_pays", lambda *_: True)
    monkeypatch.setattr(triton_backend, "cascade_decode_attention", spy)
    folder = make_checkpoint("qwen3", tmp_path / "qwen3")
    hf = load_hf_model(folder)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist()

    preamble, doc_a, doc_b = tokens(64), tokens(64), tokens(64)
    prompts = [preamble + doc_a + tokens(n) for n in (1, 8, 13)]
    prompts += [preamble + doc_b + tokens(n) for n in (5, 9)]
    prompts += [preamble + tokens(30), tokens(20)]
    max_new = 5
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(str(folder), attention_backend="triton", block_size=8, num_kv_blocks=128)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls and max(calls) >= 2  # nested: a group per document set
    for prompt, out in zip(prompts, outs):
        ref = hf_generate_no_eos(
            hf, prompt, max_new, output_logits=True, return_dict_in_generate=True
        )
        comp = out.outputs[0]
        assert comp.token_ids == ref.sequences[0, len(prompt) :].tolist()
        ref_lp = [torch.log_softmax(s[0].float(), -1)[t].item()
                  for s, t in zip(ref.logits, comp.token_ids)]  # fmt: skip
        ours = [lp[t] for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lp)) < 1e-3
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.cache_stats()["used_blocks"] == 0
