"""A step's logits become tokens: one ``SamplingResult`` for the scheduler to apply.

For every sequence that samples this step, in one batched call: mask what its grammar forbids
(structured outputs: one bitmask row per constrained sequence, filled in one batched call), ban
EOS and stop tokens before ``min_tokens``, apply penalties, sample, take logprobs (``Sampler``).
The first sample of an n > 1 request draws n tokens from its one row, one per sample index and
generator; the scheduler forks the sequence when it applies them. Beam-search requests get their
``BeamStep`` instead, scored over the tokens their beams' grammars allow.

A speculating sequence owns ``1 + k`` consecutive rows (its last token, then its k drafts). Row
``j`` is sampled exactly as plain decoding would sample the token after ``drafts[:j]`` (its
penalties, bans and grammar mask see those drafts as output). Verification keeps drafts while
each row's sample equals the draft; the first row whose sample differs (or the row after the
last draft, the bonus) gives the next token. With a point-mass draft this is the standard
accept/resample rule: the sample equals the draft with probability p(draft) (accept), and a sample
that differs is distributed as p with the draft removed and renormalized (the residual). Greedy
rows reduce to "accept while argmax equals the draft". So the output distribution is exactly that
of plain decoding; a seeded request draws from its generator once per scored row, so it is
reproducible for a given speculative config, but not token-identical to the same seed without
speculation when it samples at temperature > 0.

Nothing here changes a request or a sequence. One request's fault (NaN or inf logits, an
exception while sampling it or deciding its beams) lands in ``failed`` and the others carry on:
when the batched call raises, it is retried request by request to find the culprit.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixserve.core.sampling_params import SamplingParams
from prefixserve.core.scheduler_output import ScheduledSeq
from prefixserve.core.sequence import Request, Sequence
from prefixserve.kernels.cpu_sampling import finite_rows
from prefixserve.sample import beam_search
from prefixserve.sample.beam_search import BeamStep
from prefixserve.sample.sampler import Sampler, SamplerOutput
from prefixserve.sample.sampling_metadata import SamplingMetadata
from prefixserve.structured_outputs.grammar import Grammar, allocate_bitmask, apply_bitmask
from prefixserve.structured_outputs.manager import StructuredOutputManager


@dataclass(slots=True)
class SampledToken:
    """A sampled token, its logprob and the top logprobs (empty unless the request asked)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass
class SamplingResult:
    """``tokens``: per sampling sequence, its sampled token (n tokens for a first sample that
    forks). ``beams``: per beam-search request, its step. ``failed``: requests to end with an
    error, and why. ``prompt_logprobs``: what this step scored of prompts that asked for it.
    ``verified``: per speculating sequence, the tokens it emits in order."""

    tokens: list[tuple[ScheduledSeq, list[SampledToken]]] = field(default_factory=list)
    # per speculating sequence: its accepted drafts, then the token sampled after them
    verified: list[tuple[ScheduledSeq, list[SampledToken]]] = field(default_factory=list)
    beams: list[tuple[Request, BeamStep]] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)
    # (request, position of the first entry, one {token: logprob} per prompt position)
    prompt_logprobs: list[tuple[Request, int, list[dict[int, float]]]] = field(default_factory=list)


# (scheduled sequence, row of the step's logits, sample index, drafts before the row): one
# sampled token each
_Row = tuple[ScheduledSeq, int, int, int]


