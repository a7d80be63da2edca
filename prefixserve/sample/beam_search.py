"""Beam search inside the engine: beams are forked sequences that share KV blocks.

Each step (all live beams of a request sample together, the scheduler keeps them in lockstep)::

    scores[b, t] = cumulative_logprob[b] + log_softmax(logits[b])[t]
    candidates   = the 2*W best (beam, token) pairs over all beams, best first
    finished     <- candidates ranked < W that end (EOS, a stop token, or a text that now holds
                    a stop string), or all ranked < W at the length limit, scored
                    cumulative_logprob / generated_len ** length_penalty; keep the best W
    running      <- the W best candidates that do not end

``decide`` only computes that step (a ``BeamStep``); the scheduler applies it: a beam chosen k
times is forked k-1 times before its token is appended (children share its blocks, copy-on-write
on the first write), a beam not chosen is freed at once. The search stops at the length limit or
when the best running beam can no longer beat the worst of W finished hypotheses (transformers'
``early_stopping=False`` rule), so results equal transformers' beam search.

Stop strings: a candidate's whole text is decoded (beams keep no incremental detokenizer), only
for the candidates that could be kept, and only when the request has stop strings; its text
held none before this token, so a match means the token completed it. The final text is cut as
the detokenizer cuts a sampled output (``find_stop``).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any

import torch

from prefixserve.core.detokenizer import find_stop
from prefixserve.core.outputs import CompletionOutput
from prefixserve.core.sampling_params import BeamSearchParams
from prefixserve.core.sequence import Request, Sequence


@dataclass(slots=True)
class BeamHypothesis:
    score: float  # cumulative_logprob / generated_len ** length_penalty
    cumulative_logprob: float
    token_ids: list[int]  # generated tokens
    finish_reason: str
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class BeamStep:
    """One step of one request's search. ``continuations`` are (parent beam, token, cumulative
    logprob) best first, at most W; empty when ``done``. ``finished`` is the request's new list of
    finished hypotheses (best first, at most W)."""

    continuations: list[tuple[Sequence, int, float]]
    finished: list[BeamHypothesis]
    done: bool


def decide(
    request: Request,
    beams: list[Sequence],
    logits: torch.Tensor,
    eos_token_ids: Set[int],
    tokenizer: Any = None,
) -> BeamStep:
    """The step of ``request`` whose live ``beams`` produced ``logits`` (one row per beam);
    ``tokenizer`` decodes candidates when the request has stop strings."""
    params: BeamSearchParams = request.params  # type: ignore[assignment]
    width = params.beam_width
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (b, V)
    cumulative = torch.tensor([s.cumulative_logprob for s in beams], device=logits.device)
    scores = (logprobs + cumulative[:, None]).flatten()
    top_scores, top_idx = torch.topk(scores, min(2 * width, scores.numel()))
    vocab = logprobs.shape[1]
    gen_len = beams[0].num_output_tokens + 1
    at_limit = beams[0].num_tokens + 1 >= request.max_total_tokens
    eos = set() if params.ignore_eos else eos_token_ids | set(params.stop_token_ids)
    finished = list(request.finished_beams)
    running: list[tuple[Sequence, int, float]] = []
    for rank, (score, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
        if rank >= width and len(running) == width:
            break  # nothing further can be kept
        beam, token = beams[idx // vocab], idx % vocab
        token_ids = beam.output_token_ids + [token]
        stop_reason: str | int | None = token if token in params.stop_token_ids else None
        ends = token in eos
        if not ends and params.stop:
            stop_reason = _stop_string(params, tokenizer, token_ids)
            ends = stop_reason is not None
        if (ends or at_limit) and rank < width:
            reason = "stop" if ends else "length"
            hypothesis = BeamHypothesis(score / gen_len**params.length_penalty, score, token_ids,
                                        reason, stop_reason if ends else None)  # fmt: skip
            finished = sorted([*finished, hypothesis], key=lambda h: h.score, reverse=True)
            del finished[width:]
        if not ends and len(running) < width:
            running.append((beam, token, score))
    done = at_limit or not running or _cannot_improve(params, finished, running[0][2], gen_len)
    return BeamStep([] if done else running, finished, done)


def _stop_string(params: BeamSearchParams, tokenizer: Any, token_ids: list[int]) -> str | None:
    text = tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
    match = find_stop(text, params.stop)  # type: ignore[arg-type]
    return match[1] if match is not None else None


def _hypothesis_text(params: BeamSearchParams, h: BeamHypothesis, tokenizer: Any) -> str:
    """A finished hypothesis's text: a stop token's text is left out, a stop string and what
    follows it are cut, unless ``include_stop_str_in_output`` (then the stop string is kept)."""
    token_ids = h.token_ids
    if isinstance(h.stop_reason, int) and not params.include_stop_str_in_output:
        token_ids = token_ids[:-1]
    text = tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(h.stop_reason, str):
        match = find_stop(text, params.stop)  # type: ignore[arg-type]
        assert match is not None, "a stop string ended this hypothesis"
        start, stop = match
        text = text[: start + len(stop) if params.include_stop_str_in_output else start]
    return text


def _cannot_improve(
    params: BeamSearchParams, finished: list[BeamHypothesis], best_running: float, gen_len: int
) -> bool:
    if len(finished) < params.beam_width:
        return False
    return best_running / (gen_len**params.length_penalty) <= finished[-1].score


def beam_outputs(request: Request, tokenizer) -> list[CompletionOutput]:
    """Finished requests: the hypotheses, best first. Running ones: the live beams, no text."""
    if request.is_finished or all(s.is_finished for s in request.seqs):
        return [
            CompletionOutput(
                index=i,
                text=_hypothesis_text(request.params, h, tokenizer),  # type: ignore[arg-type]
                token_ids=h.token_ids,
                cumulative_logprob=h.cumulative_logprob,
                finish_reason=h.finish_reason,
                stop_reason=h.stop_reason,
            )
            for i, h in enumerate(request.finished_beams)
        ]
    return [
        CompletionOutput(
            index=s.index, token_ids=s.output_token_ids, cumulative_logprob=s.cumulative_logprob
        )
        for s in request.seqs
    ]
