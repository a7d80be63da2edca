"""The prefix router's decisions and its mirror of each replica's cache, without Ray.

``choose`` and ``PrefixRouterState`` are plain Python, so their tests state exact rankings,
reasons, loads and counters. The mirror is checked against the engine itself: its hashes are the
engine's (``request_block_hashes`` finds what ``lookup`` finds) and a follower thread reading a
real publisher rebuilds the block pool's hash set exactly.
"""

from __future__ import annotations

import time

import pytest

from prefixserve.api.openai.responses.continuation import continue_prompt, render_prompt
from prefixserve.api.openai.responses.items import normalize_input, to_messages
from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.core.sampling_params import SamplingParams
from prefixserve.engine.chat_template import render_chat_text
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_event_publisher import KVEventPublisher
from prefixserve.kv.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    external_block_hash,
)
from prefixserve.scale_out import router
from prefixserve.scale_out.event_follower import EventFollower
from prefixserve.scale_out.protocol import EngineRequest, KVEventsEndpoint, ReplicaReport
from prefixserve.scale_out.router import (
    AFFINITY,
    COLD,
    LOAD,
    PREFIX,
    Candidate,
    HashMirror,
    PrefixRouterState,
    RouterConfig,
    affinity_digest,
    choose,
    request_block_hashes,
)

BS = 4
LOCAL = "tcp://127.0.0.1:*"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(hashes: list[int]) -> BlockStored:
    return BlockStored(hashes, None, [0] * BS * len(hashes), BS, None, "GPU", None)


def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _run_and_mirror(engine, request_id: str, prompt: list[int], params, mirror):
    """Run one request to its end, then wait until ``mirror`` holds the pool's hashed blocks."""
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    expected = {external_block_hash(h) for h in engine.scheduler.kv.pool.hashed_blocks()}
    _until(lambda: mirror.held == expected)
    return outputs[-1]


def ranking(decision) -> list[str]:
    return [c.replica for c in decision.ranking]


# --- choose: the decision rule ----------------------------------------------------------------


# (what it shows, config, candidates, (ranking, reason))
CHOICES = [
    ("the_replica_holding_the_prefix_wins_when_loads_are_close", RouterConfig(), [Candidate("a", 0, 0), Candidate("b", 64, 40)], (["b", "a"], PREFIX)),
    ("past_the_imbalance_threshold_the_least_loaded_wins", RouterConfig(imbalance_threshold=1000), [Candidate("a", 512, 1001), Candidate("b", 0, 0)], (["b", "a"], LOAD)),
    ("at_the_imbalance_threshold_the_prefix_still_wins", RouterConfig(imbalance_threshold=1000), [Candidate("a", 512, 1000), Candidate("b", 0, 0)], (["a", "b"], PREFIX)),
    ("a_cold_request_goes_to_the_least_loaded", RouterConfig(), [Candidate("a", 0, 50, 10), Candidate("b", 0, 10, 90)], (["b", "a"], COLD)),
    ("a_cold_request_between_equal_loads_goes_to_the_emptier_cache", RouterConfig(), [Candidate("a", 0, 0, 90), Candidate("b", 0, 0, 10)], (["b", "a"], COLD)),
    # a: 100 - 0.5 * 300 = -50; b: 40 - 0.5 * 0 = 40 -> b, although a holds more
    ("the_score_trades_hit_tokens_against_weighted_load", RouterConfig(load_weight=0.5), [Candidate("a", 100, 300), Candidate("b", 40, 0)], (["b", "a"], PREFIX)),
    # a holds everything but is busier than the hit is worth: the idle one wins, for load
    ("a_hit_worth_less_than_its_load_loses_to_the_idle_replica", RouterConfig(load_weight=0.5), [Candidate("a", 100, 300), Candidate("b", 0, 0)], (["b", "a"], LOAD)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("config", "candidates", "expected"),
    [pytest.param(*row[1:], id=row[0]) for row in CHOICES],
)
def test_choose_ranks_and_gives_the_reason(
    config: RouterConfig, candidates: list[Candidate], expected: tuple[list[str], str]
) -> None:
    d = choose(candidates, config)
    assert (ranking(d), d.reason) == expected


def test_router_config_is_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="load_weight"):
        RouterConfig(load_weight=-1)
    with pytest.raises(InvalidArgumentError, match="imbalance_threshold"):
        RouterConfig(imbalance_threshold=-1)


