"""Token-exact continuation: the prompt of a request that names ``previous_response_id``.

The store keeps the previous response's exact prompt token ids, the text they spell (the chat
template's rendering) and its output token ids. The new request's whole conversation is rendered
once through the template (``full_text``). Then::

    stored  = prompt_text + decode(output_token_ids)         what the model read and wrote
    full    = render(history + previous output + new items)  what the template gives now

    full.startswith(stored)  ->  prompt = prompt_ids + output_ids + tokenize(full[len(stored):])
    otherwise                ->  prompt = tokenize(full)      (re-rendered: counted in a metric)

So a spliced prompt always spells exactly the template's text, while its history keeps the
token ids the model generated (re-tokenizing generated text need not give them back, and then
the prefix cache would miss from there on). The check fails, and the prompt is re-rendered,
when the template rewrites earlier turns (drops reasoning, numbers messages, changes the system
prompt or tools) or the output does not decode to the text the template renders for it (special
tokens the model wrote, an output cut inside a character).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt's token ids and the template text they spell; ``token_exact``: the history's ids
    are the previous response's own (a splice), not a re-tokenization: the first ``spliced``
    ids are the previous prompt and output, spelling ``text[:spliced_text]``."""

    token_ids: list[int]
    text: str
    token_exact: bool
    spliced: int | None = None
    spliced_text: int = 0


def output_text(tokenizer: Any, output_token_ids: Sequence[int]) -> str:
    """The text output ids spell in a prompt (special tokens kept, as the template writes)."""
    return tokenizer.decode(
        output_token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def render_prompt(tokenizer: Any, text: str) -> Prompt:
    """A fresh prompt: the template's text, tokenized (the template writes special tokens)."""
    return Prompt(_encode(tokenizer, text), text, False)


def continue_prompt(
    tokenizer: Any,
    prompt_text: str,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    full_text: str,
    eos_token_ids: Collection[int] = (),
) -> Prompt:
    """The continuation's prompt (see the module docstring): spliced when the stored rendering
    is a prefix of ``full_text``, else ``full_text`` tokenized.

    An output that ends with an EOS token the template does not write there (the model stopped
    on ``<|end_of_text|>`` where the template closes turns with ``<|im_end|>``) is spliced
    without that token, and the template's own text follows it.
    """
    kept = list(output_token_ids)
    candidates = [kept]
    if kept and kept[-1] in eos_token_ids:
        candidates.append(kept[:-1])
    for output in candidates:
        stored = prompt_text + output_text(tokenizer, output)
        if full_text.startswith(stored):
            new_ids = _encode(tokenizer, full_text[len(stored) :])
            spliced = len(prompt_token_ids) + len(output)
            return Prompt([*prompt_token_ids, *output, *new_ids], full_text, True, spliced,
                          len(stored))  # fmt: skip
    return render_prompt(tokenizer, full_text)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids if text else []
