"""A request's state becomes the ``RequestOutput`` the caller sees (vLLM's output shapes), in the
request's ``RequestOutputKind``: everything so far, what is new, or the final output only.

Text comes from each sequence's incremental detokenizer, which the scheduler feeds as it appends
tokens (stop strings are found there; a sequence's text only grows); beam search decodes its
finished hypotheses once, at the end. For DELTA, ``Sequence.num_sent`` (this module's alone)
records what earlier outputs carried, so a sequence's deltas concatenate to its whole output.

``observer(progress, now)``, when set, sees every request an output is made for (a step's, an
abort's, a failed step's), DELTA and FINAL_ONLY ones included, before outputs are shaped: the
server's latency metrics read it on the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prefixserve.core.outputs import CompletionOutput, RequestOutput, RequestProgress
from prefixserve.core.sampling_params import RequestOutputKind
from prefixserve.core.sequence import Request, Sequence
from prefixserve.sample.beam_search import beam_outputs

ProgressObserver = Callable[[list[RequestProgress], float], None]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.observer: ProgressObserver | None = None

    def make_outputs(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """The outputs of ``requests`` their kinds call for now (FINAL_ONLY ones: only once
        finished); the observer sees every request's progress."""
        made = [(r, self._make_output(r)) for r in requests]
        if self.observer is not None and made:
            self.observer([_progress(r, o) for r, o in made], time.monotonic())
        return [o for _, o in made if o is not None]

    def _make_output(self, request: Request) -> RequestOutput | None:
        kind = request.params.output_kind
        if (
            kind is not RequestOutputKind.CUMULATIVE
            and not request.is_finished
            and (kind is RequestOutputKind.FINAL_ONLY or request.is_beam_search)
        ):
            return None
        if request.is_beam_search:
            outputs = beam_outputs(request, self.tokenizer)
        else:
            seqs = sorted(request.seqs, key=lambda s: s.index)
            delta = kind is RequestOutputKind.DELTA
            outputs = [_delta(s) if delta else _whole(s) for s in seqs]
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


def _whole(s: Sequence) -> CompletionOutput:
    return CompletionOutput(
        index=s.index,
        text=s.detokenizer.output_text,
        token_ids=s.output_token_ids,
        cumulative_logprob=s.cumulative_logprob,
        logprobs=list(s.logprobs) if s.logprobs is not None else None,
        finish_reason=s.finish_reason,
        stop_reason=s.stop_reason,
    )


def _delta(s: Sequence) -> CompletionOutput:
    """What ``s`` gained since its last delta (all of it at first); marks it sent."""
    chars, tokens = s.num_sent
    text = s.detokenizer.output_text
    first_new = s.num_prompt_tokens + tokens
    s.num_sent = (len(text), s.num_tokens - s.num_prompt_tokens)
    return CompletionOutput(
        index=s.index,
        text=text[chars:],
        token_ids=s.token_ids[first_new:],
        cumulative_logprob=s.cumulative_logprob,
        logprobs=s.logprobs[tokens:] if s.logprobs is not None else None,
        finish_reason=s.finish_reason,
        stop_reason=s.stop_reason,
    )


def _progress(request: Request, output: RequestOutput | None) -> RequestProgress:
    """``output``: the one made for it now (a finished request always has one)."""
    reason = output.outputs[0].finish_reason if output is not None and output.outputs else None
    return RequestProgress(
        request.request_id,
        request.arrival_time,
        sum(s.num_tokens - s.num_prompt_tokens for s in request.seqs),
        request.is_finished,
        reason if request.is_finished else None,
    )
