"""Per-request sampling parameters (the offline API's and the HTTP API's common language)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from prefixserve.core.errors import require
from prefixserve.kv.retention import KVRetention
from prefixserve.structured_outputs.params import StructuredOutputsParams

MAX_LOGPROBS = 20
"""Most top logprobs one generated token may return (``logprobs``, ``top_logprobs``)."""


class RequestOutputKind(enum.Enum):
    """What each of a request's ``RequestOutput`` s holds (vLLM's names).

    ``CUMULATIVE``: everything so far (each output's text, tokens and logprobs extend the last).
    ``DELTA``: only what is new since the request's previous output; concatenated, a sequence's
    deltas are the cumulative output. ``FINAL_ONLY``: one output, the finished request's whole.
    Request-level fields (prompt, cache figures, ``prompt_logprobs`` so far, retention) are whole
    in every kind.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample the continuation of one prompt.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or -1) and ``top_p == 1`` disable those
    filters. ``logprobs=k`` returns, for each generated token, a dict holding the sampled token and
    the k most likely tokens. ``cache_salt`` isolates this request's KV blocks from requests with a
    different salt (tenant isolation). ``structured_outputs`` constrains the output to a JSON
    schema, regex, choice or grammar (every token sampled is one the grammar allows).

    ``prompt_logprobs=k``: for every prompt token after the first, a dict holding its logprob and
    the k most likely tokens at that position (the prompt is computed in full: no prefix-cache
    hit). Token controls, applied before sampling with the grammar mask: ``logit_bias`` (token id
    -> bias in [-100, 100], added to the logits), ``allowed_token_ids`` (only these may be
    sampled), ``bad_words`` (strings never generated). ``truncate_prompt_tokens=k`` keeps the
    prompt's last k tokens.

    ``kv_retention``: one ``KVRetention`` or a list (one per cache breakpoint): keep the KV of
    the prompt up to each one's ``num_tokens`` for its TTL, as soft priority over other cached
    blocks (``prefixserve.kv.retention``). Stored as a tuple.

    ``kv_resume``: retention sessions this request continues (the result of the tool call a
    reply paused on): when the engine takes it, each one's pause ends (the gap is a sample of
    the learned TTL) and its retention is released (the request reads the blocks). Stored as a
    tuple.

    ``segment_reuse``: False opts this request out of segment reuse on an engine that has it on
    (``EngineConfig.segment_reuse``): its output is then exact; None or True follow the engine.

    ``output_kind``: what each of its outputs holds (``RequestOutputKind``).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    kv_retention: KVRetention | list[KVRetention] | tuple[KVRetention, ...] | None = None
    segment_reuse: bool | None = None
    kv_resume: tuple[str, ...] | list[str] = ()
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.kv_retention, KVRetention):
            self.kv_retention = (self.kv_retention,)
        self.kv_retention = tuple(self.kv_retention or ())
        self.kv_resume = tuple(self.kv_resume or ())
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check_structured_outputs(self.structured_outputs)
        require(
            isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}"
        )
        require(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1 or None, got {self.max_tokens!r}",
        )
        require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}",
        )
        require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        require(
            self.seed is None or isinstance(self.seed, int),
            "seed",
            f"must be an integer, got {self.seed!r}",
        )
        require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
        )
        require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        require(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}",
        )
        require(
            self.prompt_logprobs is None
            or (
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS
            ),
            "prompt_logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}",
        )
        _check_token_controls(self)
        require(
            self.truncate_prompt_tokens is None
            or (isinstance(self.truncate_prompt_tokens, int) and self.truncate_prompt_tokens >= 1),
            "truncate_prompt_tokens",
            f"must be an integer >= 1 or None, got {self.truncate_prompt_tokens!r}",
        )
        require(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}",
        )
        require(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        require(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        require(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        require(
            self.segment_reuse is None or isinstance(self.segment_reuse, bool),
            "segment_reuse",
            f"must be true, false or null, got {self.segment_reuse!r}",
        )
        require(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
            "cache_salt",
            "must be a non-empty string or None",
        )
        require(
            all(isinstance(r, KVRetention) for r in self.kv_retention),
            "kv_retention",
            "must be a KVRetention, a list of them or None",
        )
        require(
            all(isinstance(r, str) and r for r in self.kv_resume),
            "kv_resume",
            "must be a list of non-empty session names",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class BeamSearchParams:
    """Beam search: keep the ``beam_width`` best hypotheses by cumulative logprob.

    ``length_penalty`` follows transformers: a finished hypothesis scores
    ``sum_logprobs / len(generated) ** length_penalty``. A hypothesis ends at EOS, a
    ``stop_token_ids`` token or, as its text grows, a ``stop`` string (the text is cut before it
    unless ``include_stop_str_in_output``). ``skip_special_tokens`` applies to the final text.
    Hypotheses are decoded once, at the end: with ``output_kind`` DELTA or FINAL_ONLY the request
    has one output, when it finishes.
    """

    beam_width: int = 4
    max_tokens: int | None = 32  # None: up to the model's context
    length_penalty: float = 1.0
    ignore_eos: bool = False
    temperature: float = 0.0
    cache_salt: str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
        )
        _check_structured_outputs(self.structured_outputs)
        require(
            isinstance(self.beam_width, int) and self.beam_width >= 1,
            "beam_width",
            f"must be an integer >= 1, got {self.beam_width!r}",
        )
        require(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1 or None, got {self.max_tokens!r}",
        )
        require(self.temperature == 0.0, "temperature", "beam search is deterministic; use 0")


def _check_structured_outputs(value: object) -> None:
    require(
        value is None or isinstance(value, StructuredOutputsParams),
        "structured_outputs",
        f"must be a StructuredOutputsParams or None, got {type(value).__name__}",
    )


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_token_controls(params: SamplingParams) -> None:
    """Shapes and ranges; the engine checks ids against the vocabulary."""
    bias = params.logit_bias
    if bias is not None:
        require(isinstance(bias, dict), "logit_bias", "must map token ids to biases")
        for token, value in bias.items():
            require(_is_token_id(token), "logit_bias", f"{token!r} is not a token id (an int >= 0)")
            require(
                isinstance(value, (int, float)) and -100 <= value <= 100,
                "logit_bias",
                f"the bias of token {token} must be a number in [-100, 100], got {value!r}",
            )
    allowed = params.allowed_token_ids
    if allowed is not None:
        require(
            isinstance(allowed, list) and len(allowed) > 0,
            "allowed_token_ids",
            "must be a non-empty list of token ids",
        )
        bad = next((t for t in allowed if not _is_token_id(t)), None)
        require(bad is None, "allowed_token_ids", f"{bad!r} is not a token id (an int >= 0)")
    words = params.bad_words
    if words is not None:
        require(
            isinstance(words, list) and all(isinstance(w, str) and w for w in words),
            "bad_words",
            "must be a list of non-empty strings",
        )
