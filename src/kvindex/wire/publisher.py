"""A vLLM-compatible publisher: PUB for live batches, ROUTER for replay, on the real wire.

It behaves like vLLM's `ZmqEventPublisher` (3-frame live messages, seq from 0, a bounded
replay buffer, the end marker), with knobs vLLM does not have, for tests, demos and
benchmarks: the replay reply layout of either generation, a live-send drop hook, a small
replay send HWM like vLLM <= 0.32, and `restart()`, which behaves like a new engine process.

Live sends happen on the caller's thread; replay requests are served by a background thread
(a ZMQ socket is only ever used by one thread).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec
import zmq

from kvindex.wire.events import (
    AllBlocksCleared,
    BigramBlockStored,
    BlockRemoved,
    BlockStored,
    Event,
    UnknownEvent,
    _ArrayAllBlocksCleared,
    _ArrayBlockRemoved,
    _ArrayBlockStored,
)
from kvindex.wire.frames import END_SEQ_BYTES, encode_seq

__all__ = ["Publisher", "encode_batch"]

Generation = Literal["maps", "arrays"]

_encoder = msgspec.msgpack.Encoder()


def _as_map(event: Event) -> object:
    # A bigram page as SGLang sends it: its pairs as `token_ids` (map form only).
    return event.wire() if isinstance(event, BigramBlockStored) else event


def _as_array(event: Event) -> object:
    if isinstance(event, BigramBlockStored):
        return event.wire()  # SGLang has no array form
    if isinstance(event, BlockStored):
        return _ArrayBlockStored(**msgspec.structs.asdict(event))
    if isinstance(event, BlockRemoved):
        return _ArrayBlockRemoved(**msgspec.structs.asdict(event))
    if isinstance(event, AllBlocksCleared):
        return _ArrayAllBlocksCleared()
    return event


def encode_batch(
    events: Sequence[Event],
    ts: float | None = None,
    dp_rank: int | None = 0,
    generation: Generation = "maps",
) -> bytes:
    """Encode events as vLLM does: maps (vLLM >= 0.24) or positional arrays (<= 0.23)."""
    if any(isinstance(e, UnknownEvent) for e in events):
        raise ValueError("unknown events can't be encoded")
    body = [_as_map(e) for e in events] if generation == "maps" else [_as_array(e) for e in events]
    batch: list[object] = [time.time() if ts is None else ts, body]
    if dp_rank is not None:
        batch.append(dp_rank)
    return _encoder.encode(batch)


class Publisher:
    """Publishes event batches like one vLLM engine (one DP rank)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        replay_hwm: int | None = None,
        reply_layout: Literal[3, 4] = 4,
        generation: Generation = "maps",
        dp_rank: int | None = 0,
        drop: Callable[[int], bool] | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        setup: Callable[[zmq.Socket[bytes]], None] | None = None,
        subscriptions: bool = False,
    ) -> None:
        """`setup` is called on both sockets before they bind (e.g. to make them CURVE
        servers: `kvindex.security.curve.server_setup`). With `subscriptions`, the live
        socket is an XPUB (the same on the wire) so that `wait_for_subscriber` can work."""
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self.generation: Generation = generation
        self.dp_rank = dp_rank
        self.reply_layout = reply_layout
        self.drop = drop
        self.dropped = 0
        self.replays_served = 0
        # While True, replay requests are read and never answered (a hung replay socket).
        self.replay_paused = False
        self._pub = self._ctx.socket(zmq.XPUB if subscriptions else zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if subscriptions:
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's, not just the first
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        if setup is not None:
            setup(self._pub)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(
                zmq.SNDHWM, replay_hwm if replay_hwm is not None else 2 * (buffer_steps + 1)
            )
            if setup is not None:
                setup(router)
            try:
                router.bind(replay_endpoint)
            except zmq.ZMQError:  # its port taken: nothing of this Publisher stays bound
                router.close(linger=0)
                self._pub.close(linger=0)
                raise
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[Event], ts: float | None = None) -> int:
        """Encode and send one batch; returns its seq."""
        return self.publish_payload(encode_batch(events, ts, self.dp_rank, self.generation))

    def publish_payload(self, payload: bytes) -> int:
        """Send an already encoded payload (or a deliberately broken one) as the next batch."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        if self.drop is not None and self.drop(seq):
            self.dropped += 1
        else:
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), copy=False)
        return seq

    def wait_for_subscriber(self, timeout: float = 5.0) -> None:
        """Block until a SUB's subscription has reached the live socket (made with
        `subscriptions=True`). A SUB reports its handshake before the publisher's socket
        has attached it, and what is sent in between is dropped (ZMQ's "slow joiner"):
        a test that expects live batches waits here first. TimeoutError if none comes."""
        if self._pub.socket_type != zmq.XPUB:
            raise RuntimeError("wait_for_subscriber needs Publisher(..., subscriptions=True)")
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self._pub.poll(max(1, int(left * 1000))) and self._pub.recv()[:1] == b"\x01":
                return
        raise TimeoutError(f"no subscriber subscribed within {timeout:g} s")

    def put(self, seq: int, payload: bytes, live: bool = True) -> None:
        """Buffer `payload` under an explicit `seq` (a relay preserves its upstream's seqs)
        and, if `live`, send it on the PUB socket too. Seqs must increase."""
        with self._lock:
            self._seq = seq + 1
            self._buffer.append((seq, payload))
        if live:
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), copy=False)

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (hostile-input tests)."""
        self._pub.send_multipart(list(frames))

    def restart(self) -> None:
        """Behave like a restarted engine: seq back to 0, replay buffer empty."""
        with self._lock:
            self._seq = 0
            self._buffer.clear()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._pub.close(linger=0)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, router: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start = frames
                if not self.replay_paused:
                    self._answer(router, client, int.from_bytes(start, "big"))
        finally:
            router.close(linger=0)

    def _answer(self, router: zmq.Socket[bytes], client: bytes, start: int) -> None:
        with self._lock:
            batches = [(s, p) for s, p in self._buffer if s >= start]
        self.replays_served += 1
        head = [client, b"", self._topic] if self.reply_layout == 4 else [client, b""]
        for seq, payload in batches:
            router.send_multipart([*head, encode_seq(seq), payload])
        marker_head = [client, b"", b""] if self.reply_layout == 4 else [client, b""]
        router.send_multipart([*marker_head, END_SEQ_BYTES, b""])
