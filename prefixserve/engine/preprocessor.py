"""One request preprocessor: a prompt and its parameters become a frozen ``PreparedRequest``.

::

    prompt (text | token ids) + params
      -> tokenize (text only) -> truncate (``truncate_prompt_tokens``: keep the last k)
      -> validate: fits the context (prompt + max_tokens) first (so an over-long prompt costs
         no scan), non-empty, ids in the vocabulary, the width (n, beam_width) fits a step,
         whole prompts when chunked prefill is off, stops within their caps, every float
         parameter finite (JSON's ``1e400`` is inf, Python's ``NaN`` a float)
      -> bad_words as token sequences -> grammar submitted for compiling (once, cached by spec)
      -> PreparedRequest

Every check a user can fail raises a typed error here (``InvalidArgumentError`` or
``PromptTooLongError``, OpenAI's message for the context), before anything is queued. The
offline ``LLM``, the HTTP handlers (through ``AsyncEngine.prepare``) and ``LLMEngine.add_request``
all go through ``process``; a request prepared once is never tokenized or validated again. What
only the engine can check (whether the request could ever fit in the KV cache) stays there.

Stops are capped because the engine thread checks them for every generated token of every
sequence, so one request's cost falls on every tenant's: at most ``max_stop_strings`` stop strings
of at most ``max_stop_string_chars`` characters each, and ``max_stop_strings`` stop token ids
(``StepLimits``, from ``EngineConfig``; defaults 64 and 1,024: OpenAI allows 4 strings,
lm-eval's ``until`` and LangChain's ``stop`` send a handful).

Thread-safe: it holds no mutable state (the grammar manager is thread-safe), so handlers call it
on the event loop while the engine steps on its own thread. Its work is linear in a prompt that
fits the context (the handlers tokenize and render off the loop, before it).
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError, PromptTooLongError
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.structured_outputs.manager import StructuredOutputManager

Params = SamplingParams | BeamSearchParams


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request the engine queues as it is. ``prompt`` is the text when one was given and kept
    whole (None after truncation or for token ids); ``max_total_tokens`` is the length limit
    (prompt + output); ``grammar`` the compile of ``params.structured_outputs`` (None without)."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: Params
    max_total_tokens: int
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    grammar: Future | None = None

    @property
    def width(self) -> int:
        """Sequences the request grows: n, or the beam width."""
        return self.params.beam_width if isinstance(self.params, BeamSearchParams) else self.params.n


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The engine's per-step limits a request is checked against (``EngineConfig``'s values;
    the scale-out ingress gets them from its replicas)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024

    @classmethod
    def of(cls, config: EngineConfig) -> StepLimits:
        return cls(config.max_num_seqs, config.max_num_batched_tokens,
                   config.enable_chunked_prefill, config.max_stop_strings,
                   config.max_stop_string_chars)  # fmt: skip


@dataclass(frozen=True, eq=False)
class RequestPreprocessor:
    """Tokenizes and validates requests for one engine (its tokenizer, vocabulary, context and
    step limits) and submits their grammars to its ``StructuredOutputManager``. Holds no state
    of its own past these (thread-safe as they are)."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    limits: StepLimits
    structured_outputs: StructuredOutputManager

    def process(self, prompt: str | list[int], params: Params) -> PreparedRequest:
        """The prepared request, or a typed error naming what to change."""
        text, token_ids = self._tokenize(prompt)
        truncate = getattr(params, "truncate_prompt_tokens", None)
        if truncate is not None and len(token_ids) > truncate:
            text, token_ids = None, token_ids[-truncate:]
        max_total = self.check_context(len(token_ids), params.max_tokens)
        self._check_prompt(token_ids, params)
        _check_stops(params, self.limits)
        _check_finite(params)
        width = params.beam_width if isinstance(params, BeamSearchParams) else params.n
        self._check_width(width)
        bad_words = self._bad_words(getattr(params, "bad_words", None) or [])
        so = params.structured_outputs
        grammar = self.structured_outputs.submit(so) if so is not None else None
        return PreparedRequest(text, tuple(token_ids), params, max_total, bad_words, grammar)

    def check_context(self, num_prompt: int, max_tokens: int | None) -> int:
        """The request's length limit (prompt + output); raises ``PromptTooLongError`` (OpenAI's
        message) when the prompt, or the prompt plus ``max_tokens``, exceeds the context."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt} input tokens. Please reduce the length of the input.",
                "prompt",
            )
        if max_tokens is None:
            return limit
        if num_prompt + max_tokens > limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the input, {max_tokens} in "
                "the completion). Please reduce the length of the input or completion.",
                "max_tokens",
            )
        return num_prompt + max_tokens

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise InvalidArgumentError("prompt: must be a string or a list of token ids", "prompt")

    def _check_prompt(self, token_ids: list[int], params: Params) -> None:
        if not token_ids:
            raise InvalidArgumentError("prompt: must not be empty", "prompt")
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgumentError(
                f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
            )
        limits = self.limits
        if not limits.enable_chunked_prefill and len(token_ids) > limits.max_num_batched_tokens:
            raise PromptTooLongError(
                f"prompt: {len(token_ids)} tokens exceed max_num_batched_tokens="
                f"{limits.max_num_batched_tokens} with chunked prefill disabled",
                "prompt",
            )
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = getattr(params, name, None) or []
            bad_ids = [t for t in ids if not 0 <= t < vocab]
            if bad_ids:
                raise InvalidArgumentError(
                    f"{name}: token id {bad_ids[0]} is outside the vocabulary [0, {vocab})", name
                )

    def _check_width(self, width: int) -> None:
        limits = self.limits
        if width > min(limits.max_num_seqs, limits.max_num_batched_tokens):
            raise InvalidArgumentError(
                f"n / beam_width: {width} sequences cannot run together with max_num_seqs="
                f"{limits.max_num_seqs} and max_num_batched_tokens={limits.max_num_batched_tokens}",
                "n",
            )

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each word as the tokenizer writes it alone and after a space (as vLLM does)."""
        sequences: list[tuple[int, ...]] = []
        for word in words:
            for text in (word, " " + word):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return tuple(sequences)


def _check_stops(params: Params, limits: StepLimits) -> None:
    """The caps of the module doc (``InvalidArgumentError`` naming the field and the cap)."""
    stops = params.stop or []
    if len(stops) > limits.max_stop_strings:
        raise InvalidArgumentError(
            f"stop: at most {limits.max_stop_strings} stop strings, got {len(stops)}", "stop"
        )
    long = next((s for s in stops if len(s) > limits.max_stop_string_chars), None)
    if long is not None:
        raise InvalidArgumentError(
            f"stop: each stop string is at most {limits.max_stop_string_chars} characters, got "
            f"one of {len(long)}",
            "stop",
        )
    ids = params.stop_token_ids or []
    if len(ids) > limits.max_stop_strings:
        raise InvalidArgumentError(
            f"stop_token_ids: at most {limits.max_stop_strings} ids, got {len(ids)}",
            "stop_token_ids",
        )


def _check_finite(params: Params) -> None:
    """Every float parameter (and ``logit_bias`` value) is finite."""
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        values = value.values() if isinstance(value, dict) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise InvalidArgumentError(f"{f.name}: must be a finite number, got {value!r}", f.name)
