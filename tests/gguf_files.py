"""Write a Llama GGUF file from a test checkpoint folder (``checkpoints.make_checkpoint``), as
llama.cpp's converter would: its metadata, the built-in tokenizer, q/k rows interleaved for
llama.cpp's rope, and the linear weights in the GGML types asked for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

from prefixserve.models.builtin import builtin_tokenizer

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
          "Qwen3ForCausalLM": "qwen3"}  # fmt: skip
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _interleave_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's q/k rows -> llama.cpp's: in each head, row ``j * hd/2 + i`` moves to ``2i + j``."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    folder: Path,
    path: Path,
    linear_types: dict[str, GGMLQuantizationType] | None = None,
    *,
    architecture: str | None = None,
) -> Path:
    """``linear_types``: GGUF tensor suffix (``attn_q``, ``ffn_down``, ...) -> its type; every
    other tensor is F32. ``architecture``: the file's, by default the checkpoint's."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    architecture = architecture or _ARCHS[cfg["architectures"][0]]
    writer = GGUFWriter(str(path), architecture)
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    _add_tokenizer(writer)
    for name, value in sorted(tensors.items()):
        if name in _TOP:
            gguf_name = _TOP[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_LAYER[rest]}"
        if architecture != "llama":
            pass  # llama.cpp keeps Qwen's q/k rows in HF's order
        elif gguf_name.endswith("attn_q.weight"):
            value = _interleave_rope_rows(value, heads)
        elif gguf_name.endswith("attn_k.weight"):
            value = _interleave_rope_rows(value, kv_heads)
        kind = GGMLQuantizationType.F32
        if gguf_name.endswith(".weight"):  # biases stay F32
            kind = (linear_types or {}).get(gguf_name.split(".")[-2], kind)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, value.astype(np.float32))
        else:
            writer.add_tensor(gguf_name, quantize(value.astype(np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: GGUFWriter) -> None:
    """The built-in byte-level BPE tokenizer as ``tokenizer.ggml.*`` (model ``gpt2``)."""
    tok = builtin_tokenizer()
    backend = json.loads(tok.backend_tokenizer.to_str())
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tok.all_special_tokens)
    added = {t["content"] for t in backend["added_tokens"]}
    types = [
        TokenType.CONTROL
        if t in special
        else TokenType.USER_DEFINED
        if t in added
        else TokenType.NORMAL
        for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(True)
    writer.add_chat_template(tok.chat_template)


# GGUF type -> (bytes per block, byte offsets of its float16 parameters)
BLOCK_LAYOUTS = {
    "Q8_0": (34, [0]),
    "Q4_0": (18, [0]),
    "Q4_1": (20, [0, 2]),
    "Q5_0": (22, [0]),
    "Q5_1": (24, [0, 2]),
    "Q4_K": (144, [0, 2]),
    "Q5_K": (176, [0, 2]),
    "Q6_K": (210, [208]),
}


def random_blocks(kind: str, rows: int, blocks: int, seed: int, fill: int | None = None):
    """uint8 ``[rows, blocks * bytes]`` of GGUF type ``kind``: random (or ``fill``) bytes, its
    float16 parameters drawn from a normal distribution (no inf or NaN)."""
    size, halves = BLOCK_LAYOUTS[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    if fill is not None:
        data[:] = fill
    for at in halves:
        f16 = rng.normal(0, 0.05, (rows, blocks, 1)).astype(np.float16)
        data[..., at : at + 2] = f16.view(np.uint8)
    return data.reshape(rows, -1)
