"""KV events: vLLM's wire format, the recorder's invariant, and the ZMQ publisher/subscriber.

Sockets bind ``127.0.0.1:*`` (a free port) or an ``ipc://`` path in ``tmp_path``. PUB drops
what it sends before a subscription arrives, so tests that need the live stream first publish
probes until one is received (``_handshake``) instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.kv.kv_event_publisher import KVEventPublisher, KVEventSubscriber
from prefixserve.kv.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HashFormat,
    KVEvent,
    KVEventBatch,
    KVEventRecorder,
    decode_batch,
    encode_batch,
    external_block_hash,
)

H128 = (1 << 127) + 12345  # a 128-bit hash whose low 64 bits are 12345
LOCAL = "tcp://127.0.0.1:*"


def stored(
    hashes: list, parent: Any, tokens: list[int], block_size: int = 2, medium: str | None = "GPU"
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, block_size, None, medium, None)


def apply(state: set, events: list[KVEvent]) -> None:
    """What a consumer does with a batch; asserts the recorder never repeats a hash."""
    for event in events:
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == event.block_size * len(event.block_hashes)
            assert not state & set(event.block_hashes), "stored a hash already held"
            state.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= state, "removed a hash not held"
            state.difference_update(event.block_hashes)
        else:
            state.clear()


# --- wire format ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        stored([1, 2**64 - 1], None, [1, 2, 3, 4]),
        stored([H128.to_bytes(16, "big")], b"\x01" * 16, [5, 6]),
        BlockRemoved([7, 8], "GPU"),
        BlockRemoved([9], None),
        AllBlocksCleared(),
    ],
)
def test_each_event_round_trips(event: KVEvent) -> None:
    batch = KVEventBatch(123.5, [event, event], 3)
    assert decode_batch(encode_batch(batch)) == batch


def test_wire_layout_is_vllms() -> None:
    """Array batch, tagged-map events with vLLM's key order (vLLM >= 0.24)."""
    batch = KVEventBatch(
        1.25,
        [stored([11, 12], 10, [1, 2, 3, 4]), BlockRemoved([11], "GPU"), AllBlocksCleared()],
        0,
    )
    payload = encode_batch(batch)
    assert payload[0] == 0x93  # fixarray of 3: [ts, events, data_parallel_rank]
    ts, events, dp_rank = msgspec.msgpack.decode(payload)
    assert (ts, dp_rank) == (1.25, 0)
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": 10,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert list(events[0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert list(events[1].items()) == [
        ("type", "BlockRemoved"),
        ("block_hashes", [11]),
        ("medium", "GPU"),
    ]
    assert events[2] == {"type": "AllBlocksCleared"}


