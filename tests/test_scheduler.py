"""The scheduler's own decisions, exactly: budget split, preemption victim and order, no admission
after a preemption, the prefix policy and its aging, the watermark, and what ``update_from_output``
does with a step's samples (forks, stops, frees, failures). No model, no tensors."""

from __future__ import annotations

import time

import pytest

from prefixserve.core.config import EngineConfig
from prefixserve.core.detokenizer import IncrementalDetokenizer
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.core.sampling_params import SamplingParams
from prefixserve.core.scheduler_output import SchedulerOutput
from prefixserve.core.sequence import Request, RequestStatus, Sequence
from prefixserve.engine.scheduler import AGING_TOKENS_PER_SECOND, Scheduler
from prefixserve.engine.stop_checker import StopChecker
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.models.builtin import builtin_tokenizer
from prefixserve.sample.sampling_step import SampledToken, SamplingResult

BS = 4
EOS = 1
TOKENIZER = builtin_tokenizer()


def make_scheduler(num_blocks: int, watermark: float = 0.0, **config) -> Scheduler:
    config.setdefault("block_size", BS)
    kv = KVCacheManager(num_blocks, BS, config.get("enable_prefix_caching", True), watermark)
    return Scheduler(EngineConfig(**config), kv, StopChecker(frozenset({EOS})), None)


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    seq = Sequence(index=0, token_ids=list(prompt), num_prompt_tokens=len(prompt))
    seq.detokenizer = IncrementalDetokenizer(TOKENIZER, prompt, stop=params.stop)
    return Request(rid, None, list(prompt), params, (), len(prompt) + max_tokens, seqs=[seq])


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def sample_all(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Request]:
    """Apply a step in which every sampling sequence drew ``token``."""
    result = SamplingResult(
        tokens=[(s, [SampledToken(token, -0.5, [])]) for s in out.scheduled if s.samples]
    )
    return sched.update_from_output(out, result)


def waiting_ids(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.waiting]


def test_budget_runs_decodes_first_then_chunks_the_rest():
    sched = make_scheduler(64, max_num_batched_tokens=16)
    sched.add_request(make_request("a", list(range(10))))
    sched.add_request(make_request("b", list(range(100, 130))))
    out = sched.schedule()
    assert scheduled(out) == [("a", 10), ("b", 6)]  # b is chunked to the budget left
    sample_all(sched, out)
    out = sched.schedule()
    assert scheduled(out) == [("a", 1), ("b", 15)]  # a's decode comes out of the budget first
    sample_all(sched, out)
    out = sched.schedule()
    assert scheduled(out) == [("a", 1), ("b", 9)]  # b's last chunk: it samples
    assert [s.samples for s in out.scheduled] == [True, True]


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(64, max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, [1, 2, 3]))
    assert scheduled(sched.schedule()) == [("a", 3), ("b", 3)]
    assert waiting_ids(sched) == ["c"]


