"""KV events over ZMQ, framed as vLLM's ``ZmqEventPublisher`` frames them.

::

    PUB     [topic, seq, payload]     seq: 8-byte big-endian, 0, 1, 2, ... one per batch
    ROUTER  request  [start_seq]      8-byte big-endian (a DEALER sends [b"", start_seq])
            replies  [seq, payload]   each buffered batch with seq >= start_seq, oldest first
                     [-1, b""]        end marker: seq -1 as 8 signed bytes, empty payload

Threads of a publisher; the publisher thread alone touches the sockets::

    engine thread                          publisher thread
    publish(events) ──▶ SimpleQueue ──▶ encode, number, send on PUB, keep in the replay buffer
      (never waits)                     between batches: answer replay requests on ROUTER
    close() ─ stop mark ──────────────▶ send what is queued, close both sockets, exit
      join, then end the ZMQ context

PUB drops messages for a subscriber that is slow or not yet connected; a consumer notices a
jump in ``seq`` and asks the replay socket for what it missed (``KVEventSubscriber`` does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import TypeVar

import zmq

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.kv_events import KVEvent, KVEventBatch, decode_batch, encode_batch

logger = logging.getLogger(__name__)

_Self = TypeVar("_Self", bound="_ClosedOnExit")

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_IDLE_POLL_S = 0.05  # how long a replay request may wait while no batch is published


def _open(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
    """Bind or connect ``sock``; the bound address (a ``*`` port resolved) or ``endpoint``."""
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise InvalidArgumentError(
            f"cannot use KV event endpoint {endpoint!r}: {e}", "endpoint"
        ) from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class _ClosedOnExit(ABC):
    """``with`` hands back the object itself and calls its ``close`` on the way out, raised or not."""

    @abstractmethod
    def close(self) -> None:
        """Release the sockets; idempotent."""

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class KVEventPublisher(_ClosedOnExit):
    """Publishes each engine step's KV events as one ``KVEventBatch`` on a ZMQ PUB socket.

    ``endpoint`` is bound (``tcp://*:5557``, ``tcp://127.0.0.1:*`` for a free port,
    ``ipc://...``), or connected when ``bind`` is False, for a collector that binds its SUB
    socket (llm-d's centralized mode). ``topic`` is vLLM's, empty by default; llm-d's indexer
    expects ``kv@<pod>@<model>``. The last ``buffer_steps`` batches can be replayed from
    ``replay_endpoint``, which is always bound. Sequence numbers start at 0 and grow by one per
    published batch. Every batch ``publish`` accepts is handed to the PUB socket, ``close``
    included; as with any PUB, what is still in flight when the socket closes may be lost.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        bind: bool = True,
    ) -> None:
        if buffer_steps <= 0:
            raise InvalidArgumentError(
                f"buffer_steps must be positive, got {buffer_steps}", "buffer_steps"
            )
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue[KVEventBatch | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._lock = threading.Lock()  # orders publish() against close()
        self._closed = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = _open(self._pub, endpoint, bind)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _open(self._replay, replay_endpoint, bind=True)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one step's events as the next batch; an empty list publishes nothing."""
        with self._lock:
            if self._closed:
                raise RuntimeError("KVEventPublisher is closed")
            if events:
                self._queue.put(KVEventBatch(time.time(), list(events), self.data_parallel_rank))

    def close(self) -> None:
        """Send what is queued, stop the thread, release both sockets and the context. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()
        self._ctx.term()

    def _run(self) -> None:
        stopping = False
        try:
            while not stopping:
                try:
                    batch = self._queue.get(timeout=_IDLE_POLL_S)
                    stopping = batch is None
                except queue.Empty:
                    batch = None
                try:
                    if batch is not None:
                        self._send(batch)
                    self._serve_replays()
                except Exception:  # a bad batch or request must not end the stream
                    logger.exception("KV event publisher")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning(
                    "ignoring a malformed KV event replay request of %d frames", len(frames)
                )
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", _END_SEQ, b""))


class KVEventSubscriber(_ClosedOnExit):
    """Reads one publisher's batches in sequence order, filling gaps from its replay socket.

    With ``start_seq`` the first ``recv`` first replays what is buffered from there (a router
    that joins late), and older batches are skipped. A gap in ``seq`` is filled from the replay
    socket when one is given; a gap the publisher can no longer fill (its buffer moved on, or no
    replay socket) shows as a jump in the returned ``seq``, after which the consumer's view of
    that engine is unknown until the next ``AllBlocksCleared``. One thread uses a subscriber.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        start_seq: int | None = None,
        replay_timeout_s: float = 1.0,
        bind: bool = False,
    ) -> None:
        self.replay_timeout_s = replay_timeout_s
        self._replay_endpoint = replay_endpoint
        self._next_seq = start_seq
        self._replay_first = start_seq is not None and replay_endpoint is not None
        self._pending: deque[tuple[int, KVEventBatch]] = deque()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._replay: zmq.Socket | None = None
        try:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self.endpoint = _open(self._sub, endpoint, bind)
            if replay_endpoint is not None:
                self._replay = self._dealer(replay_endpoint)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    def recv(self, timeout_s: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next ``(seq, batch)``, or None if nothing arrives in ``timeout_s`` (None: wait)."""
        if self._replay_first:
            self._replay_first = False
            self._fill_gap(None)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pending:
            wait_ms = (
                None if deadline is None else max(0, round((deadline - time.monotonic()) * 1000))
            )
            if not self._sub.poll(wait_ms):
                return None
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self._next_seq is not None and seq < self._next_seq:
                continue  # already returned from a replay
            if self._next_seq is not None and seq > self._next_seq:
                self._fill_gap(seq)
            self._pending.append((seq, decode_batch(payload)))
            self._next_seq = seq + 1
        return self._pending.popleft()

    def __iter__(self) -> Iterator[tuple[int, KVEventBatch]]:
        """Every batch from now on, in order; blocks while none arrives."""
        while (item := self.recv()) is not None:
            yield item

    def replay(self, start_seq: int) -> list[tuple[int, KVEventBatch]]:
        """Every batch the publisher still buffers from ``start_seq`` on, oldest first.

        Raises TimeoutError when the publisher does not answer within ``replay_timeout_s``.
        """
        if self._replay is None or self._replay_endpoint is None:
            raise RuntimeError("KVEventSubscriber has no replay_endpoint")
        timeout_ms = round(self.replay_timeout_s * 1000)
        out: list[tuple[int, KVEventBatch]] = []
        try:
            self._replay.send_multipart((b"", start_seq.to_bytes(8, "big")), flags=zmq.NOBLOCK)
            while self._replay.poll(timeout_ms):
                _, seq_bytes, payload = self._replay.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    return out
                out.append((seq, decode_batch(payload)))
        except zmq.Again:
            pass
        self._replay.close(linger=0)  # a late answer must not be read as the next one's
        self._replay = self._dealer(self._replay_endpoint)
        raise TimeoutError(
            f"no KV event replay from {self._replay_endpoint} in {self.replay_timeout_s}s"
        )

    def close(self) -> None:
        """Release the sockets. Idempotent."""
        self._ctx.destroy(linger=0)

    def _dealer(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        return sock

    def _fill_gap(self, upto: int | None) -> None:
        """Queue the replayed batches from ``_next_seq`` up to, not including, ``upto``."""
        if self._replay is None or self._next_seq is None:
            return
        try:
            replayed = self.replay(self._next_seq)
        except TimeoutError as e:
            logger.warning("KV events %d.. missed: %s", self._next_seq, e)
            return
        for seq, batch in replayed:
            if upto is not None and seq >= upto:
                break
            self._pending.append((seq, batch))
            self._next_seq = seq + 1