class SamplingStep:
    def __init__(
        self,
        sampler: Sampler,
        eos_token_ids: Set[int],
        structured_outputs: StructuredOutputManager,
        tokenizer: Any = None,
    ) -> None:
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.structured_outputs = structured_outputs
        self.tokenizer = tokenizer  # beam search reads candidates' text for stop strings

    def sample(
        self,
        samplers: list[ScheduledSeq],
        logits: torch.Tensor,
        prompt_logits: SequenceABC[tuple[ScheduledSeq, torch.Tensor]] = (),
    ) -> SamplingResult:
        """``samplers[i]`` owns ``num_sample_rows`` consecutive rows of ``logits``, in order;
        ``prompt_logits`` score prompt tokens."""
        result = SamplingResult()
        for sched, rows in prompt_logits:
            try:
                result.prompt_logprobs.append(_prompt_logprobs(sched, rows))
            except Exception as exc:
                result.failed.append((sched.request, describe_error(exc, "prompt logprobs")))
        rows: list[_Row] = []
        beam_rows: dict[str, list[int]] = {}
        i = 0
        for sched in samplers:
            request = sched.request
            if request.is_beam_search:
                beam_rows.setdefault(request.request_id, []).append(i)
            elif request.awaits_fork:
                rows.extend((sched, i, j, 0) for j in range(request.num_samples))
            else:
                index = sched.seq.index
                rows.extend((sched, i + j, index, j) for j in range(sched.num_sample_rows))
            i += sched.num_sample_rows
        assert i == logits.shape[0], f"{i} sample rows but {logits.shape[0]} logits rows"
        rows = self._drop_non_finite(rows, logits, result)
        if rows:
            self._sample_rows(rows, logits, result)
        for indices in beam_rows.values():
            self._decide_beams([samplers[i] for i in indices], logits[indices], result)
        return result

    @staticmethod
    def _drop_non_finite(rows: list[_Row], logits: torch.Tensor, result: SamplingResult):
        """Rows whose logits hold NaN or inf fail their request instead of poisoning sampling
        (``finite_rows``: one read of each row)."""
        finite = finite_rows(logits).tolist()
        if all(finite):
            return rows
        bad = {i for i, ok in enumerate(finite) if not ok}
        failed = {sched.request.request_id: sched.request for sched, i, _, _ in rows if i in bad}
        result.failed.extend((r, "the model produced non-finite logits") for r in failed.values())
        return [row for row in rows if row[0].request.request_id not in failed]

    def _sample_rows(self, rows: list[_Row], logits: torch.Tensor, result: SamplingResult) -> None:
        try:
            self._collect(rows, self._sample(rows, logits), result)
        except Exception:
            by_request: dict[str, list[_Row]] = {}
            for row in rows:
                by_request.setdefault(row[0].request.request_id, []).append(row)
            for group in by_request.values():
                try:
                    self._collect(group, self._sample(group, logits), result)
                except Exception as exc:
                    result.failed.append((group[0][0].request, describe_error(exc, "sampling")))

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> SamplerOutput:
        params = [sched.request.params for sched, _, _, _ in rows]
        seqs = [sched.seq for sched, _, _, _ in rows]
        # row j's output so far: the sequence's, then the drafts scored before the row
        outputs = [
            sched.seq.output_token_ids + sched.draft_token_ids[:d] for sched, _, _, d in rows
        ]
        indices = [i for _, i, _, _ in rows]
        if indices != list(range(logits.shape[0])):  # else every row, in order: no copy
            logits = logits.index_select(0, torch.tensor(indices, device=logits.device))
        generators = {}
        for j, (sched, _, sample, _) in enumerate(rows):
            if sched.request.generators is not None:
                generators[j] = sched.request.generators[sample]
        metadata = SamplingMetadata.from_params(
            params,
            output_token_ids=outputs,
            prompt_token_ids=[sched.request.prompt_token_ids for sched, _, _, _ in rows],
            generators=generators,
            banned_token_ids=[
                self._banned_tokens(sched.request, output, sched.seq.grammar is not None)
                for (sched, _, _, _), output in zip(rows, outputs)
            ],
            device=logits.device,
        )
        metadata.bitmask_rows = [j for j, s in enumerate(seqs) if s.grammar is not None]
        if metadata.bitmask_rows:
            drafts = [rows[j][0].draft_token_ids[: rows[j][3]] for j in metadata.bitmask_rows]
            metadata.token_bitmask = self._bitmask(
                seqs, metadata.bitmask_rows, logits.shape[-1], drafts
            )
        return self.sampler(logits, metadata)

    def _bitmask(
        self,
        seqs: list[Sequence],
        rows: list[int],
        vocab_size: int,
        drafts: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Row ``rows[i]``: what ``seqs[rows[i]]``'s grammar allows next after ``drafts[i]``
        (batched fill for the rows without drafts; one by one, advancing the matcher over the
        drafts and rolling it back, for the others)."""
        bitmask = allocate_bitmask(len(seqs), vocab_size)
        drafts = drafts or [[] for _ in rows]
        plain = [j for j, d in zip(rows, drafts) if not d]
        self.structured_outputs.fill_bitmasks([seqs[j].grammar for j in plain], bitmask, plain)
        for j, before in zip(rows, drafts):
            if before:
                _fill_after(seqs[j].grammar, before, bitmask, j)
        return bitmask

    def _banned_tokens(self, request: Request, output: list[int], constrained: bool) -> list[int]:
        """Tokens a sequence whose output is ``output`` may not sample next: the last token of a
        bad word whose other tokens end its output; and before ``min_tokens``, EOS and the stop
        token ids (under a grammar, ``constrained``, which alone decides where the output may
        end, only the stop token ids)."""
        params: SamplingParams = request.params  # type: ignore[assignment]
        banned = []
        for word in request.bad_words_token_ids:
            before = len(word) - 1  # tokens that must end the output for the last one to be banned
            if before == 0 or (
                len(output) >= before and output[len(output) - before :] == word[:-1]
            ):
                banned.append(word[-1])
        if len(output) < params.min_tokens:
            banned.extend(params.stop_token_ids)
            if not params.ignore_eos and not constrained:
                banned.extend(self.eos_token_ids)
        return banned

    @staticmethod
    def _collect(rows: list[_Row], out: SamplerOutput, result: SamplingResult) -> None:
        token_ids = out.sampled_token_ids.tolist()
        logprobs = out.sampled_logprobs.tolist()
        topk_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
        topk_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
        last: ScheduledSeq | None = None
        for j, (sched, _, _, before) in enumerate(rows):
            k = sched.request.params.logprobs
            top = list(zip(topk_ids[j][:k], topk_lps[j][:k])) if k and topk_ids else []
            token = SampledToken(token_ids[j], logprobs[j], top)
            if sched.draft_token_ids:
                _verify(result.verified, sched, before, token)
            elif sched is last:  # the next sample of a forking row
                result.tokens[-1][1].append(token)
            else:
                result.tokens.append((sched, [token]))
            last = sched

    def _decide_beams(
        self, scheds: list[ScheduledSeq], logits: torch.Tensor, result: SamplingResult
    ) -> None:
        request = scheds[0].request
        seqs = [s.seq for s in scheds]
        try:
            rows = [j for j, s in enumerate(seqs) if s.grammar is not None]
            if rows:  # ``logits`` is this request's own copy (gathered by row indices)
                apply_bitmask(logits, self._bitmask(seqs, rows, logits.shape[-1]), rows)
            step = beam_search.decide(request, seqs, logits, self.eos_token_ids, self.tokenizer)
        except Exception as exc:
            result.failed.append((request, describe_error(exc, "beam search")))
            return
        result.beams.append((request, step))


def _verify(
    verified: list[tuple[ScheduledSeq, list[SampledToken]]],
    sched: ScheduledSeq,
    before: int,
    token: SampledToken,
) -> None:
    """Row ``before`` of a speculating sequence (rows arrive in order): its token is emitted iff
    every earlier row's token equalled its draft (all drafts before it were accepted)."""
    if before == 0:
        verified.append((sched, [token]))
        return
    emitted = verified[-1][1]
    if len(emitted) == before and emitted[-1].token_id == sched.draft_token_ids[before - 1]:
        emitted.append(token)


def _fill_after(grammar: Grammar, drafts: list[int], bitmask: torch.Tensor, row: int) -> None:
    """``bitmask[row]``: what the grammar allows after ``drafts``; the grammar is left as it was.
    The scheduler proposed only drafts the grammar accepts without terminating."""
    accepted = 0
    for token_id in drafts:
        if not grammar.accept_token(token_id):
            break
        accepted += 1
    try:
        assert accepted == len(drafts), "a proposed draft is one the grammar accepts"
        grammar.fill_bitmask(bitmask, row)
    finally:
        grammar.rollback(accepted)


def _prompt_logprobs(
    sched: ScheduledSeq, logits: torch.Tensor
) -> tuple[Request, int, list[dict[int, float]]]:
    """Row ``j`` of ``logits`` (position ``start + j``) scores the prompt token at ``start + j + 1``:
    its logprob and the request's top k, from the raw logits."""
    request, start = sched.request, sched.seq.num_computed_tokens
    targets = request.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0].tolist()
    top_lps, top_ids = logprobs.topk(request.num_prompt_logprobs or 0, dim=-1)
    entries = []
    for target, lp, ids, lps in zip(targets, chosen, top_ids.tolist(), top_lps.tolist()):
        entry = {target: lp}
        for tid, tlp in zip(ids, lps):
            entry.setdefault(tid, tlp)
        entries.append(entry)
    return request, start + 1, entries


def describe_error(exc: Exception, stage: str) -> str:
    return f"internal error in {stage}: {type(exc).__name__}: {exc}"