def test_chunked_prefill_off_admits_only_whole_prompts():
    sched = make_scheduler(64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add_request(make_request("a", list(range(6))))
    sched.add_request(make_request("b", list(range(20, 26))))
    assert scheduled(sched.schedule()) == [("a", 6)]  # b does not fit the 2 tokens left
    assert waiting_ids(sched) == ["b"]


def test_preemption_takes_the_last_running_request_and_puts_it_first_in_line():
    sched = make_scheduler(7, enable_prefix_caching=False)
    sched.add_request(make_request("a", list(range(8))))  # 2 blocks
    sched.add_request(make_request("b", list(range(10, 18))))  # 2 blocks
    sched.add_request(make_request("c", list(range(20, 31))))  # 3 blocks: the pool is full
    sample_all(sched, sched.schedule())  # a and b reach 9 tokens: each needs a third block
    sched.add_request(make_request("d", [40]))
    out = sched.schedule()
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert waiting_ids(sched) == ["c", "d"]  # the victim goes back to the front
    assert sched.stats().num_preemptions == 1
    c = sched.requests["c"]
    assert c.status is RequestStatus.WAITING and c.seqs[0].num_computed_tokens == 0
    assert c.seqs[0].num_tokens == 12  # its sampled token is kept and recomputed later


def test_a_request_preempts_itself_when_it_is_the_last():
    sched = make_scheduler(2, enable_prefix_caching=False)
    sched.add_request(make_request("a", list(range(8))))  # exactly the pool
    sample_all(sched, sched.schedule())
    out = sched.schedule()  # a needs a third block: it is its own victim
    assert out.is_empty
    assert waiting_ids(sched) == ["a"] and sched.stats().num_preemptions == 1


def test_no_admission_in_a_step_that_preempted():
    """Under the prefix policy, ``w`` (a 16-token hit on a's blocks, one block to add) sorts
    before the preempted ``b`` and fits after the preemption; it still waits for the next step."""
    sched = make_scheduler(7, scheduling_policy="prefix")
    prompt_a = list(range(16))
    sched.add_request(make_request("a", prompt_a))  # 4 blocks
    sched.add_request(make_request("b", list(range(50, 59))))  # 3 blocks: the pool is full
    sample_all(sched, sched.schedule())
    sched.add_request(make_request("w", [*prompt_a, 99]))
    out = sched.schedule()  # a needs a fifth block: b is preempted
    assert scheduled(out) == [("a", 1)]
    assert sched.stats().num_preemptions == 1
    assert sorted(waiting_ids(sched)) == ["b", "w"]
    sample_all(sched, out)
    out = sched.schedule()  # no preemption now: w is admitted with its hit
    assert scheduled(out) == [("a", 1), ("w", 1)]
    assert sched.requests["w"].num_cached_tokens == 16


def test_prefix_policy_admits_the_longest_cached_prefix_first_until_aging_wins():
    cached = list(range(200, 232))  # 8 blocks
    sched = make_scheduler(64, scheduling_policy="prefix", max_num_seqs=1)
    sched.add_request(make_request("warm", cached, max_tokens=1))
    sample_all(sched, sched.schedule())
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("cold", list(range(300, 340))))
    sched.add_request(make_request("hot", [*cached, 5, 6]))
    assert scheduled(sched.schedule()) == [("hot", 2)]  # 32 tokens cached: first

    sched = make_scheduler(64, scheduling_policy="prefix", max_num_seqs=1)
    sched.add_request(make_request("warm", cached, max_tokens=1))
    sample_all(sched, sched.schedule())
    cold, hot = make_request("cold", list(range(300, 340))), make_request("hot", [*cached, 5, 6])
    sched.add_request(cold)
    sched.add_request(hot)
    # cold waited long enough that aging outweighs hot's 32 cached tokens
    cold.arrival_time = time.monotonic() - 40 / AGING_TOKENS_PER_SECOND
    assert scheduled(sched.schedule()) == [("cold", 40)]


def test_fcfs_keeps_arrival_order_whatever_the_hits():
    cached = list(range(200, 232))
    sched = make_scheduler(64, max_num_seqs=1)
    sched.add_request(make_request("warm", cached, max_tokens=1))
    sample_all(sched, sched.schedule())
    sched.add_request(make_request("cold", list(range(300, 340))))
    sched.add_request(make_request("hot", [*cached, 5, 6]))
    assert scheduled(sched.schedule()) == [("cold", 40)]


def test_admission_keeps_the_watermark_and_growth_may_use_it():
    sched = make_scheduler(8, watermark=0.25)  # 2 blocks held back from admission
    sched.add_request(make_request("a", list(range(24))))  # 6 blocks: 2 left, admissible
    sched.add_request(make_request("b", [90]))  # 1 block: would leave 1 < 2
    out = sched.schedule()
    assert scheduled(out) == [("a", 24)]
    assert waiting_ids(sched) == ["b"]
    sample_all(sched, out)
    assert scheduled(sched.schedule()) == [("a", 1)]  # a grows into the reserve: 7 blocks
    assert sched.stats().kv_cache["used_blocks"] == 7 and waiting_ids(sched) == ["b"]


def test_parallel_samples_fork_on_their_first_token():
    sched = make_scheduler(64)
    request = make_request("n3", list(range(6)), n=3)
    sched.add_request(request)
    out = sched.schedule()
    (prompt_seq,) = [s for s in out.scheduled]
    tokens = [SampledToken(t, -1.0 * t, []) for t in (11, 12, 13)]
    touched = sched.update_from_output(out, SamplingResult(tokens=[(prompt_seq, tokens)]))
    assert touched == [request]
    assert [s.index for s in request.seqs] == [0, 1, 2]
    assert [s.output_token_ids for s in request.seqs] == [[11], [12], [13]]
    assert [s.cumulative_logprob for s in request.seqs] == [-11.0, -12.0, -13.0]
    assert len({s.seq_id for s in request.seqs}) == 3
    tables = [sched.kv.get_block_table(s.seq_id) for s in request.seqs]
    assert tables[0] == tables[1] == tables[2]  # forks share the prompt's blocks
    assert sched.stats().generation_tokens == 3
    out = sched.schedule()  # each sample decodes its own token; the shared block is copied
    assert [(s.seq.index, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 1), (2, 1)]
    assert len(out.block_copies) == 2  # the last holder keeps the original


