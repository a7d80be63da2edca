"""Requests and their sequences: the engine's unit of bookkeeping.

A ``Request`` is one prompt with its sampling parameters; it owns one ``Sequence`` until its prompt
is prefilled, then ``n`` sequences (parallel sampling) or ``beam_width`` (beam search), forks that
share the prompt's KV blocks. The scheduler is the only code that changes a request or a sequence
after it was queued: it schedules, appends, forks, finishes and frees. Preemption and admission
act on a whole request, so the sequences of a group always run together.

Index ranges of one sequence (``num_tokens = len(token_ids)``)::

    token_ids:  | prompt ............................ | output ...... |
                0                             num_prompt_tokens    num_tokens
    KV cache:   | computed (cached or run) | to compute |
                0                 num_computed_tokens   num_tokens

A step that brings ``num_computed_tokens`` to ``num_tokens`` has run the sequence's last token
through the model: that step samples its next token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from prefixserve.core.detokenizer import IncrementalDetokenizer
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from prefixserve.structured_outputs.grammar import Grammar
    from prefixserve.structured_outputs.request import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One growing token sequence with its own KV block table (kept by the KV cache manager).

    ``seq_id`` is assigned by the scheduler when the sequence is queued or forked.
    ``block_hashes`` holds the chained hash of every full block of ``token_ids`` (with prefix
    caching on); ``logprobs`` is None unless the request asked for them. ``grammar`` (structured
    outputs) has accepted exactly the output tokens; it survives preemption, since recomputing a
    sequence's tokens accepts nothing again.
    """

    index: int  # position among the request's outputs (beam search: rank, best first)
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = -1
    detokenizer: IncrementalDetokenizer | None = None
    grammar: Grammar | None = None
    num_computed_tokens: int = 0
    block_hashes: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # prompt ranges [start, end) whose K/V a segment copy wrote at admission (ahead of
    # ``num_computed_tokens``): the scheduler steps over each one instead of computing it
    # (``ScheduledSeq.pieces``)
    reuse_spans: list[tuple[int, int]] = field(default_factory=list)
    # (characters of text, tokens) already in a DELTA output; the output processor's alone (a
    # fork starts at none: its first delta holds what it shares with its source)
    num_sent: tuple[int, int] = (0, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def fork(self, seq_id: int, index: int) -> Sequence:
        """An independent copy at the same state (tokens, progress, hashes, text, logprobs)."""
        return Sequence(
            index=index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            seq_id=seq_id,
            detokenizer=self.detokenizer.fork() if self.detokenizer is not None else None,
            grammar=self.grammar.fork() if self.grammar is not None else None,
            num_computed_tokens=self.num_computed_tokens,
            block_hashes=list(self.block_hashes),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )


@dataclass(eq=False)
class Request:
    """A prompt, its parameters and its sequences. ``seqs`` holds live and finished sequences.

    ``generators`` (seeded sampling only) holds one generator per sample index, so sample ``j``
    draws from its own stream whatever else shares the batch, before and after the fork.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    extra_keys: tuple
    max_total_tokens: int  # stop at this length (prompt + output): max_tokens or max_model_len
    seqs: list[Sequence] = field(default_factory=list)
    generators: list[torch.Generator] | None = None
    structured_output: StructuredOutputRequest | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int | None = None  # prompt tokens not computed at first admission
    num_reused_segment_tokens: int = 0  # of those, the ones copied from reused segments
    error: str | None = None  # set when the engine failed this request alone
    # prompt_logprobs: per prompt position so far, None for the first (nothing predicts it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # bad_words as token sequences: the last token is banned after the ones before it
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # beam search: finished hypotheses kept aside, best first, at most beam_width
    finished_beams: list = field(default_factory=list)
    # the tiers under the pool: None (not asked yet), "loading" (waits for it), "done"
    kv_load: str | None = None
    # per ``kv_retention`` entry: the leading tokens whose blocks it retained, None until applied
    kv_retained_tokens: list[int | None] = field(default_factory=list)

    @property
    def kv_retention(self) -> tuple:
        """The ``KVRetention`` s of its parameters (none for beam search)."""
        return getattr(self.params, "kv_retention", ())

    @property
    def kv_resume(self) -> tuple[str, ...]:
        """The sessions its parameters continue (none for beam search)."""
        return getattr(self.params, "kv_resume", ())

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs`` of the request's parameters (None: not asked for)."""
        return getattr(self.params, "prompt_logprobs", None)

    @property
    def num_samples(self) -> int:
        """How many sequences the request grows after its prompt: n, or the beam width."""
        if isinstance(self.params, BeamSearchParams):
            return self.params.beam_width
        return self.params.n

    @property
    def awaits_fork(self) -> bool:
        """An n > 1 sampling request still on its one prompt sequence: its first sample forks it."""
        return not self.is_beam_search and self.num_samples > 1 and len(self.seqs) == 1

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
