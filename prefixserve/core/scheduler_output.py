"""What the scheduler hands the model runner for one step: a value, read by everyone after it."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.core.sequence import Request, Sequence
from prefixserve.kv.segments import SegmentCopy


@dataclass(slots=True)
class ScheduledSeq:
    """``num_new_tokens`` tokens of ``seq`` run this step, starting at ``seq.num_computed_tokens``.

    A speculating sequence (its last token only) also runs ``draft_token_ids`` after it: tokens
    not in ``seq.token_ids``, whose slots follow the last token's. Its step scores
    ``1 + len(draft_token_ids)`` rows; the verifier decides how many drafts become tokens::

        positions   ... | last | d0 | d1 | d2 |     (num_query_tokens = 4)
        row scores        d0     d1   d2   bonus

    A sequence with reused segments (``Sequence.reuse_spans``) may run its tokens as several
    ``pieces`` ``(start, n)`` in position order, the reused spans between them stepped over
    (their K/V was copied at admission); ``num_new_tokens`` is the pieces' total, and the step
    ends at ``end``::

        positions   | computed | piece | reused span | piece | reused span | piece |
                    0    num_computed_tokens                                      end
    """

    request: Request
    seq: Sequence
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    pieces: list[tuple[int, int]] | None = None  # None: one, from seq.num_computed_tokens

    def query_pieces(self) -> list[tuple[int, int]]:
        """``(start, n)`` of each stretch of tokens this step runs, drafts not included."""
        if self.pieces is not None:
            return self.pieces
        return [(self.seq.num_computed_tokens, self.num_new_tokens)]

    @property
    def end(self) -> int:
        """The sequence's computed tokens once this step ran (drafts not included)."""
        start, n = self.query_pieces()[-1]
        return start + n

    @property
    def num_query_tokens(self) -> int:
        """Tokens this step writes K/V for: the scheduled ones plus the drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Logits rows this step samples from (0 when it does not reach the last token)."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so its next token is sampled."""
        return self.end == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step: the scheduled sequences, each one's block table (keyed by ``seq_id``, covering
    every token it runs), the copy-on-write ``(src, dst)`` block copies to perform first, then
    the segment copies. ``finished``: waiting requests that ended before running (their grammar
    failed to compile, or the text it forces already ends the output); they get their final
    output this step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    segment_copies: list[SegmentCopy] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.finished
