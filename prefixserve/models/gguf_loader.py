"""Llama-family GGUF files (llama.cpp's format; architectures llama, qwen2, qwen3): config, weights
and tokenizer from one file.

The file is read with the ``gguf`` package (memory-mapped); nothing in it is executed. Its tensors
become Hugging Face named weights, with llama.cpp's reordering of a llama file's q/k rows (made
for its interleaved rope) undone, so ``LlamaForCausalLM.load_weights`` takes them as from
safetensors.

Quantized matrices (the decoder's linears, the token embedding, an untied output) are kept
quantized, in the closest scheme of ``prefixserve.models.quantization`` (unless ``dequantize``):

============================  ==============================================================
GGUF type                     kept as (``gguf_blocks``), the file's values exactly
============================  ==============================================================
Q8_0                          int8, group 32: the file's codes and scales
Q4_0                          int4_sym, group 32: the file's codes and scales
Q4_1                          int4, group 32: the file's codes, scales and mins
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K  ``BlockWeight`` of that type: the file's codes, super-block
                              scales, 6- or 8-bit sub-block scales and mins
F32, F16, BF16, other types   dequantized to the model dtype
============================  ==============================================================

A fused layer (qkv, gate_up) whose parts are kept in different types holds each part in its
own (``linear.Stacked``).
Norms are always dequantized. The tokenizer and its chat template
come from the file's ``tokenizer.ggml.*`` metadata, built by transformers (``gguf_file=``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from prefixserve.core.errors import ModelLoadError, UnsupportedModelError
from prefixserve.models.config import ModelConfig
from prefixserve.models.quantization import QuantizedWeight

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> the Hugging Face architecture it is loaded as
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def is_gguf(model: str | None) -> bool:
    return model is not None and str(model).lower().endswith(".gguf")


class GGUFCheckpoint:
    """One GGUF file: ``config``, ``weights()`` (HF names, float) and ``prequantized``.

    ``prequantized`` maps HF weight names of decoder linears to their quantized form (see the
    module docstring); ``weights()`` yields every tensor, those too, as float values equal to
    what the quantized form stands for.
    """

    def __init__(self, path: str | Path, *, dequantize: bool = False) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # gguf raises ValueError, struct.error, IndexError on bad bytes
            raise ModelLoadError(
                f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e})"
            ) from e
        self.arch = self._field("general.architecture")
        if self.arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {self.arch!r} is not supported; prefixserve loads "
                f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} GGUF files"
            )
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._read_config()
        self.dequantize = dequantize
        self.prequantized: dict[str, QuantizedWeight] = {}

    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise ModelLoadError(f"GGUF file {self.path} lacks metadata {key!r}")
            return default
        return field.contents()

    def _read_config(self) -> ModelConfig:
        a = self.arch
        if f"{a}.rope.scaling.type" in self.reader.fields or "rope_freqs.weight" in self.tensors:
            raise UnsupportedModelError(
                f"{self.path}: GGUF rope scaling is not supported; load the Hugging Face "
                "checkpoint of this model instead"
            )
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._field(f"{a}.vocab_size", len(tokens.data) if tokens else None)
        hf = {
            "architectures": [SUPPORTED_GGUF_ARCHITECTURES[a]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self._field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._field(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._field(f"{a}.attention.head_count_kv", heads),
            "head_dim": self._field(f"{a}.attention.key_length", hidden // heads),
            "rms_norm_eps": self._field(f"{a}.attention.layer_norm_rms_epsilon"),
            "rope_theta": self._field(f"{a}.rope.freq_base", 10000.0),
            "max_position_embeddings": self._field(f"{a}.context_length"),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id", -1),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id", -1),
        }
        hf = {k: v for k, v in hf.items() if v != -1}
        return ModelConfig.from_hf_dict(hf)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 CPU tensor) for every tensor; fills ``prequantized`` on the way."""
        for gguf_name, tensor in self.tensors.items():
            name = self._hf_name(gguf_name)
            kind = tensor.tensor_type.name
            data = np.asarray(tensor.data)
            quantized = None
            if not self.dequantize and name.endswith(_QUANTIZABLE):
                quantized = _keep_quantized(kind, data)
            if quantized is not None:
                values = quantized.dequantize()
            else:
                values = torch.from_numpy(_dequantize(kind, data, tensor.tensor_type))
            perm = self._row_permutation(gguf_name, values.shape[0])
            if perm is not None:
                values = values[perm]
                quantized = None if quantized is None else quantized.index_rows(perm)
            if quantized is not None:
                self.prequantized[name] = quantized
            yield name, values

    def _hf_name(self, gguf_name: str) -> str:
        stem, _, suffix = gguf_name.rpartition(".")
        if stem in _TOP_TENSORS:
            return f"{_TOP_TENSORS[stem]}.{suffix}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
        raise ModelLoadError(f"{self.path}: unexpected tensor {gguf_name!r} for {self.arch}")

    def _row_permutation(self, gguf_name: str, rows: int) -> torch.Tensor | None:
        """llama.cpp stores a llama file's q/k rows of each head as interleaved pairs (row
        ``2i + j`` is HF's row ``j * head_dim / 2 + i``); the index that restores HF's order, or
        None (other tensors; Qwen files, which keep HF's order)."""
        if self.arch != "llama" or not gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            return None
        heads = self.config.num_attention_heads
        if gguf_name.endswith("attn_k.weight"):
            heads = self.config.num_key_value_heads
        return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def gguf_tokenizer(path: str | Path):
    """The tokenizer (with chat template) a GGUF file describes, built by transformers."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds on GGUF tokenizer metadata
        raise ModelLoadError(
            f"cannot build a tokenizer from {path} ({type(e).__name__}: {e})"
        ) from e


# the HF weight names whose GGUF tensors may stay quantized: linears and the vocabulary
_QUANTIZABLE = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def _keep_quantized(kind: str, data: np.ndarray) -> QuantizedWeight | None:
    from prefixserve.models import gguf_blocks as blocks

    if kind in blocks.INT4_TYPES:
        return blocks.read_int4(kind, data)
    if kind in blocks.INT8_TYPES:
        return blocks.read_int8(kind, data)
    if kind in blocks.BLOCK_TYPES:
        return blocks.read_block(kind, data)
    return None


def _dequantize(kind: str, data: np.ndarray, qtype) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return np.array(dequantize(data, qtype), dtype=np.float32)  # a writable copy
    except NotImplementedError as e:
        raise UnsupportedModelError(f"GGUF tensor type {kind} is not supported: {e}") from e
