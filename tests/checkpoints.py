"""Small seeded random Hugging Face checkpoints (safetensors + the built-in tokenizer) for tests,
and the transformers reference model to compare against.

The recipe is ``prefixserve.models.random_checkpoint`` (shared with the bench model); here are
the four tiny architectures, at ``initializer_range`` 0.1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers

from prefixserve.models.random_checkpoint import tokenizer_fields, write_random_checkpoint

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")


def _hf_config(arch: str, max_position_embeddings: int) -> transformers.PretrainedConfig:
    common = {
        **tokenizer_fields(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.1,
        "rms_norm_eps": 1e-6,
    }
    if arch == "llama":  # GQA 2, untied, llama3 rope scaling that bites within 256 positions
        return transformers.LlamaConfig(
            **common,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    if arch == "qwen2":  # qkv bias, tied embeddings
        return transformers.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "qwen3":  # q/k norm, head_dim != hidden / heads
        return transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
        )
    if arch == "qwen3_moe":  # 8 experts top-2 renormalised; layer 1 of 3 keeps a dense MLP
        return transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3},
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if arch == "mistral":  # GQA 4
        return transformers.MistralConfig(
            **common, num_key_value_heads=1, tie_word_embeddings=False, sliding_window=None
        )
    raise ValueError(f"unknown test architecture {arch!r}")


def make_checkpoint(
    arch: str,
    folder: Path | str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    max_position_embeddings: int = 256,
    num_hidden_layers: int | None = None,
) -> Path:
    """Write a tiny random ``arch`` checkpoint (one of ``ARCHS``) plus tokenizer into ``folder``.

    ``max_shard_size`` (e.g. ``"40KB"``) splits the weights into shards with an index file;
    ``num_hidden_layers`` replaces the architecture's depth.
    """
    config = _hf_config(arch, max_position_embeddings)
    if num_hidden_layers is not None:
        config.num_hidden_layers = num_hidden_layers
    return write_random_checkpoint(config, folder, seed=seed, max_shard_size=max_shard_size)


def load_hf_model(folder: Path | str) -> torch.nn.Module:
    """The transformers reference model for a checkpoint folder, float32, eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence forward: ``[len(token_ids), vocab]`` float32 logits."""
    return model(torch.tensor([token_ids])).logits[0].float()


def greedy_logprob_error(llm, hf: torch.nn.Module, prompts: list[list[int]], params) -> float:
    """Generate ``prompts`` greedily with ``llm`` (``params``: temperature 0, ``logprobs=0``),
    assert every token is ``hf``'s argmax given the tokens before it, and return the largest
    difference between a token's logprob and ``hf``'s."""
    worst = 0.0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens = out.outputs[0].token_ids
        ref = torch.log_softmax(hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1 :], dim=-1)
        assert tokens == ref.argmax(-1).tolist()
        for pos, (tok, lp) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            worst = max(worst, abs(lp[tok] - float(ref[pos, tok])))
    return worst


@torch.no_grad()
def hf_generate_no_eos(model: torch.nn.Module, prompt: list[int], max_new: int, **kwargs):
    """transformers' ``generate`` on one prompt with EOS disabled (``max_new`` tokens always).

    EOS is set to an id the model never produces (a ``None`` would be refilled from the
    checkpoint); the explicit attention mask keeps a prompt token equal to ``pad_token_id``.
    """
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = [model.config.vocab_size]
    return model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        generation_config=config,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
