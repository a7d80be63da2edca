"""The built-in model ``prefixserve/tiny-random``: a small Llama with seeded random weights.

It exists so that prefixserve runs offline on a fresh machine (tests, demos, benchmarks of the
engine itself). Its weights are random, so the text it writes is meaningless. Everything is built
in code, deterministically, in well under a second: the same weights and tokenizer on every
machine.

Tokenizer: byte-level BPE. Ids 0..255 are the 256 bytes (every UTF-8 string round-trips), then a
fixed merge list built from common English words, then the special tokens. Like Llama 3 it adds
``<|begin_of_text|>`` in front of every encoded text; the ChatML chat template writes it too, so
render the template and tokenize without special tokens (``apply_chat_template`` does).
"""

from __future__ import annotations

import logging

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from prefixserve.models.config import ModelConfig

logger = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "prefixserve/tiny-random"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_SEED = 20240601
_INIT_STD = 0.08
_WORDS = (  # spelled out as merges, space-prefixed and not
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has more will would "
    "if been when what about so out up into who them some could time these two may then do "
    "first any like now my other its than only new also over after most made very use how "
    "way even our system user assistant tool call function name arguments content message "
    "hello world data ing ed er ly tion ment ness"
)

CHAT_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c -%}"
    "{%- for p in c -%}{{ p.text if p.text is defined else '' }}{%- endfor -%}"
    "{%- endif -%}{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "<|im_start|>system\n{% if has_system %}{{ text(messages[0].content) }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures are in <tools></tools>:\n"
    "<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n\n"
    "For each call, answer a JSON object with the function name and arguments inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>{{ \'\\n\' }}'
    "{%- elif has_system -%}"
    "<|im_start|>system\n{{ text(messages[0].content) }}<|im_end|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and has_system -%}"
    "{%- elif m.role == 'assistant' -%}"
    "<|im_start|>assistant\n{{ text(m.content) }}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{% if not loop.first or m.content %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ f.name }}", '
    '"arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}'
    "\n</tool_call>"
    "{%- endfor -%}<|im_end|>{{ '\\n' }}"
    "{%- else -%}"
    "<|im_start|>{{ m.role }}\n{{ text(m.content) }}<|im_end|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)


def _byte_symbols() -> list[str]:
    """The printable character GPT-2's byte-level scheme assigns to each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _merges(byte_symbols: list[str]) -> list[tuple[str, str]]:
    """Left-to-right merges spelling each word, with and without its leading space (``Ġ``)."""
    space = byte_symbols[ord(" ")]
    merges: dict[tuple[str, str], None] = {}
    for word in _WORDS.split():
        for spelled in (word, space + word):
            for i in range(1, len(spelled)):
                merges[(spelled[:i], spelled[i])] = None
    return list(merges)


def builtin_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer with the special tokens and the ChatML chat template."""
    symbols = _byte_symbols()
    merges = _merges(symbols)
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, IM_START, IM_END)])
    # Tool-call tags stay visible in decoded text, so a parser can find them.
    tok.add_tokens([AddedToken(t, special=False) for t in (TOOL_CALL, TOOL_CALL_END)])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=builtin_model_config().max_position_embeddings,
    )


def _vocab_size() -> int:
    symbols = _byte_symbols()
    return len({*symbols, *(a + b for a, b in _merges(symbols))}) + 6


def builtin_model_config() -> ModelConfig:
    """Llama: hidden 256, 4 layers, 4 heads, 2 KV heads; vocab = ``len(builtin_tokenizer())``."""
    vocab = _vocab_size()
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        qk_norm=False,
        eos_token_ids=[vocab - 6 + 1, vocab - 6 + 3],  # <|end_of_text|>, <|im_end|>
        bos_token_id=vocab - 6,
        dtype=torch.float32,
    )


def builtin_weights() -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 CPU tensors drawn from a fixed seed (same on every machine)."""
    c = builtin_model_config()
    gen = torch.Generator().manual_seed(_SEED)
    h, i, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "lm_head.weight": (c.vocab_size, h)}
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    weights = {k: torch.randn(s, generator=gen) * _INIT_STD for k, s in shapes.items()}
    norms = [
        f"model.layers.{n}.{w}"
        for n in range(c.num_hidden_layers)
        for w in ("input_layernorm.weight", "post_attention_layernorm.weight")
    ]
    for name in [*norms, "model.norm.weight"]:
        weights[name] = torch.ones(h)
    return weights
