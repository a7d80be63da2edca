"""Reasoning text (``<think>...</think>``) split from the answer: ``--reasoning-parser``.

One API for every endpoint (chat completions, Responses, Messages; ``reply.ReplyParser`` reads
every reply with it)::

    parser = reasoning_parser("qwen3", prompt_text)   # a fresh parser per choice
    reasoning, content = parser.extract(text)         # a whole output; each part str or None
    r_delta, c_delta = parser.feed(delta, final)      # streaming; "" where nothing is released

Invariant: for any split of an output into deltas, the ``feed`` deltas (``final=True`` on the
last) concatenate to ``extract``'s parts (None read as ""). Text that may still be a tag, or
the newlines after ``</think>``, is held back until it is decided.

Where an output starts, from the rendered prompt (``starts_in_reasoning``):

- ``deepseek_r1``: R1's templates end the prompt with ``<think>\\n`` (older ones with nothing),
  so the output starts inside the reasoning; an output without ``</think>`` is all reasoning.
- ``qwen3``: the model opens ``<think>`` itself; an output that does not start with it is all
  content (``enable_thinking=False`` renders an empty closed block into the prompt). A prompt that
  ends inside an open ``<think>`` (Qwen3 "thinking" checkpoints) starts inside, as R1 does.

Either way a leading ``<think>`` is dropped, only the first block is reasoning, and the content
after ``</think>`` loses its leading whitespace. ``reasoning_ahead`` says whether an output will
open with reasoning, so that a grammar or forced tool call applies after it (see
``StructuredOutputsParams.reasoning``).
"""

from __future__ import annotations

from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ThinkReasoningParser:
    """The ``<think>...</think>`` family; one instance reads one output."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._buffer = ""
        self._state = "start"  # -> "reasoning" -> "after" -> "content", or "start" -> "content"
        self._opened = starts_in_reasoning  # whether the output has reasoning at all

    @property
    def has_reasoning(self) -> bool:
        return self._opened

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the reasoning block."""
        return self._state == "reasoning"

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a whole output."""
        parser = ThinkReasoningParser(self.starts_in_reasoning)
        reasoning, content = parser.feed(text, final=True)
        return (reasoning if parser.has_reasoning else None), (content or None)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) of the next piece of output."""
        self._buffer += delta
        reasoning = content = ""
        while True:
            if self._state == "start":  # leading whitespace, then maybe <think>
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self._buffer = stripped[len(THINK_START) :]
                    self._state, self._opened = "reasoning", True
                    continue
                if not final and THINK_START.startswith(stripped):
                    break  # still undecided
                self._state = "reasoning" if self.starts_in_reasoning else "content"
                continue
            if self._state == "reasoning":
                end = self._buffer.find(THINK_END)
                if end >= 0:
                    reasoning += self._buffer[:end]
                    self._buffer, self._state = self._buffer[end + len(THINK_END) :], "after"
                    continue
                keep = 0 if final else _partial_suffix(self._buffer, THINK_END)
                cut = len(self._buffer) - keep
                reasoning, self._buffer = reasoning + self._buffer[:cut], self._buffer[cut:]
                break
            if self._state == "after":  # whitespace between </think> and the answer is dropped
                self._buffer = self._buffer.lstrip()
                if not self._buffer and not final:
                    break
                self._state = "content"
                continue
            content, self._buffer = content + self._buffer, ""
            break
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def starts_in_reasoning(name: str, prompt: str) -> bool:
    """Whether an output of ``prompt`` begins inside the reasoning block (see the module doc)."""
    check_name(name)
    tail = prompt.rstrip()
    if name == "deepseek_r1":
        return not tail.endswith(THINK_END)
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def reasoning_ahead(name: str, prompt: str) -> bool:
    """Whether an output of ``prompt`` opens with a reasoning block (always, for R1; for Qwen3
    unless the prompt already closed one, as ``enable_thinking=False`` does)."""
    check_name(name)
    return not prompt.rstrip().endswith(THINK_END)


def reasoning_tags(name: str | None, prompt: str) -> tuple[str, str] | None:
    """``StructuredOutputsParams.reasoning`` for an output of ``prompt`` under the parser
    ``name``: (the tag the model opens, the tag that closes), None when no reasoning comes."""
    if name is None or not reasoning_ahead(name, prompt):
        return None
    return ("" if starts_in_reasoning(name, prompt) else THINK_START), THINK_END


def reasoning_parser(name: str, prompt: str) -> ThinkReasoningParser:
    """A parser for one output of ``prompt`` (the rendered prompt text)."""
    return ThinkReasoningParser(starts_in_reasoning(name, prompt))


def check_name(name: str) -> None:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {REASONING_PARSERS}")


def count_reasoning_tokens(tokenizer: Any, token_ids: list[int], reasoning: str | None) -> int:
    """How many of ``token_ids`` (one output) are reasoning: up to and including ``</think>``.

    ``reasoning`` is what ``extract`` returned: None means no reasoning (0 tokens). Without a
    closing ``</think>`` every token is reasoning. When ``</think>`` is not one token, the count
    is the length of the reasoning text re-encoded, plus the tag's tokens (an estimate).
    """
    if reasoning is None:
        return 0
    end_id = tokenizer.convert_tokens_to_ids(THINK_END)
    if isinstance(end_id, int) and end_id != tokenizer.unk_token_id:
        return token_ids.index(end_id) + 1 if end_id in token_ids else len(token_ids)
    encoded = len(tokenizer.encode(reasoning + THINK_END, add_special_tokens=False))
    return min(len(token_ids), encoded)
