"""``RequestLifecycle`` alone, without a scheduler or a model: what one step's result does to a
request's sequences (progress, appends and hashes, forks, beam steps, jump-forward, stops, frees,
failures). Block ids and ref counts come from a plain ``KVCacheManager``."""

from __future__ import annotations

from test_scheduler import BS, EOS, make_request

from prefixserve.core.config import EngineConfig
from prefixserve.core.sampling_params import BeamSearchParams
from prefixserve.core.scheduler_output import ScheduledSeq, SchedulerOutput
from prefixserve.engine.request_lifecycle import RequestLifecycle
from prefixserve.engine.stop_checker import StopChecker
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.sample.beam_search import BeamStep
from prefixserve.sample.sampling_step import SampledToken, SamplingResult


def make_lifecycle(num_blocks: int = 16, **config) -> RequestLifecycle:
    kv = KVCacheManager(num_blocks, BS)
    return RequestLifecycle(EngineConfig(block_size=BS, **config), kv, StopChecker(frozenset({EOS})))


def admit(life: RequestLifecycle, request, num_new: int | None = None) -> SchedulerOutput:
    """Admit every live sequence of ``request`` with no cache hit; one step of ``num_new``."""
    life.register(request)
    out = SchedulerOutput()
    for seq in request.live_seqs():
        n = seq.num_uncomputed_tokens if num_new is None else num_new
        assert life.kv.allocate_for_prompt(seq.seq_id, life.kv.lookup(seq.token_ids, []), n)
        out.scheduled.append(ScheduledSeq(request, seq, n))
    return out


def test_register_gives_ids_and_hashes_every_full_block():
    life = make_lifecycle()
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    life.register(a)
    life.register(b)
    assert (a.seqs[0].seq_id, b.seqs[0].seq_id) == (0, 1)
    assert len(a.seqs[0].block_hashes) == 2  # 9 tokens: two full blocks of 4
    assert a.seqs[0].block_hashes == b.seqs[0].block_hashes


def test_a_chunk_advances_progress_and_counts_computed_prompt_tokens_only():
    life = make_lifecycle()
    request = make_request("a", list(range(10)))
    out = admit(life, request, num_new=6)
    assert life.apply(out, SamplingResult()) == []  # a chunk that samples nothing: no output
    assert request.seqs[0].num_computed_tokens == 6 and life.computed_prompt_tokens == 6
    out = SchedulerOutput(scheduled=[ScheduledSeq(request, request.seqs[0], 4)])
    assert life.kv.append_slots(request.seqs[0].seq_id, 6, 4) == []
    life.apply(out, SamplingResult(tokens=[(out.scheduled[0], [SampledToken(7, -0.5, [])])]))
    seq = request.seqs[0]
    assert seq.output_token_ids == [7] and seq.cumulative_logprob == -0.5
    assert life.computed_prompt_tokens == 10 and life.generation_tokens == 1
    assert len(seq.block_hashes) == 2  # 11 tokens: still two full blocks


def test_a_stop_frees_the_sequence_and_leaves_retiring_to_the_scheduler():
    life = make_lifecycle()
    request = make_request("a", [3, 4, 5])
    out = admit(life, request)
    life.apply(out, SamplingResult(tokens=[(out.scheduled[0], [SampledToken(EOS, 0.0, [])])]))
    assert request.seqs[0].finish_reason == "stop"
    assert life.kv.stats()["used_blocks"] == 0
    assert not request.is_finished  # the status and queues are the scheduler's


def test_n_samples_fork_the_prompt_sequence_sharing_its_blocks():
    life = make_lifecycle()
    request = make_request("n2", list(range(6)), n=2)
    out = admit(life, request)
    tokens = [SampledToken(11, -1.0, []), SampledToken(12, -2.0, [])]
    life.apply(out, SamplingResult(tokens=[(out.scheduled[0], tokens)]))
    a, b = request.seqs
    assert (a.output_token_ids, b.output_token_ids) == ([11], [12])
    assert life.kv.get_block_table(a.seq_id) == life.kv.get_block_table(b.seq_id)
    assert life.generation_tokens == 2


def test_a_beam_step_forks_the_twice_chosen_and_frees_the_unchosen():
    life = make_lifecycle()
    request = make_request("beam", list(range(6)))
    request.params = BeamSearchParams(beam_width=2, max_tokens=4)
    out = admit(life, request)
    life.apply(out, SamplingResult())  # the prompt is in; the beams start from it
    parent = request.seqs[0]
    step = BeamStep(continuations=[(parent, 5, -0.1), (parent, 6, -0.2)], finished=[], done=False)
    life.apply(SchedulerOutput(), SamplingResult(beams=[(request, step)]))
    first, second = request.seqs
    assert (first.index, second.index) == (0, 1) and first is parent
    assert (first.output_token_ids, second.output_token_ids) == ([5], [6])
    assert second.cumulative_logprob == -0.2
    step = BeamStep(continuations=[(second, 8, -0.3), (second, 9, -0.4)], finished=[], done=False)
    life.apply(SchedulerOutput(), SamplingResult(beams=[(request, step)]))
    assert parent.finish_reason == "abort"  # not chosen: freed
    assert [s.output_token_ids for s in request.seqs] == [[6, 8], [6, 9]]


def test_a_failure_aborts_the_request_once_with_the_first_message():
    life = make_lifecycle()
    request = make_request("bad", [1, 2, 3])
    out = admit(life, request)
    result = SamplingResult(failed=[(request, "boom"), (request, "later")])
    assert life.apply(out, result) == [request]
    assert request.error == "boom" and request.seqs[0].finish_reason == "abort"
    assert life.kv.stats()["used_blocks"] == 0


def test_a_token_the_grammar_refuses_fails_its_request_alone():
    life = make_lifecycle()
    good, bad = make_request("good", [1, 2]), make_request("bad", [3, 4])

    class Refuses:
        def accept_token(self, token: int) -> bool:
            return False

    out = SchedulerOutput()
    for request in (good, bad):
        out.scheduled += admit(life, request).scheduled
    bad.seqs[0].grammar = Refuses()
    result = SamplingResult(
        tokens=[(s, [SampledToken(9, 0.0, [])]) for s in out.scheduled]
    )
    life.apply(out, result)
    assert good.seqs[0].output_token_ids == [9] and good.error is None
    assert "grammar does not allow" in bad.error and bad.seqs[0].finish_reason == "abort"


def test_jump_forward_appends_forced_tokens_but_leaves_one_to_sample():
    class Forces:
        def __init__(self, tokens):
            self.tokens = tokens

        def accept_token(self, token: int) -> bool:
            return True

        def jump_forward_tokens(self) -> list[int]:
            return list(self.tokens)

        def is_terminated(self) -> bool:
            return False

    life = make_lifecycle(enable_jump_forward=True)
    request = make_request("jf", [1, 2], max_tokens=4)
    out = admit(life, request)
    request.seqs[0].grammar = Forces([20, 21, 22, 23, 24])
    life.apply(out, SamplingResult(tokens=[(out.scheduled[0], [SampledToken(9, 0.0, [])])]))
    # 1 sampled + forced up to the length limit less one (left to sample): 9, 20, 21
    assert request.seqs[0].output_token_ids == [9, 20, 21]
    assert request.seqs[0].num_computed_tokens == 2  # forced text is computed next step
