"""``SamplingMetadata``: one step's sampling parameters as batched tensors, one row per sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from prefixserve.core.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step sampling state, one row per sequence that samples this step.

    Optional tensors are None when no row uses the feature (the fast path skips it).
    ``temperature`` is 0 exactly for greedy rows; ``top_k`` 0 means disabled. ``generators`` maps a
    row index to that sequence's own generator. ``banned_token_ids`` lists, per row, tokens masked
    to -inf (EOS and stop token ids while a sequence is shorter than its ``min_tokens``).
    ``token_bitmask`` (structured outputs) holds, for the rows in ``bitmask_rows``, the tokens
    their grammar allows (xgrammar's packed int32 layout). ``allowed_token_ids`` and
    ``logit_bias`` are per row (None: that row has none), None when no row has any.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    all_greedy: bool
    banned_token_ids: list[list[int]] | None
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None
    allowed_token_ids: list[list[int] | None] | None = None
    logit_bias: list[dict[int, float] | None] | None = None

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        banned_token_ids: list[list[int]] | None,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Build the metadata of a batch, leaving unused features as None."""
        assert len(params) == len(output_token_ids) == len(prompt_token_ids)

        def column(values: list[float], dtype: torch.dtype, unused: float) -> torch.Tensor | None:
            if all(v == unused for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        temperature = [0.0 if g else p.temperature for g, p in zip(greedy, params)]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        if banned_token_ids is not None and not any(banned_token_ids):
            banned_token_ids = None
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_p=column([p.top_p for p in params], torch.float32, 1.0),
            top_k=column([p.top_k for p in params], torch.int64, 0),
            min_p=column([p.min_p for p in params], torch.float32, 0.0),
            presence_penalty=column([p.presence_penalty for p in params], torch.float32, 0.0),
            frequency_penalty=column([p.frequency_penalty for p in params], torch.float32, 0.0),
            repetition_penalty=column([p.repetition_penalty for p in params], torch.float32, 1.0),
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
            generators=generators,
            max_num_logprobs=max(requested) if requested else None,
            all_greedy=all(greedy),
            banned_token_ids=banned_token_ids,
            allowed_token_ids=_per_row([p.allowed_token_ids for p in params]),
            logit_bias=_per_row([p.logit_bias for p in params]),
        )

    @property
    def needs_processing(self) -> bool:
        """True when a grammar, a token control or a penalty changes the logits."""
        return (
            self.token_bitmask is not None
            or self.allowed_token_ids is not None
            or self.logit_bias is not None
            or self.banned_token_ids is not None
            or self.presence_penalty is not None
            or self.frequency_penalty is not None
            or self.repetition_penalty is not None
        )


def _per_row(values: list[T | None]) -> list[T | None] | None:
    """``values`` if any row has one, else None (the fast path skips the feature)."""
    return values if any(v is not None for v in values) else None
