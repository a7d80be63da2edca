"""Beam search inside the engine: beams are forked sequences that share KV blocks.

Each step (all live beams of a request sample together, the scheduler keeps them in lockstep)::

    scores[b, t] = cumulative_logprob[b] + log_softmax(logits[b])[t]
    candidates   = the 2*W best (beam, token) pairs over all beams, best first
    finished     <- candidates ranked < W that end in EOS (or all ranked < W at the length limit),
                    scored  cumulative_logprob / generated_len ** length_penalty; keep the best W
    running      <- the W best candidates that do not end in EOS

A beam chosen k times is forked k-1 times before its token is appended (children share its blocks,
copy-on-write on the first write); a beam not chosen is freed at once. The search stops at the
length limit or when the best running beam can no longer beat the worst of W finished hypotheses
(transformers' ``early_stopping=False`` rule), so results equal transformers' beam search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from prefixserve.outputs import CompletionOutput
from prefixserve.sampling_params import BeamSearchParams
from prefixserve.sequence import Request, Sequence

if TYPE_CHECKING:
    from prefixserve.engine import LLMEngine


@dataclass(slots=True)
class BeamHypothesis:
    score: float  # cumulative_logprob / generated_len ** length_penalty
    cumulative_logprob: float
    token_ids: list[int]  # generated tokens
    finish_reason: str


class BeamSearchStepper:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def step(
        self, request: Request, rows: list[tuple[Sequence, int]], logits: torch.Tensor
    ) -> None:
        params: BeamSearchParams = request.params  # type: ignore[assignment]
        width = params.beam_width
        beams = [seq for seq, _ in rows]
        index = torch.tensor([i for _, i in rows], dtype=torch.int64, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # (b, V)
        cumulative = torch.tensor([s.cumulative_logprob for s in beams], device=logits.device)
        scores = (logprobs + cumulative[:, None]).flatten()
        k = min(2 * width, scores.numel())
        top_scores, top_idx = torch.topk(scores, k)
        vocab = logprobs.shape[1]
        candidates = [
            (score, idx // vocab, idx % vocab)
            for score, idx in zip(top_scores.tolist(), top_idx.tolist())
        ]
        gen_len = beams[0].num_output_tokens + 1
        at_limit = beams[0].num_tokens + 1 >= request.max_total_tokens
        eos = set() if params.ignore_eos else self.engine.eos_token_ids | set(params.stop_token_ids)
        running: list[tuple[float, int, int]] = []
        for rank, (score, b, token) in enumerate(candidates):
            ends = token in eos
            if (ends or at_limit) and rank < width:
                self._add_finished(request, beams[b].output_token_ids + [token], score, gen_len,
                                   "stop" if ends else "length")  # fmt: skip
            if not ends and len(running) < width:
                running.append((score, b, token))
        if at_limit or not running or self._cannot_improve(request, running[0][0], gen_len):
            self._finish(request, beams)
            return
        self._advance(request, beams, running)

    def _add_finished(
        self, request: Request, tokens: list[int], cum: float, gen_len: int, reason: str
    ) -> None:
        params: BeamSearchParams = request.params  # type: ignore[assignment]
        score = cum / (gen_len**params.length_penalty)
        request.finished_beams.append(BeamHypothesis(score, cum, tokens, reason))
        request.finished_beams.sort(key=lambda h: h.score, reverse=True)
        del request.finished_beams[params.beam_width :]

    def _cannot_improve(self, request: Request, best_running: float, gen_len: int) -> bool:
        params: BeamSearchParams = request.params  # type: ignore[assignment]
        if len(request.finished_beams) < params.beam_width:
            return False
        worst = request.finished_beams[-1].score
        return best_running / (gen_len**params.length_penalty) <= worst

    def _advance(
        self, request: Request, beams: list[Sequence], running: list[tuple[float, int, int]]
    ) -> None:
        engine = self.engine
        chosen: set[int] = set()
        new_beams: list[tuple[Sequence, float, int]] = []
        for score, b, token in running:
            parent = beams[b]
            if b in chosen:
                seq = engine.new_sequence(request, 0, list(parent.token_ids))
                seq.num_computed_tokens = parent.num_computed_tokens
                seq.block_hashes = list(parent.block_hashes)
                engine.scheduler.fork_seq(parent, seq)
            else:
                seq = parent
                chosen.add(b)
            new_beams.append((seq, score, token))
        for b, seq in enumerate(beams):
            if b not in chosen:
                seq.finish_reason = "abort"
                engine.scheduler.free_seq(seq)
        request.seqs = []
        for rank, (seq, score, token) in enumerate(new_beams):
            seq.index = rank
            seq.cumulative_logprob = score
            engine.scheduler.append_token(request, seq, token)
            request.seqs.append(seq)
        engine.counters.generation_tokens += len(new_beams)

    def _finish(self, request: Request, beams: list[Sequence]) -> None:
        for seq in beams:
            seq.finish_reason = "length"
            self.engine.scheduler.free_seq(seq)
        request.seqs = beams

    def outputs(self, request: Request) -> list[CompletionOutput]:
        """Finished requests: the hypotheses, best first. Running ones: the live beams, no text."""
        tokenizer = self.engine.tokenizer
        if request.is_finished or all(s.is_finished for s in request.seqs):
            return [
                CompletionOutput(
                    index=i,
                    text=tokenizer.decode(h.token_ids, skip_special_tokens=True),
                    token_ids=h.token_ids,
                    cumulative_logprob=h.cumulative_logprob,
                    finish_reason=h.finish_reason,
                )
                for i, h in enumerate(request.finished_beams)
            ]
        return [
            CompletionOutput(
                index=s.index, token_ids=s.output_token_ids, cumulative_logprob=s.cumulative_logprob
            )
            for s in request.seqs
        ]
