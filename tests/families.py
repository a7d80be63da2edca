"""Tokenizer folders (and tiny random checkpoints) that carry each model family's real chat
template, for the reasoning and tool-call parser tests. No hub: the built-in byte-level BPE plus
the family's marker tokens, special or not as the family's own tokenizer has them.

The templates in ``tests/chat_templates/`` are the families' chat templates as their checkpoints
ship them: Qwen3 (hermes calls, ``<think>``), DeepSeek-R1 (``<think>\\n`` ends the prompt),
Llama 3.1 (JSON calls), Llama 3.2 with pythonic calls (as vLLM ships it), Mistral 7B v0.3
(``[TOOL_CALLS]``) and Qwen3-Coder (XML calls). Dates and strftime are fixed so renders are stable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from servers import server_process
from tokenizers import AddedToken

from prefixserve.models.builtin import builtin_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"


@dataclass(frozen=True)
class Family:
    template: str  # file in chat_templates/
    bos: str
    eos: str
    special: tuple[str, ...]  # special tokens (dropped by skip_special_tokens)
    added: tuple[str, ...] = ()  # added tokens that stay text


_QWEN = ("<|endoftext|>", "<|im_end|>", ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
FAMILIES = {
    "qwen3": Family("qwen3.jinja", *_QWEN, ("<think>", "</think>", "<tool_call>", "</tool_call>")),
    "qwen3_coder": Family(
        "qwen3_coder.jinja", *_QWEN, ("<think>", "</think>", "<tool_call>", "</tool_call>")
    ),
    "deepseek_r1": Family(
        "deepseek_r1.jinja",
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        ("<think>", "</think>"),
    ),
    "llama3_json": Family(
        "llama3.1_json.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
    ),
    "pythonic": Family(
        "llama3.2_pythonic.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
    ),
    "mistral": Family(
        "mistral_v0.3.jinja",
        "<s>",
        "</s>",
        (
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
    ),
}


def family_tokenizer(name: str) -> transformers.PreTrainedTokenizerFast:
    """The built-in BPE with ``name``'s markers, BOS/EOS and real chat template."""
    family = FAMILIES[name]
    tok = builtin_tokenizer()
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in family.special]}
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    tok.add_special_tokens({"bos_token": family.bos, "eos_token": family.eos})
    tok.chat_template = (TEMPLATES / family.template).read_text()
    return tok


def family_checkpoint(name: str, folder: Path | str, seed: int = 0) -> Path:
    """A tiny random Llama checkpoint whose tokenizer is ``family_tokenizer(name)``."""
    folder = Path(folder)
    tok = family_tokenizer(name)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# ---- the family servers' shared setup (test_family_servers.py, test_family_agent_protocols.py) --

TOOL_FAMILIES = ("llama3_json", "mistral", "pythonic", "qwen3_coder")
PICK = {  # a choice per parameter: streamed == non-streamed is a real comparison
    "type": "object",
    "properties": {"n": {"enum": [1, 2, 3]}, "exact": {"type": "boolean"}},
    "required": ["n", "exact"],
}
FIXED = {"type": "object", "properties": {"unit": {"enum": [7]}}, "required": ["unit"]}
USER_TEXT = "Pick a number, then call the fixed tool."


@contextmanager
def family_server(name: str, folder: Path) -> Iterator[str]:
    """``prefixserve serve`` of family ``name``'s checkpoint (written into ``folder``) with its
    ``--tool-call-parser``, served as model "m"; yields the base URL."""
    args = ("--model", str(family_checkpoint(name, folder)), "--served-model-name", "m",
            "--tool-call-parser", name, "--max-model-len", "4096")  # fmt: skip
    with server_process(*args) as (_, base):
        yield base
