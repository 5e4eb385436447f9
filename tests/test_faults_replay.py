"""Replay endpoints that misbehave, on real ZMQ sockets: a ROUTER that lies about seqs or
batches, streams forever, never answers, or sends what is no reply. Whatever it does, the
subscriber never applies a batch the live stream contradicts, never loops, never says
`live` with a hole, and leaves the endpoint alone for a while after each failure."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from kvindex.index import FleetIndex
from kvindex.subscriber import (
    Delivery,
    Discarded,
    Gap,
    Item,
    Lost,
    ReplayPolicy,
    ReplayRefused,
    Restarted,
    SourceKey,
    Subscriber,
)
from kvindex.wire import BlockStored, render_hash
from kvindex.wire.frames import END_SEQ_BYTES, encode_seq
from kvindex.wire.publisher import Publisher, encode_batch

pytestmark = pytest.mark.timeout(60)

KEY = SourceKey("vllm")
FAST = ReplayPolicy(
    first_reply_timeout=0.4,
    idle_timeout=0.3,
    deadline=3.0,
    max_attempts=2,
    idle_probe=None,  # requests only for gaps and joins: counts stay exact
    backoff=0.5,
)
REAL = 1_000  # the real publisher stores hash REAL + seq
FAKE = 9_000_000  # an invented batch stores FAKE + seq

Reply = tuple[int, bytes] | None  # a (seq, payload) reply, or None for the end marker
# What to answer a request from `start`, given the real buffer; None: never answer.
Answer = Callable[[int, list[tuple[int, bytes]]], Iterator[Reply] | None]


def real(seq: int) -> bytes:
    return encode_batch([BlockStored([REAL + seq], None, [seq] * 4, 4)])


def invented(seq: int, pad: int = 0) -> bytes:
    return encode_batch([BlockStored([FAKE + seq], None, [seq] * 4, 4, lora_name="x" * pad)])


class FakeReplay:
    """A ROUTER on loopback answering each request with what `answer(start, buffer)`
    yields (`buffer`: the real publisher's buffered batches). A new request replaces the
    one being answered; replies wait for room (ROUTER_MANDATORY), none is dropped."""

    def __init__(self, pub: Publisher, answer: Answer, sndhwm: int = 1000) -> None:
        self.pub = pub
        self.answer = answer
        self.requests: list[int] = []
        self.sent = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDHWM, sndhwm)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:*")
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        router = self._router
        current: tuple[bytes, Iterator[Reply]] | None = None
        reply: list[bytes] | None = None
        while not self._stop.is_set():
            if router.poll(0 if current else 20):
                frames = router.recv_multipart()
                client, start = frames[0], int.from_bytes(frames[-1], "big")
                self.requests.append(start)
                replies = self.answer(start, list(self.pub._buffer))
                current = None if replies is None else (client, replies)
                reply = None
            if current is None:
                continue
            client, replies = current
            if reply is None:
                nxt = next(replies, None)
                seq, payload = (-1, b"") if nxt is None else nxt
                wire_seq = END_SEQ_BYTES if nxt is None else encode_seq(seq)
                reply = [client, b"", b"", wire_seq, payload]
                done = nxt is None
            else:
                done = reply[3] == END_SEQ_BYTES
            try:
                router.send_multipart(reply, zmq.NOBLOCK)
            except zmq.Again:  # no room: wait for the subscriber to read
                time.sleep(0.001)
                continue
            except zmq.ZMQError:  # the client went away
                current = reply = None
                continue
            self.sent += 1
            reply = None
            if done:
                current = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(linger=0)
        self._ctx.term()


def honest(start: int, buffer: list[tuple[int, bytes]]) -> Iterator[Reply]:
    yield from ((s, p) for s, p in buffer if s >= start)
    yield None


@dataclass
class Follow:
    """A real publisher, a fake replay endpoint, a Subscriber, and an index fed from it."""

    pub: Publisher
    fake: FakeReplay
    sub: Subscriber
    index: FleetIndex = field(default_factory=FleetIndex)
    items: list[Item] = field(default_factory=list)

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.take(0.02)

    def take(self, timeout: float = 0.0) -> None:
        for item in self.sub.poll(timeout):
            self.index.handle(item)
            self.items.append(item)

    def until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out: {self.stats}"
            self.take(0.02)

    def connected(self) -> None:
        self.until(lambda: self.stats.connected)
        self.pump(0.2)  # the subscription reaches the publisher

    def publish(self, count: int, drop: set[int] | None = None) -> None:
        for _ in range(count):
            seq = self.pub.next_seq
            self.pub.drop = (lambda s: s in drop) if drop else None
            self.pub.publish_payload(real(seq))
            self.take()
        self.pub.drop = None

    def settled(self) -> None:
        """Until the last published seq is delivered and no replay runs."""
        last = self.pub.next_seq - 1
        self.until(lambda: self.stats.last_seq == last and self.sub.status(KEY) != "replaying")

    @property
    def stats(self):  # type: ignore[no-untyped-def]
        return self.sub.stats(KEY)

    def of(self, kind: type) -> list:  # type: ignore[type-arg]
        return [i for i in self.items if isinstance(i, kind)]

    def delivered_since_drop(self) -> list[int]:
        """Seqs delivered since the state was last dropped (what the index holds)."""
        out: list[int] = []
        for item in self.items:
            if isinstance(item, Restarted):
                out = []
            elif isinstance(item, Delivery):
                out.append(item.seq)
        return out

    def held(self) -> set[int]:
        return {int(h) - REAL for h in map(render_hash, self.index.block_hashes("vllm"))}

    def invented_held(self) -> bool:
        return any(int(render_hash(h)) >= FAKE for h in self.index.block_hashes("vllm"))


@contextlib.contextmanager
def follow(
    answer: Answer, policy: ReplayPolicy = FAST, sndhwm: int = 1000, published: int = 0
) -> Iterator[Follow]:
    """`published` batches are sent before the subscriber exists: only a replay could bring
    them."""
    pub = Publisher("tcp://127.0.0.1:*")
    for seq in range(published):
        pub.publish_payload(real(seq))
    fake = FakeReplay(pub, answer, sndhwm)
    sub = Subscriber(pub.endpoint, replay=fake.endpoint, policy=policy)
    try:
        yield Follow(pub, fake, sub)
    finally:
        sub.close()
        fake.close()
        pub.close()


# -- lies ---------------------------------------------------------------------------------


def other_batch(start: int, buffer: list[tuple[int, bytes]]) -> Iterator[Reply]:
    """Answers the seq asked for with another batch under it, then the real ones."""
    replies = [(s, p) for s, p in buffer if s >= start]
    if replies:
        replies[0] = (start, invented(start))
    yield from replies
    yield None


def test_a_replay_answering_a_seq_with_another_batch_is_refused_without_a_restart() -> None:
    with follow(other_batch) as f:
        f.connected()
        f.publish(5)  # 0..4 live (the join's replay from 0 found nothing to check)
        f.settled()
        # Seq 6 dropped: the replay is asked from 5 (the last batch received, to check it is
        # the same engine): it answers 5 with another batch. That is no restart (the live
        # stream never went back): it is the replay that is wrong.
        f.publish(5, drop={6})
        f.settled()
        assert f.of(ReplayRefused) and f.stats.replay_refusals == 1
        assert not f.of(Restarted) and f.stats.publisher_restarts == 0
        assert [(x.first, x.last) for x in f.of(Lost)] == [(6, 6)]
        # More gaps while the endpoint is left alone: lost at once, no request, no loop.
        requests = len(f.fake.requests)
        f.publish(5, drop={11, 13})
        f.settled()
        assert len(f.fake.requests) == requests
        assert [(x.first, x.last) for x in f.of(Lost)] == [(6, 6), (11, 11), (13, 13)]
        f.pump(FAST.backoff)  # the backoff is over: asked again, refused again, longer
        f.publish(3, drop={16})
        f.settled()
        assert len(f.fake.requests) == requests + 1 and f.stats.replay_refusals == 2
        assert [r.backoff for r in f.of(ReplayRefused)] == [FAST.backoff, 2 * FAST.backoff]
        # Never a batch the replay invented; every seq applied or counted lost.
        assert not f.invented_held() and f.held() == {s for s in range(18)} - {6, 11, 13, 16}
        assert f.stats.lost_batches == 4 and f.sub.status(KEY) == "incomplete"


def seqs_from_below(start: int, buffer: list[tuple[int, bytes]]) -> Iterator[Reply]:
    """Sends seqs that were not asked for: from below the start."""
    yield from ((s, p) for s, p in buffer if s >= max(0, start - 3))
    yield None


def seq_twice(start: int, buffer: list[tuple[int, bytes]]) -> Iterator[Reply]:
    """Sends the seq asked for, then it again, out of order."""
    replies = [(s, p) for s, p in buffer if s >= start]
    if len(replies) > 2:
        replies.insert(2, replies[1])
    yield from replies
    yield None


def past_the_gap(start: int, buffer: list[tuple[int, bytes]]) -> Iterator[Reply]:
    """Answers from far past the seqs asked for, with batches it invents (once there is
    something to ask for: the join's request finds the buffer empty)."""
    if buffer:
        yield from ((s, invented(s)) for s in range(start + 50, start + 60))
    yield None


@pytest.mark.parametrize(
    "answer, reason",
    [
        (seqs_from_below, "asked for seq 4, the replay sent 1"),
        (seq_twice, "the replay sent seq 5 where 6 was due"),
    ],
)
def test_a_replay_sending_seqs_not_asked_for_is_refused(answer: Answer, reason: str) -> None:
    with follow(answer) as f:
        f.connected()
        f.publish(5)
        f.settled()
        f.publish(5, drop={5, 6})  # asked from 4 (checked), then 5 and 6
        f.settled()
        assert [r.reason for r in f.of(ReplayRefused)] == [reason]
        assert not f.of(Restarted)
        delivered = [i.seq for i in f.of(Delivery)]
        assert delivered == sorted(set(delivered))  # each once, in order
        lost = [s for x in f.of(Lost) for s in range(x.first, x.last + 1)]
        assert sorted(delivered + lost) == list(range(10))
        assert f.sub.status(KEY) == "incomplete" and not f.invented_held()


def test_a_replay_answering_past_the_gap_loses_the_gap_and_invents_nothing() -> None:
    with follow(past_the_gap) as f:
        f.connected()
        f.publish(5)
        f.settled()
        f.publish(5, drop={5, 6})  # the gap is 5..6; the replay answers from 54 on
        f.settled()
        assert [(x.first, x.last) for x in f.of(Lost)] == [(5, 6)]
        assert [i.seq for i in f.of(Delivery) if i.replayed] == []
        assert f.held() == {0, 1, 2, 3, 4, 7, 8, 9} and f.sub.status(KEY) == "incomplete"


def invent_from_zero(start: int, buffer: list[tuple[int, bytes]]) -> Iterator[Reply]:
    """At a join there is nothing to check a replay against: it invents 20 batches."""
    yield from ((s, invented(s)) for s in range(start, start + 20))
    yield None


def test_a_replay_the_live_stream_contradicts_later_is_discarded() -> None:
    with follow(invent_from_zero, published=10) as f:
        f.connected()  # the join's replay delivers its 20 invented batches (0..19)
        f.until(lambda: f.stats.delivered == 20 and f.sub.status(KEY) != "replaying")
        assert f.invented_held()
        f.publish(3)  # live seq 10: the replay's batch 10 was another
        f.settled()
        (discarded,) = f.of(Discarded)
        assert "differs from the live one" in discarded.reason
        assert f.stats.publisher_restarts == 0 and f.stats.replay_refusals == 1
        # The state holds the live stream from there, and says what it lacks.
        assert not f.invented_held() and f.held() == {10, 11, 12}
        assert [(x.first, x.last) for x in f.of(Lost)] == [(0, 9)]
        assert f.sub.status(KEY) == "incomplete"


# -- endless ------------------------------------------------------------------------------


def endless(pad: int) -> Answer:
    def answer(start: int, buffer: list[tuple[int, bytes]]) -> Iterator[Reply]:
        seq = start
        while True:
            yield seq, invented(seq, pad)
            seq += 1

    return answer


@pytest.mark.parametrize(
    "pad, policy, reason",
    [
        # 64 KB replies: the byte budget (1 MB) ends it.
        (
            64 * 1024,
            dataclasses.replace(FAST, max_bytes=1 << 20),
            "the replay went past its byte budget (1048576 bytes)",
        ),
        # Small replies: the deadline (1 s) ends it.
        (
            0,
            dataclasses.replace(FAST, deadline=1.0),
            "the replay was still answering after 1 s",
        ),
    ],
)
def test_an_endless_replay_is_cut_and_what_it_invented_goes(
    pad: int, policy: ReplayPolicy, reason: str
) -> None:
    with follow(endless(pad), policy, published=5) as f:
        f.connected()
        f.until(lambda: bool(f.of(ReplayRefused)))
        (refused,) = f.of(ReplayRefused)
        assert refused.reason == reason
        # Unbounded by any live batch, what it delivered can't be trusted: incomplete.
        assert f.sub.status(KEY) == "incomplete"
        f.publish(3)  # live seqs 5..7: far behind what the replay claimed
        f.settled()
        assert f.of(Discarded) and not f.invented_held() and f.held() == {5, 6, 7}
        assert f.stats.publisher_restarts == 0 and f.sub.status(KEY) == "incomplete"
        assert len(f.fake.requests) == 1  # and it was not asked again meanwhile


def test_the_replay_socket_queues_a_bounded_number_of_replies() -> None:
    # A subscriber that does not read: the endpoint can push only as many replies as the
    # replay socket queues (plus its own send queue and the kernel's buffers), not all.
    policy = dataclasses.replace(FAST, reply_queue=50)
    with follow(endless(16 * 1024), policy, sndhwm=50, published=1) as f:
        f.until(lambda: len(f.fake.requests) == 1)  # the join's request went out
        time.sleep(1.0)  # nobody reads for a second
        assert 50 <= f.fake.sent < 1_000  # unbounded, it would be all it could make


# -- silent -------------------------------------------------------------------------------


def silent(start: int, buffer: list[tuple[int, bytes]]) -> None:
    """Takes every request and never answers."""


def test_a_silent_replay_costs_one_wait_then_gaps_are_lost_at_once() -> None:
    with follow(silent) as f:
        f.connected()
        f.pump(FAST.first_reply_timeout * FAST.max_attempts + 0.2)  # the join's replay fails
        assert len(f.fake.requests) == FAST.max_attempts
        assert f.sub.status(KEY) == "live"  # nothing is known missing
        # Gaps now: each is lost as soon as it is seen, live batches are never held back.
        for _ in range(3):
            seq = f.pub.next_seq
            f.publish(3, drop={seq + 1})
            f.settled()
            assert f.of(Lost)[-1].first == seq + 1
        assert len(f.fake.requests) == FAST.max_attempts
        assert not f.of(Gap)  # no replay was waited for
        assert f.sub.status(KEY) == "incomplete" and f.stats.lost_batches == 3
