"""What the scheduler hands the model runner for one step: a value, read by everyone after it."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.sequence import Request, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """``num_new_tokens`` tokens of ``seq`` run this step, starting at ``seq.num_computed_tokens``."""

    request: Request
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so its next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step: the scheduled sequences, each one's block table (keyed by ``seq_id``, covering
    every token it runs) and the copy-on-write ``(src, dst)`` block copies to perform first.
    ``finished``: waiting requests that ended before running (their grammar failed to compile,
    or the text it forces already ends the output); they get their final output this step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.finished