# --- the state: predictions, loads, counters ---------------------------------------------------


def test_a_burst_of_one_new_prefix_lands_on_one_replica() -> None:
    state = PrefixRouterState()
    hashes = request_block_hashes(list(range(1, 1000)), 16)
    # all eight are decided before any reaches a replica (or any event arrives)
    decisions = [state.route(f"r{i}", ["a", "b"], hashes, 16, 1000, 16) for i in range(8)]
    chosen = {d.ranking[0].replica for d in decisions}
    assert len(chosen) == 1
    replica = chosen.pop()
    for i in range(8):
        state.on_routed(f"r{i}", replica)
    counts = state.snapshot()[replica]["requests"]
    assert counts == {PREFIX: 7, LOAD: 0, COLD: 1, AFFINITY: 0}


def test_distinct_new_prefixes_spread_even_when_decided_together() -> None:
    state = PrefixRouterState()
    placed = []
    for i in range(4):  # decided back to back, none routed or finished yet
        hashes = request_block_hashes([i + 1] * 200, 16)
        placed.append(state.route(f"r{i}", ["a", "b"], hashes, 16, 200).ranking[0].replica)
    assert placed == ["a", "b", "a", "b"]


def test_done_requests_leave_the_emptier_cache_to_the_next_new_prefix() -> None:
    state = PrefixRouterState()
    placed = []
    for i in range(4):  # one at a time: loads are back to 0, held blocks decide
        hashes = request_block_hashes([i + 1] * 200, 16)
        replica = state.route(f"r{i}", ["a", "b"], hashes, 16, 200).ranking[0].replica
        state.on_routed(f"r{i}", replica)
        state.on_completed(f"r{i}")
        placed.append(replica)
    assert placed == ["a", "b", "a", "b"]


def test_load_follows_reserved_routed_and_completed_requests() -> None:
    state = PrefixRouterState()
    hashes = request_block_hashes(list(range(1, 101)), 4)
    state.route("r1", ["a", "b"], hashes, 4, 100, 20)
    assert state.snapshot()["a"]["load_tokens"] == 120  # reserved at once
    state.on_routed("r1", "a")
    decision = state.route("r2", ["a", "b"], hashes, 4, 100, 20)
    assert decision.ranking[0].hit_tokens == 96  # predicted: 24 of its 24 lookup blocks
    state.on_routed("r2", "a")
    assert state.snapshot()["a"]["load_tokens"] == 120 + (100 - 96 + 20)
    state.on_completed("r1")
    state.on_completed("r1")  # a second completion of the same request changes nothing
    assert state.snapshot()["a"]["load_tokens"] == 24
    assert state.snapshot()["a"]["predicted_hit_tokens"] == 96


def test_a_request_that_scores_its_prompt_hits_nowhere_but_its_blocks_are_predicted() -> None:
    state = PrefixRouterState()
    hashes = request_block_hashes(list(range(1, 50)), 4)
    state.mirror("a").apply([stored(hashes)])
    decision = state.route("r1", ["a", "b"], hashes, 4, 49, uses_prefix_cache=False)
    assert decision.reason == COLD and all(c.hit_tokens == 0 for c in decision.ranking)
    first = ranking(decision)[0]
    assert state.snapshot()[first]["load_tokens"] == 49  # its whole prompt is work
    assert state.mirror(first).hit_blocks(hashes) == len(hashes)
    scored = EngineRequest("x", [1, 2], SamplingParams(prompt_logprobs=1))
    assert (
        not scored.uses_prefix_cache and EngineRequest("y", [1], SamplingParams()).uses_prefix_cache
    )


