"""Output processing: a step's logits become tokens appended to their sequences.

For every sequence that samples this step: mask banned tokens, apply penalties, sample (one
batched call), record logprobs, append the token, detokenize, check the stop conditions, and free a
sequence that finished. One request's fault (NaN or inf logits, an exception while sampling or
detokenizing it) fails that request alone: its id and the reason land in the returned dict and the
engine finishes it with an error; every other row carries on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefixserve.sampler import SamplerOutput, SamplingMetadata
from prefixserve.sampling_params import SamplingParams
from prefixserve.sequence import Request, Sequence

if TYPE_CHECKING:
    from prefixserve.engine import LLMEngine

Row = tuple[Request, Sequence, int]  # (request, sequence, row of the step's logits)


class OutputProcessor:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def process(self, rows: list[Row], logits: torch.Tensor) -> dict[str, str]:
        """Sample and append a token for every row; returns {request_id: error} of failed ones."""
        failed: dict[str, str] = {}
        rows = self._drop_non_finite(rows, logits, failed)
        if rows:
            self._sample_and_append(rows, logits, failed)
        return failed

    @staticmethod
    def _drop_non_finite(
        rows: list[Row], logits: torch.Tensor, failed: dict[str, str]
    ) -> list[Row]:
        """Rows whose logits hold NaN or inf fail their request instead of poisoning sampling."""
        finite = torch.isfinite(logits).all(dim=-1)
        if bool(finite.all()):
            return rows
        bad = set((~finite).nonzero().flatten().tolist())
        for request, _, i in rows:
            if i in bad:
                failed[request.request_id] = "the model produced non-finite logits"
        return [row for row in rows if row[0].request_id not in failed]

    def _sample_and_append(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        failed: dict[str, str],
    ) -> None:
        """Sample every row in one batch; if that raises, retry request by request to isolate it."""
        try:
            result = self._sample(rows, logits)
        except Exception:
            by_request: dict[str, list[Row]] = {}
            for row in rows:
                by_request.setdefault(row[0].request_id, []).append(row)
            for rid, group in by_request.items():
                try:
                    self._append_sampled(group, self._sample(group, logits), failed)
                except Exception as exc:
                    failed[rid] = describe_error(exc, "sampling")
            return
        self._append_sampled(rows, result, failed)

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> SamplerOutput:
        params = [r.params for r, _, _ in rows]
        seqs = [s for _, s, _ in rows]
        index = torch.tensor([i for _, _, i in rows], dtype=torch.int64, device=logits.device)
        row_logits = logits.index_select(0, index) if len(rows) != logits.shape[0] else logits
        metadata = SamplingMetadata.from_params(
            params,
            output_token_ids=[s.output_token_ids for s in seqs],
            prompt_token_ids=[r.prompt_token_ids for r, _, _ in rows],
            generators={j: s.generator for j, s in enumerate(seqs) if s.generator is not None},
            banned_token_ids=[self._banned_tokens(p, s) for p, s in zip(params, seqs)],
            device=logits.device,
        )
        return self.engine.sampler(row_logits, metadata)

    def _banned_tokens(self, params: SamplingParams, seq: Sequence) -> list[int]:
        if seq.num_output_tokens >= params.min_tokens:
            return []
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(self.engine.eos_token_ids)
        return banned

    def _append_sampled(
        self,
        rows: list[Row],
        result: SamplerOutput,
        failed: dict[str, str],
    ) -> None:
        token_ids = result.sampled_token_ids.tolist()
        sampled_lps = result.sampled_logprobs.tolist()
        topk_ids = result.topk_token_ids.tolist() if result.topk_token_ids is not None else None
        topk_lps = result.topk_logprobs.tolist() if result.topk_logprobs is not None else None
        for j, (request, seq, _) in enumerate(rows):
            if request.request_id in failed:
                continue
            topk = (
                list(zip(topk_ids[j], topk_lps[j])) if seq.logprobs is not None and topk_ids else []
            )
            try:
                self._append_one(request, seq, token_ids[j], sampled_lps[j], topk)
            except Exception as exc:
                failed[request.request_id] = describe_error(exc, "output processing")

    def _append_one(
        self,
        request: Request,
        seq: Sequence,
        token: int,
        logprob: float,
        topk: list[tuple[int, float]],
    ) -> None:
        """Append a sampled token with its logprobs, then check the stop conditions."""
        self.engine.scheduler.append_token(request, seq, token)
        self.engine.counters.generation_tokens += 1
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            entry = {token: logprob}
            for tid, lp in topk[: request.params.logprobs]:
                entry.setdefault(tid, lp)
            seq.logprobs.append(entry)
        self._check_stop(request, seq, token)
        if seq.is_finished:
            self.engine.scheduler.free_seq(seq)

    def _check_stop(self, request: Request, seq: Sequence, token: int) -> None:
        params: SamplingParams = request.params  # type: ignore[assignment]
        stop_str = seq.detokenizer.update([token])
        past_min = seq.num_output_tokens >= params.min_tokens
        if past_min and not params.ignore_eos and token in self.engine.eos_token_ids:
            seq.finish_reason = "stop"
        elif past_min and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif seq.num_tokens >= request.max_total_tokens:
            seq.finish_reason = "length"
        if seq.is_finished and stop_str is None:
            seq.detokenizer.flush()

    # ---- outputs and stats -------------------------------------------------------------------


def describe_error(exc: Exception, stage: str) -> str:
    return f"internal error in {stage}: {type(exc).__name__}: {exc}"
