"""What ``LLM.generate`` returns and ``LLMEngine.step`` streams: vLLM's output shapes, and each
request's progress in a step (for metrics, whatever the request's output kind)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt.

    ``token_ids`` holds generated tokens only (with ``RequestOutputKind.DELTA``: the new ones, and
    ``text`` and ``logprobs`` what they added). ``logprobs`` is None unless asked for; else one dict
    per generated token mapping token id -> logprob, holding the sampled token and the top-k.
    ``finish_reason`` is None while running, then ``"stop"`` (EOS, a stop string or a stop token),
    ``"length"`` (max_tokens or the context limit) or ``"abort"``; ``stop_reason`` is the matched
    stop string or stop token id, else None.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """The state of one request: its prompt, the tokens served from the prefix cache, its outputs.

    ``num_cached_tokens`` counts prompt tokens whose KV the request did not compute, at its first
    scheduling: its prefix-cache hit, plus ``num_reused_segment_tokens``, the tokens of reused
    segments copied rather than recomputed (``EngineConfig.segment_reuse``; 0 without). ``outputs`` are in index order (for beam search: best first).
    ``prompt_logprobs`` (when asked for): per prompt token a dict {token_id: logprob} holding that
    token and the top k at its position, None for the first token; filled as the prompt runs.
    ``kv_retained_tokens``: per ``SamplingParams.kv_retention`` entry, the leading tokens whose
    blocks it retained (block-aligned, within the tenant's share of the retention budget); None
    until it was applied (a prompt's once the prompt is computed, ``include_output`` at the end).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    num_reused_segment_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    kv_retained_tokens: tuple[int | None, ...] = ()

    def add(self, delta: RequestOutput) -> RequestOutput:
        """This output extended by ``delta``, the same request's next ``DELTA`` output: each
        choice's text, tokens and logprobs concatenated (a choice first seen in ``delta`` is
        added), everything else ``delta``'s. ``self`` is left as it was."""
        choices = {c.index: c for c in self.outputs}
        for d in delta.outputs:
            c = choices.get(d.index)
            if c is None:
                choices[d.index] = d
                continue
            logprobs = None if c.logprobs is None else c.logprobs + (d.logprobs or [])
            choices[d.index] = CompletionOutput(
                d.index, c.text + d.text, c.token_ids + d.token_ids, d.cumulative_logprob,
                logprobs, d.finish_reason, d.stop_reason,
            )  # fmt: skip
        return replace(delta, outputs=[choices[i] for i in sorted(choices)])


class RequestProgress(NamedTuple):
    """Where one request stands after a step: every touched request has one, whatever its
    output kind (``OutputProcessor.observer``)."""

    request_id: str
    arrival_time: float  # time.monotonic() when the engine took it
    num_output_tokens: int  # generated so far, over all its sequences
    finished: bool
    finish_reason: str | None  # its first output's, once finished
