"""prefixserve.models.random_checkpoint: the one recipe of the tests' and the bench's models."""

from __future__ import annotations

import torch
import transformers
from safetensors.torch import load_file

from prefixserve.models.builtin import builtin_tokenizer
from prefixserve.models.random_checkpoint import tokenizer_fields, write_random_checkpoint


def _config() -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(  # has biases (q/k/v) and norms
        **tokenizer_fields(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip


def test_tokenizer_fields_are_the_builtin_tokenizers() -> None:
    tok, fields = builtin_tokenizer(), tokenizer_fields()
    assert fields["vocab_size"] == len(tok) and fields["bos_token_id"] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(fields["eos_token_id"]) == ["<|end_of_text|>", "<|im_end|>"]


def test_same_seed_same_weights_other_seed_other_weights(tmp_path) -> None:
    a = load_file(write_random_checkpoint(_config(), tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(write_random_checkpoint(_config(), tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(write_random_checkpoint(_config(), tmp_path / "c", seed=2) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_norms_and_biases_are_spread_and_the_folder_loads(tmp_path) -> None:
    folder = write_random_checkpoint(_config(), tmp_path / "m", seed=0)
    weights = load_file(folder / "model.safetensors")
    norm = weights["model.norm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm)) and 0.5 < norm.mean() < 1.5
    bias = weights["model.layers.0.self_attn.q_proj.bias"]
    assert bias.abs().sum() > 0 and bias.std() < 0.3
    assert (folder / "tokenizer.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.eos_token_id == tokenizer_fields()["eos_token_id"]
