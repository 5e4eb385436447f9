"""Replay endpoints that misbehave (issue 17, point 4): the replay is checked, not trusted.

Each endpoint is a real ROUTER socket on loopback answering the Subscriber's DEALER the
wrong way, beside a real publisher whose live stream drops some batches (so replays are
asked for). Whatever it does, the Subscriber must keep up with the live stream, never
loop on restarts, never call the publisher `live` while it holds a hole, and say why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import zmq

from kvindex.subscriber import (
    Delivery,
    Lost,
    ReplayPolicy,
    ReplayRefused,
    SourceKey,
    Subscriber,
)
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher, encode_batch

pytestmark = pytest.mark.timeout(60)

KEY = SourceKey("vllm")
END = b"\xff" * 8
POLICY = ReplayPolicy(
    first_reply_timeout=0.3, idle_timeout=0.3, deadline=5.0, max_attempts=3, idle_probe=None
)

# What a replay endpoint does with one request: (send, client id, start seq, stop event).
Answer = Callable[[Callable[[list[bytes]], None], int, threading.Event], None]


@contextmanager
def replay_endpoint(answer: Answer) -> Iterator[str]:
    """A ROUTER on loopback that answers each replay request with `answer`."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            client, _, start = router.recv_multipart()

            def send(frames: list[bytes], client: bytes = client) -> None:
                router.send_multipart([client, *frames])

            answer(send, int.from_bytes(start, "big"), stop)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)


def batch(seq: int, salt: int = 0) -> bytes:
    return encode_batch([BlockStored([seq * 1000 + salt + 1], None, [seq] * 4, 4)])


def follow(
    replay: str,
    seconds: float,
    drop: Callable[[int], bool],
    policy: ReplayPolicy = POLICY,
    rate: float = 200.0,
) -> tuple[Subscriber, list[object], Publisher]:
    """Publish for `seconds` at `rate` batches/s, dropping `drop` seqs on the live stream,
    while a Subscriber follows with `replay` as the replay endpoint; then read on 1 s."""
    pub = Publisher("tcp://127.0.0.1:*", drop=drop)
    sub = Subscriber(pub.endpoint, replay=replay, policy=policy)
    items: list[object] = []
    deadline = time.monotonic() + 10
    while not sub.stats(KEY).connected and time.monotonic() < deadline:
        items += sub.poll(0.05)
    time.sleep(0.2)  # subscribed
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pub.publish_payload(batch(pub.next_seq))
        items += sub.poll(1 / rate)
    pub.drop = None  # the last batch arrives: nothing is missing unseen at the end
    pub.publish_payload(batch(pub.next_seq))
    settle = time.monotonic() + 1.0
    while time.monotonic() < settle:
        items += sub.poll(0.05)
    return sub, items, pub


def accounted(items: list[object]) -> set[int]:
    """Every seq delivered or reported lost."""
    seqs: set[int] = set()
    for item in items:
        if isinstance(item, Delivery):
            seqs.add(item.seq)
        elif isinstance(item, Lost):
            seqs.update(range(item.first, item.last + 1))
    return seqs


def every_tenth(seq: int) -> bool:
    return seq % 10 == 5


def test_a_replay_that_answers_with_other_batches_does_not_loop_on_restarts() -> None:
    """It answers the seq asked for with a batch the publisher never sent: each looks like
    an engine restart. Before: hundreds of restarts a second, the state empty, `live`."""

    def lie(send: Callable[[list[bytes]], None], start: int, stop: threading.Event) -> None:
        for seq in range(start, start + 20):
            send([b"", seq.to_bytes(8, "big"), batch(seq, salt=7)])
        send([b"", END, b""])

    with replay_endpoint(lie) as replay:
        sub, items, pub = follow(replay, 3.0, every_tenth)
        try:
            stats = sub.stats(KEY)
            # A few restarts (the replay's word against the live stream's), then the
            # replay is backed off each time it contradicts it again.
            assert stats.publisher_restarts <= POLICY.max_restarts + 2, stats
            assert stats.replay_refusals >= 1
            assert any(isinstance(i, ReplayRefused) for i in items)
            assert sub.status(KEY) == "incomplete"  # never `live` with what it can't trust
            assert max(accounted(items)) == pub.next_seq - 1  # kept up with the live stream
        finally:
            sub.close()
            pub.close()


