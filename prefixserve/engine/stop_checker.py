"""When a sampled token ends its sequence, and why (vLLM's finish and stop reasons).

Checked in this order once the token was appended::

    a stop token id (not before min_tokens)           -> "stop", stop_reason = the id; its text is
                                                         left out unless include_stop_str_in_output
    then the token's text goes to the detokenizer, and:
    EOS (unless ignore_eos; not before min_tokens)    -> "stop", stop_reason None
    a stop string completed in the text               -> "stop", stop_reason = the string
    its grammar (structured outputs) is complete      -> "stop", stop_reason None
    the request's length limit (max_tokens, context)  -> "length"

A sequence that ends for any other reason than a stop string has its held-back text released
(``flush``), so its final text is complete.
"""

from __future__ import annotations

from collections.abc import Set

from prefixserve.core.sampling_params import SamplingParams
from prefixserve.core.sequence import Request, Sequence

FinishReason = tuple[str, str | int | None]  # (finish_reason, stop_reason)


class StopChecker:
    """Stateless apart from the model's EOS token ids."""

    def __init__(self, eos_token_ids: Set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def check(self, request: Request, seq: Sequence, token: int) -> FinishReason | None:
        """Feed ``token`` (already appended to ``seq``) to the detokenizer; the finish, if any.

        A stop token id ends the output without its text, unless ``include_stop_str_in_output``.
        """
        params: SamplingParams = request.params  # type: ignore[assignment]
        past_min = seq.num_output_tokens >= params.min_tokens
        if past_min and token in params.stop_token_ids:
            if params.include_stop_str_in_output:
                seq.detokenizer.update([token])
            seq.detokenizer.flush()
            return ("stop", token)
        stop_str = seq.detokenizer.update([token])
        reason: FinishReason | None = None
        if past_min and not params.ignore_eos and token in self.eos_token_ids:
            reason = ("stop", None)
        elif stop_str is not None:
            return ("stop", stop_str)
        elif seq.grammar is not None and seq.grammar.is_terminated():
            reason = ("stop", None)
        elif seq.num_tokens >= request.max_total_tokens:
            reason = ("length", None)
        if reason is not None:
            seq.detokenizer.flush()
        return reason
