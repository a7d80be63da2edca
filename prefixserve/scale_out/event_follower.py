"""One thread per replica that keeps the router's ``HashMirror`` of it in step with its KV events.

::

    replica's engine ── KVEventPublisher (PUB + replay) ──▶ EventFollower thread ──▶ HashMirror
                                                           KVEventSubscriber(start_seq=0)

The subscriber starts from sequence 0, so a router that joins late first replays what the
publisher still buffers, then follows the live stream; the mirror lags the engine by about one
step. A gap the replay socket cannot fill means the mirror no longer knows the replica's cache:
it is cleared and rebuilt from the events that follow (it may then miss hits, never invent them).
"""

from __future__ import annotations

import logging
import threading

from prefixserve.kv.kv_event_publisher import KVEventSubscriber
from prefixserve.scale_out.protocol import KVEventsEndpoint
from prefixserve.scale_out.router import HashMirror

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the thread checks whether it should stop


class EventFollower:
    """Applies every ``KVEventBatch`` a replica publishes to ``mirror``, in order.

    The thread owns its ZMQ sockets (created and closed on it). ``close`` only asks it to stop,
    so it never blocks the caller (the router's event loop); ``join`` waits for it.
    """

    def __init__(self, source: KVEventsEndpoint, mirror: HashMirror, name: str = "") -> None:
        self.source = source
        self.mirror = mirror
        self.last_seq: int | None = None
        self.num_gaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-{name or source.endpoint}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            subscriber = KVEventSubscriber(
                self.source.endpoint, replay_endpoint=self.source.replay_endpoint, start_seq=0
            )
        except Exception:
            logger.exception("cannot follow KV events at %s", self.source.endpoint)
            return
        try:
            while not self._stop.is_set():
                item = subscriber.recv(timeout_s=_POLL_S)
                if item is None:
                    continue
                seq, batch = item
                expected = 0 if self.last_seq is None else self.last_seq + 1
                if seq != expected:
                    self.num_gaps += 1
                    logger.warning(
                        "KV events from %s jumped from %d to %d; its mirror starts over",
                        self.source.endpoint, expected, seq,
                    )  # fmt: skip
                    self.mirror.clear()
                self.mirror.apply(batch.events)
                self.last_seq = seq
        except Exception:
            logger.exception("KV event follower for %s stopped", self.source.endpoint)
        finally:
            subscriber.close()