def test_a_request_that_lands_on_its_second_choice_moves_and_counts_as_load() -> None:
    state = PrefixRouterState()
    hashes = request_block_hashes(list(range(1, 50)), 4)
    state.mirror("a").apply([stored(hashes)])
    decision = state.route("r1", ["a", "b"], hashes, 4, 49)
    assert ranking(decision)[0] == "a"
    state.on_routed("r1", "b")  # "a" was full
    snap = state.snapshot()
    assert snap["b"]["requests"][LOAD] == 1 and snap["a"]["load_tokens"] == 0
    assert snap["b"]["load_tokens"] == 49
    assert state.mirror("b").hit_blocks(hashes) == len(hashes)  # predicted where it went


def test_deciding_again_replaces_the_reservation_and_stale_ones_expire() -> None:
    clock = Clock()
    state = PrefixRouterState(RouterConfig(predict_ttl_s=5.0), clock=clock)
    hashes = request_block_hashes(list(range(1, 50)), 4)
    state.route("r1", ["a"], hashes, 4, 49)
    state.route("r1", ["a"], hashes, 4, 49)  # the same request again: still one reservation
    assert state.snapshot()["a"]["load_tokens"] == 49 - 48  # its second look hits its first
    clock.now += 6.0  # never routed (its caller gave up)
    state.route("r2", ["b"], [], 4, 3)
    assert state.snapshot()["a"]["load_tokens"] == 0


def test_a_replica_that_leaves_loses_its_mirror_and_load() -> None:
    state = PrefixRouterState()
    hashes = request_block_hashes(list(range(1, 50)), 4)
    state.mirror("a").apply([stored(hashes)])
    state.route("r1", ["a", "b"], hashes, 4, 49)
    state.on_routed("r1", "a")
    state.remove_replica("a")
    snap = state.snapshot()["a"]
    assert (snap["live"], snap["load_tokens"], snap["requests"][PREFIX]) == (False, 0, 1)
    assert state.replicas() == ["b"]
    decision = state.route("r2", ["a", "b"], hashes, 4, 49)  # "a" is back (restarted): empty
    assert {c.replica: c.hit_tokens for c in decision.ranking} == {"a": 0, "b": 0}


# --- the mirror -----------------------------------------------------------------------------------


def test_the_mirror_applies_stores_removals_and_clears() -> None:
    mirror = HashMirror()
    mirror.apply([stored([1, 2, 3]), stored([7])])
    assert mirror.held == {1, 2, 3, 7}
    assert mirror.hit_blocks([1, 2, 3, 4]) == 3
    mirror.apply([BlockRemoved([2], "GPU")])
    assert mirror.hit_blocks([1, 2, 3]) == 1  # a hit is a run from the first block
    mirror.apply([AllBlocksCleared(), stored([9])])
    assert mirror.held == {9}


def test_the_mirror_keeps_one_set_per_medium_and_weighs_them() -> None:
    """A block evicted from the pool into the host tier is still held; the hit is weighted by
    the best medium; a reset keeps the shared server's blocks."""
    mirror = HashMirror()
    in_tier = lambda hashes, medium: BlockStored(  # noqa: E731
        hashes, None, [0] * BS * len(hashes), BS, None, medium, None
    )
    mirror.apply([stored([1, 2]), in_tier([1, 2, 3], "DISK"), in_tier([4], "SHARED")])
    mirror.apply([BlockRemoved([2], "GPU"), in_tier([2], "CPU_TIER")])
    assert mirror.held == {1, 2, 3, 4} and mirror.hit_blocks([1, 2, 3, 4, 5]) == 4
    assert mirror.hit_weight([1, 2, 3, 4]) == pytest.approx(1.0 + 0.9 + 0.6 + 0.4)
    mirror.apply([AllBlocksCleared()])
    assert mirror.held == {4}


