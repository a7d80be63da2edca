"""Logits -> tokens (+ logprobs) for one step of a batch.

Order of processing, per row::

    raw logits ──> logprobs (log_softmax of the raw logits: what the model said)
        │
        └─> process_logits (grammar, token controls, penalties: ``logits_processors``)
              ├─ greedy rows: argmax
              └─ random rows: temperature -> top-k -> top-p -> min-p
                              -> exponential race: argmax(probs / q)

The exponential race picks token ``i`` with probability ``probs[i]`` when ``q ~ Exp(1)`` i.i.d.
A row with its own ``torch.Generator`` (a seeded request) draws its ``q`` from it alone, so a seed
gives the same tokens whatever else shares the batch. Filters are vectorized over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.sample.logits_processors import process_logits
from prefixserve.sample.sampling_metadata import SamplingMetadata

# Top-p ranks this many candidates before it falls back to sorting the whole vocab.
_TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class SamplerOutput:
    """Sampled tokens and their logprobs (from the raw logits); top-k is None unless asked for."""

    sampled_token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    topk_token_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token below the row's k-th largest logit (k = 0: off; ties are kept)."""
    k = top_k.clamp(max=logits.shape[-1])
    max_k = int(k.max())
    if max_k == 0:
        return logits
    top_values = logits.topk(max_k, dim=-1).values
    kth = top_values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
    kth = kth.masked_fill((k == 0).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_drop_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, V] True for tokens top-p removes (p = 1: none).

    Top-p keeps the smallest set of most likely tokens whose mass reaches p: a token is kept when
    the mass of the tokens ranked before it is below p, so the most likely token always survives.
    Only the ``_TOP_P_CANDIDATES`` most likely tokens are ranked when they hold mass >= p in every
    row (every other token then has mass >= p before it); otherwise the whole vocab is sorted.
    """
    vocab_size = probs.shape[-1]
    ranked, ranked_ids = probs.topk(min(vocab_size, _TOP_P_CANDIDATES), dim=-1)
    if ranked.shape[-1] < vocab_size and not bool((ranked.sum(dim=-1) >= top_p).all()):
        ranked, ranked_ids = probs.sort(dim=-1, descending=True)
    keep_ranked = (ranked.cumsum(dim=-1) - ranked) < top_p.unsqueeze(1)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ranked_ids, keep_ranked)
    # Rows with p == 1 keep everything, whatever the rounding of the cumulative sum.
    return ~keep & (top_p < 1.0).unsqueeze(1)


def min_p_drop_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[N, V] True for tokens below ``min_p`` times the row's top probability.

    The ratio to the top probability does not change when top-p renormalizes (top-p keeps the
    top token), so the mask may be computed before or after top-p alike.
    """
    return probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)


def filtered_probs(
    logits: torch.Tensor, metadata: SamplingMetadata, rows: torch.Tensor
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for the random ``rows`` (``logits`` holds only those).

    Returns unnormalized probabilities (filtered tokens are 0): the exponential race does not
    need them to sum to 1, which saves a pass over ``[N, V]``.
    """
    logits = logits / metadata.temperature[rows].unsqueeze(1)
    if metadata.top_k is not None:
        logits = apply_top_k(logits, metadata.top_k[rows])
    probs = logits.softmax(dim=-1)
    drop: torch.Tensor | None = None
    if metadata.top_p is not None:
        drop = top_p_drop_mask(probs, metadata.top_p[rows])
    if metadata.min_p is not None:
        min_p_drop = min_p_drop_mask(probs, metadata.min_p[rows])
        drop = min_p_drop if drop is None else drop | min_p_drop
    return probs if drop is None else probs.masked_fill_(drop, 0.0)


def exponential_race(
    probs: torch.Tensor, rows: list[int], generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """Sample one token per row of ``probs``: ``argmax(probs / q)``, ``q ~ Exp(1)``.

    ``rows[i]`` is the batch row of ``probs[i]``; a row with a generator draws its ``q`` from it.
    ``q = -log(u)``, ``u ~ U[0, 1)``, is positive (u < 1) and much cheaper than ``exponential_``.
    """
    u = torch.empty_like(probs)
    seeded = [i for i, row in enumerate(rows) if row in generators]
    if len(seeded) < len(rows):
        u.uniform_()
    for i in seeded:
        u[i].uniform_(generator=generators[rows[i]])
    return (probs / u.log_().neg_()).argmax(dim=-1)


class Sampler:
    """Turns one step's logits ``[N, V]`` into tokens and logprobs; stateless."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        processed = process_logits(logits, metadata) if metadata.needs_processing else logits
        sampled = processed.argmax(dim=-1)
        if not metadata.all_greedy:
            random = metadata.temperature > 0
            rows = random.nonzero().squeeze(1)
            random_logits = processed if bool(random.all()) else processed[rows]
            probs = filtered_probs(random_logits, metadata, rows)
            sampled[rows] = exponential_race(probs, rows.tolist(), metadata.generators)
        return self._with_logprobs(logits, sampled, metadata.max_num_logprobs)

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int | None) -> SamplerOutput:
        """Logprobs from the raw logits, by one ``log_softmax`` (on CPU one fused pass, faster
        than ``logsumexp`` and a subtraction); the top-k are chosen on the logits themselves."""
        logprobs = logits.log_softmax(dim=-1)
        sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        topk_ids = topk_logprobs = None
        if k is not None:
            topk_ids = logits.topk(k, dim=-1).indices
            topk_logprobs = logprobs.gather(1, topk_ids)
        return SamplerOutput(sampled, sampled_logprobs, topk_ids, topk_logprobs)
