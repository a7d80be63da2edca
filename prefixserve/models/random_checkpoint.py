"""Seeded random-weight Hugging Face checkpoints with the built-in tokenizer.

One recipe for the tests' tiny models (``tests/checkpoints.py``) and the benchmarks' bench model
(``benchmarks/bench_model.py``). A folder it writes loads with ``LLM(model=folder)`` and with
``AutoModelForCausalLM.from_pretrained``. Weights are transformers' own initialization at the
config's ``initializer_range``, then every norm weight ``1 + 0.2 N(0, 1)`` and every bias
``0.1 N(0, 1)``: greedy argmax margins are not razor-thin, and a mis-loaded norm or bias shows
up in the logits. The same config and seed give the same weights, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from prefixserve.models.builtin import builtin_tokenizer

EOS_TOKENS = ("<|end_of_text|>", "<|im_end|>")


def tokenizer_fields() -> dict[str, Any]:
    """The config fields that tie a checkpoint to the built-in tokenizer: ``vocab_size``,
    ``bos_token_id`` and ``eos_token_id`` (end of text and end of turn)."""
    tok = builtin_tokenizer()
    return {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": [tok.convert_tokens_to_ids(t) for t in EOS_TOKENS],
    }


def write_random_checkpoint(
    config: transformers.PretrainedConfig,
    folder: Path | str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """Write a random float32 model of ``config`` (built with ``tokenizer_fields``) and the
    built-in tokenizer into ``folder``. ``max_shard_size`` (e.g. ``"40KB"``) splits the weights
    into shards with an index file."""
    folder = Path(folder)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    builtin_tokenizer().save_pretrained(folder)
    return folder
