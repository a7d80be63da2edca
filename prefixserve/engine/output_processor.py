"""A request's state becomes the ``RequestOutput`` the caller sees (vLLM's output shapes).

Outputs are cumulative: each holds the whole text, tokens and logprobs so far. Text comes from
each sequence's incremental detokenizer, which the scheduler feeds as it appends tokens (stop
strings are found there); beam search decodes its finished hypotheses once, at the end.
"""

from __future__ import annotations

from typing import Any

from prefixserve.core.outputs import CompletionOutput, RequestOutput
from prefixserve.core.sequence import Request
from prefixserve.sample.beam_search import beam_outputs


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def make_output(self, request: Request) -> RequestOutput:
        if request.is_beam_search:
            outputs = beam_outputs(request, self.tokenizer)
        else:
            outputs = [
                CompletionOutput(
                    index=s.index,
                    text=s.detokenizer.output_text,
                    token_ids=s.output_token_ids,
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
                for s in sorted(request.seqs, key=lambda s: s.index)
            ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_reused_segment_tokens=request.num_reused_segment_tokens,
            error=request.error,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs else None,
            kv_retained_tokens=tuple(request.kv_retained_tokens),
        )