def test_a_block_in_the_shared_tier_counts_for_every_replica() -> None:
    state = PrefixRouterState(RouterConfig(imbalance_threshold=10**9))
    hashes = [11, 12, 13, 14]
    state.mirror("a").apply([stored([11, 12, 13, 14])])
    shared = BlockStored(hashes, None, [0] * BS * 4, BS, None, "SHARED", None)
    state.mirror("a").apply([shared])
    state.mirror("b")
    state.mirror("c").apply([BlockStored(hashes[:2], None, [0] * BS * 2, BS, None, "DISK", None)])
    hits = {c.replica: c.hit_tokens for c in state.candidates(["a", "b", "c"], hashes, BS)}
    assert hits == {"a": 4 * BS, "b": round(4 * 0.4 * BS), "c": round((0.6 * 2 + 0.4 * 2) * BS)}


def test_predictions_count_until_confirmed_removed_or_expired() -> None:
    clock = Clock()
    mirror = HashMirror(predict_ttl_s=10.0, clock=clock)
    mirror.predict([1, 2, 3])
    assert (mirror.hit_blocks([1, 2, 3]), mirror.num_blocks()) == (3, 3)
    mirror.apply([stored([1])])  # confirmed: held for good
    mirror.apply([BlockRemoved([2], "GPU")])  # dropped
    assert mirror.hit_blocks([1, 2, 3]) == 1
    clock.now += 10.0
    assert (mirror.hit_blocks([1, 3]), mirror.num_blocks()) == (1, 1)
    mirror.predict([4])
    mirror.apply([AllBlocksCleared()])
    assert mirror.num_blocks() == 0


def test_request_hashes_are_the_engines_own() -> None:
    tokens = list(range(1, 23))  # 22 tokens, block size 4: 5 full blocks, lookup may hit 5
    chained: list[int] = []
    extend_block_hashes(tokens, BS, ("tenant",), chained)
    expected = [external_block_hash(h) for h in chained]
    assert request_block_hashes(tokens, BS, "tenant") == expected
    assert request_block_hashes(tokens[:20], BS, "tenant") == expected[:4]  # 20 tokens: 4 max
    assert request_block_hashes(tokens, BS) != expected  # another salt, other blocks


def test_a_follower_mirrors_an_engine_exactly_and_predicts_its_hits() -> None:
    """Through evictions and a cache reset, the mirror ends equal to the pool's hash set, and
    its predicted hit for a follow-up is the engine's ``num_cached_tokens``."""
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=24, block_size=BS, max_model_len=256,
                     kv_events_endpoint=LOCAL, kv_events_replay_endpoint=LOCAL)
    )  # fmt: skip
    pub = engine.kv_event_publisher
    mirror = HashMirror()
    follower = EventFollower(KVEventsEndpoint(pub.endpoint, pub.replay_endpoint, BS), mirror)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt="s")

    def run(request_id: str, prompt: list[int]):
        return _run_and_mirror(engine, request_id, prompt, params, mirror)

    try:
        for i in range(8):  # outgrows 24 blocks: evictions
            run(f"fill{i}", [100 + i] * (10 + 3 * i))
        assert engine.stats().kv_cache["evictions"] > 0
        engine.reset_prefix_cache()
        _until(lambda: mirror.held == frozenset())
        prompt = list(range(10, 40))
        run("first", prompt)
        follow_up = prompt[:26] + [5, 6, 7]
        hashes = request_block_hashes(follow_up, BS, "s")
        predicted = mirror.hit_blocks(hashes) * BS
        assert run("second", follow_up).num_cached_tokens == predicted == 24
        assert mirror.hit_blocks(request_block_hashes(follow_up, BS)) == 0  # no salt, no hit
        assert follower.num_gaps == 0
    finally:
        follower.close()
        follower.join(5)
        engine.shutdown()