def test_stops_free_the_sequence_and_finish_the_request():
    sched = make_scheduler(16)
    sched.add_request(make_request("eos", [3, 4, 5]))
    sched.add_request(make_request("len", [6, 7], max_tokens=1))
    sched.add_request(make_request("tok", [8, 9], stop_token_ids=[42]))
    out = sched.schedule()
    rows = {s.request.request_id: s for s in out.scheduled}
    result = SamplingResult(tokens=[(rows["eos"], [SampledToken(EOS, 0.0, [])]),
                                    (rows["len"], [SampledToken(5, 0.0, [])]),
                                    (rows["tok"], [SampledToken(42, 0.0, [])])])  # fmt: skip
    finished = sched.update_from_output(out, result)
    reasons = {r.request_id: (r.seqs[0].finish_reason, r.seqs[0].stop_reason) for r in finished}
    assert reasons == {"eos": ("stop", None), "len": ("length", None), "tok": ("stop", 42)}
    assert all(r.is_finished for r in finished)
    assert not sched.has_unfinished_requests()
    assert sched.stats().kv_cache["used_blocks"] == 0


def test_a_failed_request_ends_alone_with_its_error():
    sched = make_scheduler(16)
    sched.add_request(make_request("good", [3, 4, 5]))
    sched.add_request(make_request("bad", [6, 7, 8]))
    out = sched.schedule()
    good, bad = out.scheduled
    result = SamplingResult(
        tokens=[(good, [SampledToken(9, 0.0, [])])], failed=[(bad.request, "boom")]
    )
    touched = sched.update_from_output(out, result)
    assert {r.request_id for r in touched} == {"good", "bad"}
    assert bad.request.is_finished and bad.request.error == "boom"
    assert bad.seq.finish_reason == "abort"
    assert list(sched.requests) == ["good"] and not good.request.is_finished


def test_abort_frees_at_once_and_unknown_ids_are_ignored():
    sched = make_scheduler(16)
    sched.add_request(make_request("a", list(range(9))))
    sched.schedule()
    assert sched.stats().kv_cache["used_blocks"] == 3
    request = sched.abort_request("a")
    assert request.is_finished and request.seqs[0].finish_reason == "abort"
    assert sched.stats().kv_cache["used_blocks"] == 0 and not sched.running
    assert sched.abort_request("a") is None


def test_a_request_id_in_use_is_refused():
    sched = make_scheduler(16)
    sched.add_request(make_request("a", [1, 2]))
    with pytest.raises(InvalidArgumentError, match="already in use"):
        sched.add_request(make_request("a", [3, 4]))
    assert waiting_ids(sched) == ["a"]


def test_abandon_step_requeues_in_order_and_unregisters_the_steps_blocks():
    sched = make_scheduler(32)
    sched.add_request(make_request("run", list(range(8))))
    sample_all(sched, sched.schedule())  # "run" is decoding; its 2 prompt blocks are cached
    shared = list(range(100, 108))
    sched.add_request(make_request("a", [*shared, 1]))
    sched.add_request(make_request("b", [*shared, 2]))  # hits a's blocks in the same step
    sched.add_request(make_request("late", [5]))
    out = sched.schedule()
    assert scheduled(out) == [("run", 1), ("a", 9), ("b", 1), ("late", 1)]
    cached_before = sched.kv.stats()["cached_blocks"] + sched.kv.stats()["used_blocks"]
    sched.abandon_step(out)
    assert waiting_ids(sched) == ["run", "a", "b", "late"] and not sched.running
    assert all(r.status is RequestStatus.WAITING for r in sched.requests.values())
    stats = sched.kv.stats()
    assert stats["used_blocks"] == 0 and stats["cached_blocks"] == 2  # only "run"'s prompt
    assert cached_before > 2
    assert [sched.requests[r].num_cached_tokens for r in ("run", "a", "b")] == [0, None, None]
    out = sched.schedule()  # the retry: "run" from its cached prompt, "b" from "a" again
    assert scheduled(out) == [("run", 1), ("a", 9), ("b", 1), ("late", 1)]
    assert sched.requests["b"].num_cached_tokens == 8
