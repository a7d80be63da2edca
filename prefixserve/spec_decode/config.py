"""``SpeculativeConfig``: speculative decoding without a draft model, in vLLM's shape.

``LLM(speculative_config={...})`` and ``prefixserve serve --speculative-config '<json>'`` take the
same dict::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

``method``: ``"ngram"`` (prompt lookup over the request's own prompt and output) or ``"suffix"``
(the same over the request's own text, plus an index of the last
``suffix_decoding_max_cached_requests`` outputs of the same tenant: requests with the same
``cache_salt``, or all unsalted requests; the longer match wins). The index holds at most
``suffix_decoding_max_cached_bytes_per_tenant`` bytes per tenant and
``suffix_decoding_max_cached_bytes`` across tenants (estimates; ``tenant_indexes.py`` says which
outputs go first). Both match the sequence's last
``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens. Each decoding sequence proposes up to
``num_speculative_tokens`` drafts per step, adapted to its own recent acceptance; the target model
scores them all in that step's one forward and keeps the longest prefix plain decoding would
have produced.
``disable_by_batch_size``: no sequence speculates in a step that starts with at least this many
running sequences (a large batch is compute-bound: verifying drafts there costs throughput).
``draft_row_price``: what a draft row costs the batch, in tokens of its step, as a fixed figure
(0: rows are free) instead of the one measured from the steps' times (``StepCost``, the default,
None); with it set, which drafts a sequence proposes does not depend on timing.
Speculation is off unless a config is given.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from prefixserve.core.errors import InvalidArgumentError, require

METHODS = ("ngram", "suffix")
MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 32
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_cached_bytes_per_tenant: int = 64 * MiB
    suffix_decoding_max_cached_bytes: int = 256 * MiB
    draft_row_price: float | None = None

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"speculative_config.{name}",
                f"must be an integer >= 1, got {value!r}",
            )

        require(
            self.method in METHODS,
            "speculative_config.method",
            f"must be one of {METHODS}, got {self.method!r}",
        )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size", "suffix_decoding_max_cached_requests",
                     "suffix_decoding_max_cached_bytes_per_tenant",
                     "suffix_decoding_max_cached_bytes"):  # fmt: skip
            positive_int(name)
        price = self.draft_row_price
        require(
            price is None
            or (isinstance(price, int | float) and not isinstance(price, bool) and price >= 0),
            "speculative_config.draft_row_price",
            f"must be a number >= 0 or null, got {price!r}",
        )
        require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "speculative_config.prompt_lookup_min",
            f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
            f"got {self.prompt_lookup_min}",
        )

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SpeculativeConfig:
        """Validate a user's dict (unknown keys are an error, so a typo is not silently off)."""
        if not isinstance(options, dict):
            raise InvalidArgumentError(
                f"speculative_config: must be a dict, got {type(options).__name__}",
                "speculative_config",
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgumentError(
                f"speculative_config: unknown keys {unknown}; known: {sorted(known)}",
                "speculative_config",
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in options:
                raise InvalidArgumentError(
                    f"speculative_config.{name}: required", f"speculative_config.{name}"
                )
        return cls(**options)