def test_a_replay_that_streams_forever_is_cut_by_its_byte_budget() -> None:
    """It answers with seq after seq, 1 MB each, and never ends. Before: the replay ran
    until its deadline, its seqs applied and the publisher `live` with blocks missing."""
    policy_budget = 8 << 20
    big = b"\x00" * (1 << 20)

    def flood(send: Callable[[list[bytes]], None], start: int, stop: threading.Event) -> None:
        for seq in range(start, start + 200):
            if stop.is_set():
                return
            send([b"", seq.to_bytes(8, "big"), big])

    policy = ReplayPolicy(
        first_reply_timeout=0.3,
        idle_timeout=0.3,
        deadline=5.0,
        max_attempts=3,
        idle_probe=None,
        max_bytes=policy_budget,
    )
    with replay_endpoint(flood) as replay:
        sub, items, pub = follow(replay, 2.0, every_tenth, policy)
        try:
            stats = sub.stats(KEY)
            assert stats.replay_refusals >= 1
            refused = [i for i in items if isinstance(i, ReplayRefused)]
            assert any("MiB" in i.reason for i in refused), refused
            assert sub.status(KEY) == "incomplete"
            assert max(accounted(items)) == pub.next_seq - 1
            assert stats.publisher_restarts <= policy.max_restarts + 2
        finally:
            sub.close()
            pub.close()


def test_a_silent_replay_costs_one_wait_then_gaps_are_lost_at_once() -> None:
    """It takes requests and never answers. Before: every gap waited for every attempt's
    timeout (here ~1 s each), so the instance fell further behind with each one."""

    def silent(send: Callable[[list[bytes]], None], start: int, stop: threading.Event) -> None:
        return

    with replay_endpoint(silent) as replay:
        sub, items, pub = follow(replay, 3.0, every_tenth)
        try:
            # 60 gaps in 3 s: only a back-off keeps the stream caught up.
            assert accounted(items) == set(range(pub.next_seq))
            assert sub.stats(KEY).lost_batches >= 50
            assert sub.status(KEY) == "incomplete"
            assert any(isinstance(i, ReplayRefused) for i in items)
        finally:
            sub.close()
            pub.close()


def test_an_honest_replay_after_a_back_off_is_trusted_again() -> None:
    """The back-off ends: a replay that answers right fills gaps again."""
    held: dict[int, bytes] = {}
    mode = {"honest": False}

    def answer(send: Callable[[list[bytes]], None], start: int, stop: threading.Event) -> None:
        if not mode["honest"]:
            return  # silent at first
        for seq in range(start, max(held) + 1):
            send([b"", seq.to_bytes(8, "big"), held[seq]])
        send([b"", END, b""])

    policy = ReplayPolicy(
        first_reply_timeout=0.2, idle_timeout=0.2, max_attempts=1, idle_probe=None, backoff=0.3
    )
    with replay_endpoint(answer) as replay:
        pub = Publisher("tcp://127.0.0.1:*")
        sub = Subscriber(pub.endpoint, replay=replay, policy=policy)
        try:
            deadline = time.monotonic() + 10
            while not sub.stats(KEY).connected and time.monotonic() < deadline:
                sub.poll(0.05)
            time.sleep(0.2)
            items: list[object] = []

            def publish(seq_drop: bool) -> None:
                seq = pub.next_seq
                held[seq] = batch(seq)
                pub.drop = (lambda s: True) if seq_drop else None
                pub.publish_payload(held[seq])
                pub.drop = None

            for i in range(4):
                publish(i == 1)  # seq 1 dropped: the silent replay loses it
                items += sub.poll(0.05)
            for _ in range(20):
                items += sub.poll(0.05)
            assert [i.first for i in items if isinstance(i, Lost)] == [1]
            mode["honest"] = True
            time.sleep(0.7)  # past the back-off
            for i in range(4):
                publish(i == 1)
                items += sub.poll(0.05)
            for _ in range(20):
                items += sub.poll(0.05)
            delivered = [i.seq for i in items if isinstance(i, Delivery)]
            assert delivered == [0, 2, 3, 4, 5, 6, 7]  # seq 5 came from the replay
            assert [i.first for i in items if isinstance(i, Lost)] == [1]
        finally:
            sub.close()
            pub.close()
