"""Models: the Llama family, its config, the built-in model and the loader."""

from __future__ import annotations

from prefixserve.models.builtin import BUILTIN_MODEL_NAME, builtin_model_config, builtin_tokenizer
from prefixserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from prefixserve.models.llama import LlamaForCausalLM
from prefixserve.models.loader import load_model, load_tokenizer

__all__ = [
    "BUILTIN_MODEL_NAME",
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "builtin_model_config",
    "builtin_tokenizer",
    "load_model",
    "load_tokenizer",
]