# --- the follower thread and the wire -----------------------------------------------------------


def test_a_follower_rebuilds_a_publishers_hash_set_including_what_came_before_it() -> None:
    with KVEventPublisher(LOCAL, replay_endpoint=LOCAL) as publisher:
        publisher.publish([stored([1, 2])])  # before anyone listens: replayed
        publisher.publish([BlockRemoved([1], "GPU")])
        source = KVEventsEndpoint(publisher.endpoint, publisher.replay_endpoint, BS)
        mirror = HashMirror()
        follower = EventFollower(source, mirror, "test")
        try:
            _until(lambda: follower.last_seq == 1)
            assert mirror.held == {2}
            publisher.publish([stored([5, 6])])
            _until(lambda: follower.last_seq == 2)
            assert mirror.held == {2, 5, 6}
            publisher.publish([AllBlocksCleared()])
            _until(lambda: follower.last_seq == 3)
            assert mirror.held == frozenset() and follower.num_gaps == 0
        finally:
            follower.close()
            follower.join(5)
    assert not follower._thread.is_alive()


def test_an_affinity_key_decides_cold_prompts_and_ties_but_not_a_better_hit() -> None:
    state = PrefixRouterState()

    def route(rid: str, tokens: list[int], key: str | None, order=("a", "b")) -> tuple[str, str]:
        decision = state.route(rid, list(order), request_block_hashes(tokens, BS), BS,
                               len(tokens), affinity_key=key)  # fmt: skip
        state.on_routed(rid, decision.ranking[0].replica)
        state.on_completed(rid)
        return decision.ranking[0].replica, decision.reason

    first, _ = route("r0", [1] * 64, "k")
    # cold: another new prefix would go to the emptier replica; the key keeps it on the first
    assert route("r1", [2] * 64, "k") == (first, AFFINITY)
    assert route("r2", [3] * 64, None)[0] != first  # without the key: the emptier one
    # a tie on what is cached: both hold the shared prefix
    shared = [9] * 66  # 16 full blocks, and the suffixes part in the 17th
    other = "b" if first == "a" else "a"
    state.mirror(other).apply([stored(request_block_hashes(shared, BS))])
    state.mirror(first).apply([stored(request_block_hashes(shared, BS))])
    ties = (other, first)  # the tie would go to the one listed first
    assert route("r3", shared + [4] * 16, None, ties) == (other, PREFIX)
    assert route("r4", shared + [6] * 16, "k", ties) == (first, AFFINITY)
    # a replica that holds more of the prompt still wins
    state.mirror(other).apply([stored(request_block_hashes(shared + [5] * 64, BS))])
    assert route("r5", shared + [5] * 64, "k") == (other, PREFIX)


def test_the_affinity_yields_to_a_load_imbalance() -> None:
    state = PrefixRouterState(RouterConfig(imbalance_threshold=100))
    state.route("r0", ["a", "b"], request_block_hashes([1] * 64, 16), 16, 64, affinity_key="k")
    state.on_routed("r0", "a")  # r0 still running on a: 64 tokens of load
    state.route("r1", ["a", "b"], request_block_hashes([2] * 500, 16), 16, 500)
    state.on_routed("r1", "a")  # and a 500-token one: a is 564 tokens ahead of b
    decision = state.route("r2", ["a", "b"], request_block_hashes([3] * 64, 16), 16, 64,
                           affinity_key="k")  # fmt: skip
    assert (decision.ranking[0].replica, decision.reason) == ("b", LOAD)