class _VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A consumer's copy of vLLM main's event types, with its optional trailing fields."""


class _VllmStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _VllmRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class _VllmCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_VllmStored | _VllmRemoved | _VllmCleared]
    data_parallel_rank: int | None = None


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_vllm_consumer_types_decode_our_batches(hash_format: HashFormat) -> None:
    recorder = KVEventRecorder(hash_format=hash_format)
    recorder.on_block_stored(H128, None, [1, 2])
    recorder.on_block_removed(H128)
    recorder.on_all_cleared()
    recorder.on_block_stored(H128 + 1, H128, [3, 4])
    theirs = msgspec.msgpack.decode(
        encode_batch(KVEventBatch(2.0, recorder.take(), 0)), type=_VllmBatch
    )
    cleared, event = theirs.events  # the clear dropped the store and removal before it
    assert isinstance(cleared, _VllmCleared) and isinstance(event, _VllmStored)
    assert event.parent_block_hash == external_block_hash(H128, hash_format)
    assert (event.token_ids, event.block_size, event.group_idx) == ([3, 4], 2, None)


def test_external_hash_formats_agree_on_the_low_64_bits() -> None:
    assert external_block_hash(H128) == 12345
    as_bytes = external_block_hash(H128, "bytes")
    assert as_bytes == H128.to_bytes(16, "big")
    assert isinstance(as_bytes, bytes)
    assert int.from_bytes(as_bytes[-8:], "big") == 12345  # llm-d's reduction of a bytes hash
    with pytest.raises(InvalidArgumentError):
        KVEventRecorder(hash_format="hex")  # type: ignore[arg-type]


# --- recorder -------------------------------------------------------------------------------


def test_one_chain_is_one_event_even_across_calls() -> None:
    rec = KVEventRecorder()
    rec.on_block_stored(1, None, [1, 2])
    rec.on_block_stored(2, 1, [3, 4])
    rec.on_block_stored(3, 2, [5, 6])
    rec.on_block_stored(7, 3, [7])  # a different block size never merges
    assert rec.take() == [stored([1, 2, 3], None, [1, 2, 3, 4, 5, 6]), stored([7], 3, [7], 1)]
    assert rec.take() == []


def test_a_new_chain_or_a_removal_starts_a_new_event() -> None:
    rec = KVEventRecorder(medium=None)
    rec.on_block_stored(1, None, [1, 2])
    rec.on_block_stored(5, None, [9, 9])  # another prompt's first block
    rec.on_block_stored(6, 1, [3, 4])  # back to the first chain: order is kept, no merge
    rec.on_block_removed(5)
    rec.on_block_removed(6)
    rec.on_block_stored(7, 6, [5, 6])  # 6 is gone; its child is still announced with parent 6
    assert rec.take() == [
        stored([1], None, [1, 2], medium=None),
        stored([5], None, [9, 9], medium=None),
        stored([6], 1, [3, 4], medium=None),
        BlockRemoved([5, 6], None),
        stored([7], 6, [5, 6], medium=None),
    ]


def test_take_ends_a_chain_and_a_clear_drops_the_steps_events() -> None:
    rec = KVEventRecorder()
    rec.on_block_stored(1, None, [1, 2])
    assert rec.take() == [stored([1], None, [1, 2])]
    rec.on_block_stored(2, 1, [3, 4])
    assert rec.take() == [stored([2], 1, [3, 4])]
    rec.on_block_stored(3, None, [1, 1])
    rec.on_block_removed(3)
    rec.on_all_cleared()
    rec.on_all_cleared()
    rec.on_block_stored(4, None, [2, 2])
    assert rec.take() == [AllBlocksCleared(), stored([4], None, [2, 2])]


@settings(max_examples=200, deadline=None)
@given(
    hash_format=st.sampled_from(["int", "bytes"]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "chain", "remove", "clear", "take"]), st.integers(0, 30)
        ),
        max_size=80,
    ),
)
def test_replaying_the_events_rebuilds_the_hash_set(hash_format: HashFormat, ops: list) -> None:
    """Any store/remove/clear history, taken at any points, replays to the recorded set."""
    rec = KVEventRecorder(hash_format=hash_format)
    held: set[int] = set()
    consumer: set = set()
    last: int | None = None
    for op, i in ops:
        h = H128 * (i + 1) % (1 << 128)  # 128-bit values; a few collide on purpose
        if op in ("store", "chain") and h not in held:
            rec.on_block_stored(h, last if op == "chain" else None, [i, i])
            held.add(h)
            last = h
        elif op == "remove" and held:
            victim = sorted(held)[i % len(held)]
            rec.on_block_removed(victim)
            held.discard(victim)
        elif op == "clear":
            rec.on_all_cleared()
            held.clear()
        elif op == "take":
            apply(consumer, decode_batch(encode_batch(KVEventBatch(0.0, rec.take()))).events)
            assert consumer == {external_block_hash(x, hash_format) for x in held}
    apply(consumer, rec.take())
    assert consumer == {external_block_hash(x, hash_format) for x in held}


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "admit", "free", "reset", "step"]), st.integers(0, 60)),
        max_size=60,
    )
)
def test_a_block_pool_under_random_traffic_is_mirrored_by_its_events(ops: list) -> None:
    """Prefix hits, evictions and resets in a real KVCacheManager, seen through the events."""
    bs, prefixes = 4, [[1, 2, 3, 4] * 3, [5] * 8, [1, 2, 3, 4, 9, 9, 9, 9]]
    rec = KVEventRecorder()
    mgr = KVCacheManager(12, bs, watermark=0.0, kv_events=rec)
    live: list[int] = []
    consumer: set = set()

    def check() -> None:
        apply(consumer, decode_batch(encode_batch(KVEventBatch(0.0, rec.take()))).events)
        assert consumer == {external_block_hash(h) for h in mgr.pool.hashed_blocks()}

    for n, (op, i) in enumerate(ops):
        if op == "admit":
            tokens = prefixes[i % 3] + [100 + i] * (i % 11)
            hashes: list[int] = []
            extend_block_hashes(tokens, bs, (), hashes)
            hit = mgr.lookup(tokens, hashes)
            if not mgr.allocate_for_prompt(n, hit, len(tokens) - hit.num_tokens):
                continue
            mgr.cache_full_blocks(n, tokens, hashes, len(tokens))
            live.append(n)
        elif op == "free" and live:
            mgr.free(live.pop(i % len(live)))
        elif op == "reset":
            mgr.reset_prefix_cache()
        elif op == "step":
            check()
    check()


# --- publisher and subscriber ---------------------------------------------------------------


def _handshake(pub: KVEventPublisher, sub: KVEventSubscriber) -> int:
    """Publish probes until ``sub`` gets one and the rest; returns the next sequence number."""
    deadline, sent, item = time.monotonic() + 10, 0, None
    while item is None:
        assert time.monotonic() < deadline, "the subscriber never connected"
        pub.publish([AllBlocksCleared()])
        sent += 1
        item = sub.recv(timeout_s=0.05)
    while item[0] < sent - 1:  # probes sent after the first one that arrived arrive too
        item = _next(sub)
    return sent


def _next(sub: KVEventSubscriber) -> tuple[int, KVEventBatch]:
    item = sub.recv(timeout_s=5)
    assert item is not None, "no batch within 5 s"
    return item


def _removed(i: int) -> list[KVEvent]:
    return [BlockRemoved([i], "GPU")]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_batches_arrive_in_order_and_replay_from_any_seq(transport: str, tmp_path: Any) -> None:
    endpoint = LOCAL if transport == "tcp" else f"ipc://{tmp_path}/kv.sock"
    replay = LOCAL if transport == "tcp" else f"ipc://{tmp_path}/replay.sock"
    with (
        KVEventPublisher(
            endpoint, replay_endpoint=replay, topic="kv@pod@m", data_parallel_rank=2
        ) as pub,
        KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="kv@") as sub,
    ):
        first = _handshake(pub, sub)
        for i in range(5):
            pub.publish(_removed(i))
            pub.publish([])  # an empty step publishes nothing and takes no seq
        got = [_next(sub) for _ in range(5)]
        assert [(seq, b.events, b.data_parallel_rank) for seq, b in got] == [
            (first + i, _removed(i), 2) for i in range(5)
        ]
        assert [seq for seq, _ in sub.replay(0)] == list(range(first + 5))
        assert [b.events for _, b in sub.replay(first + 3)] == [_removed(3), _removed(4)]
        assert sub.replay(first + 5) == []


def test_the_frames_on_both_sockets_are_vllms() -> None:
    ctx = zmq.Context()
    with KVEventPublisher(LOCAL, replay_endpoint=LOCAL, topic="kv-events") as pub:
        sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert pub.replay_endpoint is not None
        sub.connect(pub.endpoint)
        dealer.connect(pub.replay_endpoint)
        frames = None
        while frames is None:
            pub.publish(_removed(7))
            frames = sub.recv_multipart() if sub.poll(50) else None
        topic, seq, payload = frames
        assert topic == b"kv-events" and len(seq) == 8
        assert msgspec.msgpack.decode(payload)[1:] == [
            [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}],
            0,
        ]
        dealer.send_multipart([b"", seq])
        assert dealer.recv_multipart() == [b"", seq, payload]
        assert dealer.recv_multipart() == [b"", b"\xff" * 8, b""]  # the end marker, seq -1
    ctx.destroy(linger=0)


def _wait_until_sent(pub: KVEventPublisher, last_seq: int) -> list[int]:
    """The buffered seqs once the publisher thread has sent ``last_seq``."""
    with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as probe:
        while not (seqs := [seq for seq, _ in probe.replay(0)]) or seqs[-1] < last_seq:
            time.sleep(0.01)
    return seqs


def test_the_replay_buffer_keeps_the_last_buffer_steps_batches() -> None:
    with KVEventPublisher(LOCAL, replay_endpoint=LOCAL, buffer_steps=2) as pub:
        for i in range(5):
            pub.publish(_removed(i))
        assert _wait_until_sent(pub, 4) == [3, 4]


def test_a_late_subscriber_gets_the_buffered_batches_then_the_live_ones() -> None:
    with KVEventPublisher(LOCAL, replay_endpoint=LOCAL) as pub:
        for i in range(6):
            pub.publish(_removed(i))
        _wait_until_sent(pub, 5)
        with KVEventSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=3
        ) as sub:
            replayed = [_next(sub) for _ in range(3)]
            assert [(seq, b.events) for seq, b in replayed] == [(i, _removed(i)) for i in (3, 4, 5)]
            # Live batches published while the subscription is still in flight are dropped by
            # PUB; the first one that arrives makes the subscriber replay the ones it missed.
            seqs: list[int] = []
            i = 6
            while not seqs:
                pub.publish(_removed(i))
                i += 1
                item = sub.recv(timeout_s=0.05)
                seqs += [item[0]] if item else []
            while seqs[-1] < i - 1:
                seqs.append(_next(sub)[0])
            assert seqs == list(range(6, i))


def test_a_subscriber_may_bind_and_the_publisher_connect() -> None:
    with (
        KVEventSubscriber(LOCAL, bind=True) as sub,
        KVEventPublisher(sub.endpoint, bind=False) as pub,
    ):
        first = _handshake(pub, sub)
        pub.publish(_removed(1))
        seq, batch = _next(sub)
        assert (seq, batch.events) == (first, _removed(1))
        assert abs(batch.ts - time.time()) < 60


def test_close_joins_the_thread_and_frees_the_ports() -> None:
    threads = set(threading.enumerate())
    pub = KVEventPublisher(LOCAL, replay_endpoint=LOCAL)
    endpoint = pub.endpoint
    with pytest.raises(InvalidArgumentError):
        KVEventPublisher(endpoint)  # the port is taken
    pub.publish(_removed(1))
    pub.close()
    pub.close()
    assert set(threading.enumerate()) == threads
    with pytest.raises(RuntimeError):
        pub.publish(_removed(2))
    KVEventPublisher(endpoint).close()  # the port was released
    assert set(threading.enumerate()) == threads


def test_a_replay_nobody_answers_times_out() -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(LOCAL)
    endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
    with KVEventSubscriber(LOCAL, bind=True, replay_endpoint=endpoint, replay_timeout_s=0.1) as sub:
        with pytest.raises(TimeoutError):
            sub.replay(0)
        with pytest.raises(TimeoutError):  # a fresh socket after the first timeout
            sub.replay(0)
    ctx.destroy(linger=0)
    with KVEventSubscriber(LOCAL, bind=True) as sub, pytest.raises(RuntimeError):
        sub.replay(0)


def test_an_engine_run_with_evictions_is_rebuilt_exactly_from_its_stream() -> None:
    """A subscriber of ``LLM(kv_events_endpoint=...)`` ends with exactly the engine's hash set."""
    from prefixserve import LLM, SamplingParams

    llm = LLM(num_kv_blocks=24, block_size=16, kv_events_endpoint=LOCAL,
              kv_events_replay_endpoint=LOCAL)  # fmt: skip
    engine = llm.llm_engine
    pub = engine.kv_event_publisher
    system = list(range(100, 164))  # 4 blocks, shared by every prompt
    prompts = [system + [200 + i] * (16 + 9 * (i % 4)) for i in range(10)]  # outgrows 24 blocks
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        llm.generate([prompt], params, use_tqdm=False)
    llm.reset_prefix_cache()  # AllBlocksCleared...
    llm.generate([system + [7] * 30], params, use_tqdm=False)  # ...then a fresh chain
    assert engine.stats().kv_cache["evictions"] > 0
    expected = {external_block_hash(h) for h in engine.scheduler.kv.pool.hashed_blocks()}
    consumer: set = set()
    with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0) as sub:
        while (got := sub.recv(timeout_s=1.0)) is not None:
            apply(consumer, got[1].events)
    engine.shutdown()
    assert consumer == expected and expected
