"""The logits-processing pipeline: grammar, token controls and penalties, before sampling.

Every step's constraints on what may be sampled are applied here, in one place and one order
(``process_logits``); the sampler then applies temperature, top-k, top-p and min-p. Each stage
returns new logits: the raw logits stay untouched, since logprobs are taken from them.
"""

from __future__ import annotations

import torch

from prefixserve.sample.sampling_metadata import SamplingMetadata
from prefixserve.structured_outputs.grammar import apply_bitmask


def _token_mask(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] float32 counts of each token id per row (scatter_add from a padded list)."""
    width = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    if width:
        # Padding points at the extra column ``vocab_size``, dropped below.
        rows = [ids + [vocab_size] * (width - len(ids)) for ids in token_ids]
        padded = torch.tensor(rows, dtype=torch.int64, device=device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: list[list[int]]) -> torch.Tensor:
    """Return ``logits`` with each row's banned tokens set to -inf."""
    banned = _token_mask(banned_token_ids, logits.shape[-1], logits.device) > 0
    return logits.masked_fill(banned, float("-inf"))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Return ``logits`` after the repetition, frequency and presence penalties.

    Repetition (as transformers): a token seen in the prompt or the output has its logit divided by
    the penalty when positive, multiplied when negative. Frequency and presence (as OpenAI):
    ``logit -= frequency * count + presence * (count > 0)`` over generated tokens only.
    """
    vocab_size = logits.shape[-1]
    if metadata.repetition_penalty is not None:
        seen_ids = [p + o for p, o in zip(metadata.prompt_token_ids, metadata.output_token_ids)]
        seen = _token_mask(seen_ids, vocab_size, logits.device) > 0
        penalty = metadata.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if metadata.frequency_penalty is not None or metadata.presence_penalty is not None:
        counts = _token_mask(metadata.output_token_ids, vocab_size, logits.device)
        if metadata.frequency_penalty is not None:
            logits = logits - metadata.frequency_penalty.unsqueeze(1) * counts
        if metadata.presence_penalty is not None:
            logits = logits - metadata.presence_penalty.unsqueeze(1) * (counts > 0).float()
    return logits


def apply_allowed_tokens(
    logits: torch.Tensor, allowed_token_ids: list[list[int] | None]
) -> torch.Tensor:
    """Return ``logits`` with every token outside a row's allowed list at -inf (rows with None
    untouched)."""
    rows = [i for i, ids in enumerate(allowed_token_ids) if ids is not None]
    keep = _token_mask([allowed_token_ids[i] for i in rows], logits.shape[-1], logits.device) > 0
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    return logits


def apply_logit_bias(
    logits: torch.Tensor, logit_bias: list[dict[int, float] | None]
) -> torch.Tensor:
    """Return ``logits`` with each row's biases added (OpenAI's ``logit_bias``)."""
    rows, cols, values = [], [], []
    for i, bias in enumerate(logit_bias):
        for token, value in (bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(float(value))
    delta = torch.zeros_like(logits)
    delta[rows, cols] = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits + delta


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The one logits-processing pipeline, on a copy of ``logits`` (logprobs keep the raw ones)::

        grammar bitmask -> allowed_token_ids -> banned tokens (min_tokens, bad_words)
            -> logit_bias -> repetition / frequency / presence penalties

    The result is what greedy rows take the argmax of and random rows sample from.
    """
    if metadata.token_bitmask is not None:
        logits = logits.clone()
        apply_bitmask(logits, metadata.token_bitmask, metadata.bitmask_rows)
    if metadata.allowed_token_ids is not None:
        logits = apply_allowed_tokens(logits, metadata.allowed_token_ids)
    if metadata.banned_token_ids is not None:
        logits = apply_banned_tokens(logits, metadata.banned_token_ids)
    if metadata.logit_bias is not None:
        logits = apply_logit_bias(logits, metadata.logit_bias)
    return apply_penalties(logits, metadata)