def test_affinity_keys_are_kept_as_digests_in_a_bounded_table(monkeypatch) -> None:
    monkeypatch.setattr(router, "MAX_AFFINITY_KEYS", 4)
    state = PrefixRouterState()
    hashes = request_block_hashes([1] * 64, BS)
    huge = "k" * (1 << 20)  # a 1 MiB key costs the table 16 bytes
    state.route("r0", ["a", "b"], hashes, BS, 64, affinity_key=huge)
    assert list(state._affinity) == [affinity_digest(huge)]
    assert all(len(k) == 16 for k in state._affinity)
    for i in range(10):
        state.route(f"s{i}", ["a", "b"], hashes, BS, 64, affinity_key=f"key {i}")
    assert list(state._affinity) == [affinity_digest(f"key {i}") for i in range(6, 10)]
    assert affinity_digest(huge) not in state._affinity  # the least recently routed went first


def test_engine_requests_and_reports_survive_the_round_trip() -> None:
    request = EngineRequest("r", [72, 105, 0x1F600], SamplingParams(max_tokens=3, n=2))
    assert request.prompt == "Hi\U0001f600"  # one character per token, for text routers
    assert request.num_output_tokens == 6 and request.routing_key is None
    assert EngineRequest("r", [1], SamplingParams(), "tenant/k").routing_key == "tenant/k"
    report = ReplicaReport("x", 1, "10.0.0.1", KVEventsEndpoint("tcp://a:1", None, 16), {"k": 1})
    assert ReplicaReport.from_dict(report.to_dict()) == report
    assert ReplicaReport.from_dict({}) is None


def test_a_responses_continuation_routes_to_the_replica_holding_the_previous_response() -> None:
    """The ingress builds a continuation's prompt as the previous response's own prompt and
    output ids plus the new items (``continue_prompt``), so its block hashes extend the ones the
    replica that ran the previous response published, generated blocks included: the router
    sends it there, over a replica that holds only the shared prompt, and predicts the engine's
    own hit."""
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=64, block_size=BS, max_model_len=512,
                     kv_events_endpoint=LOCAL, kv_events_replay_endpoint=LOCAL)
    )  # fmt: skip
    tok = engine.tokenizer
    pub = engine.kv_event_publisher
    state = PrefixRouterState()
    follower = EventFollower(KVEventsEndpoint(pub.endpoint, pub.replay_endpoint, BS),
                             state.mirror("a"))  # fmt: skip
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, cache_salt="t")

    def run(request_id: str, prompt: list[int]):
        return _run_and_mirror(engine, request_id, prompt, params, state.mirror("a"))

    try:
        items = normalize_input([{"role": "system", "content": "You are a careful agent."},
                                 {"role": "user", "content": "List the files, then stop."}])  # fmt: skip
        first = render_prompt(tok, render_chat_text(tok, to_messages(items)))
        out = run("resp_1", first.token_ids)
        generated = out.outputs[0].token_ids
        reply = tok.decode(generated, skip_special_tokens=False)
        history = items + normalize_input([{"role": "assistant", "content": reply},
                                           {"role": "user", "content": "And now?"}])  # fmt: skip
        full = render_chat_text(tok, to_messages(history))
        prompt = continue_prompt(tok, first.text, first.token_ids, generated, full)
        assert prompt.token_exact
        previous = [*first.token_ids, *generated]
        assert prompt.token_ids[: len(previous)] == previous
        # replica b served another request with the same first prompt: it holds that, no more
        state.mirror("b").apply([stored(request_block_hashes(first.token_ids, BS, "t"))])
        hashes = request_block_hashes(prompt.token_ids, BS, "t")
        decision = state.route("resp_2", ["a", "b"], hashes, BS, len(prompt.token_ids))
        hits = {c.replica: c.hit_tokens for c in decision.ranking}
        assert (ranking(decision)[0], decision.reason) == ("a", PREFIX)
        computed = len(previous) - 1  # the last generated token's KV is never written
        assert hits["a"] == computed // BS * BS > hits["b"]
        assert run("resp_2", prompt.token_ids).num_cached_tokens == hits["a"]
    finally:
        follower.close()
        follower.join(5)
        engine.shutdown()
