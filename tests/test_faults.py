"""Fault injection on real loopback sockets, against a reference of what each engine's
block pool holds (`service_workload.RefRank`). Each fault ends in one of two outcomes,
asserted exactly: the index equals the reference, or the instance is `incomplete` and
the lost batches are counted (and are exactly the seqs never delivered)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq
from netutil import free_port
from service_workload import Conversation, RefRank

from kvindex.index import FleetIndex
from kvindex.subscriber import (
    Delivery,
    InstanceSpec,
    Item,
    Lost,
    ReplayPolicy,
    Restarted,
    SourceKey,
    Subscriber,
)
from kvindex.wire import render_hash
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

FAST = ReplayPolicy(
    first_reply_timeout=0.4, idle_timeout=0.3, deadline=5.0, max_attempts=2, idle_probe=0.5
)
KEY = SourceKey("vllm")


@dataclass
class Harness:
    """One engine (publisher + reference pool) followed by a Subscriber into an index."""

    pub: Publisher
    sub: Subscriber
    ref: RefRank = field(init=False)
    index: FleetIndex = field(default_factory=FleetIndex)
    items: list[Item] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(5))

    def __post_init__(self) -> None:
        self.ref = RefRank(self.pub)
        self.convs = [Conversation(self.rng, i) for i in range(4)]

    def pump(self, seconds: float = 0.0, until: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + seconds
        while True:
            for item in self.sub.poll(0.02):
                self.index.handle(item)
                self.items.append(item)
            if until is not None and until():
                return
            if time.monotonic() >= deadline:
                if until is None:
                    return
                raise AssertionError(f"timed out; stats {self.stats}")

    def connected(self) -> None:
        self.pump(5, lambda: self.stats.connected)
        self.pump(0.2)  # the subscription reaches the publisher

    def workload(self, turns: int, poll: bool = True) -> None:
        """Conversations served, copied and evicted, like an engine under load."""
        for _ in range(turns):
            for conv in self.convs:
                prompt = conv.next_prompt()
                self.ref.serve(prompt)
                if self.rng.random() < 0.3:
                    self.ref.copy_again(prompt)
                self.ref.evict(self.rng, self.rng.randrange(0, 3))
                if poll:
                    self.pump()

    def sync(self, timeout: float = 20) -> None:
        """An undropped batch, then wait until everything published was delivered or
        reported lost (the tail of a stream is only seen missing once a later one comes)."""
        self.pub.drop = None
        self.pub.publish([])
        last = self.pub.next_seq - 1
        self.pump(timeout, lambda: self.stats.last_seq == last and not self.sub_replaying())

    def sub_replaying(self) -> bool:
        return self.sub.status(KEY) == "replaying"

    @property
    def stats(self):  # type: ignore[no-untyped-def]
        return self.sub.stats(KEY)

    def exact(self) -> bool:
        return self.index.block_hashes("vllm") == self.ref.held()

    def delivered(self) -> list[int]:
        return [i.seq for i in self.items if isinstance(i, Delivery)]

    def lost(self) -> list[int]:
        return [s for i in self.items if isinstance(i, Lost) for s in range(i.first, i.last + 1)]


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    opts = getattr(request, "param", {})
    pub = Publisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        buffer_steps=opts.get("buffer_steps", 10_000),
        hwm=opts.get("hwm", 100_000),
    )
    replay = (
        pub.replay_endpoint if not opts.get("absent_replay") else f"tcp://127.0.0.1:{free_port()}"
    )
    sub = Subscriber(pub.endpoint, replay=replay, policy=FAST, rcvhwm=opts.get("rcvhwm", 100_000))
    h = Harness(pub, sub)
    try:
        yield h
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("rate", [0.01, 0.1, 0.3, 0.6])
def test_dropped_batches_at_several_rates_end_exact(harness: Harness, rate: float) -> None:
    h = harness
    h.connected()
    drops = random.Random(int(rate * 100))
    h.pub.drop = lambda seq: drops.random() < rate
    h.workload(12)
    h.sync()
    assert h.pub.dropped > 0
    assert h.delivered() == list(range(h.pub.next_seq))
    assert h.exact() and len(h.ref.held()) > 20
    assert h.stats.lost_batches == 0 and h.stats.replayed_batches >= h.pub.dropped
    assert h.sub.status(KEY) == "live"


@pytest.mark.parametrize("harness", [{"hwm": 20, "rcvhwm": 20}], indirect=True)
def test_subscriber_far_slower_than_publisher_recovers_by_replay(harness: Harness) -> None:
    h = harness
    h.connected()
    h.workload(150, poll=False)  # hundreds of batches while nobody reads: HWMs overflow
    published = h.pub.next_seq
    h.sync()
    assert h.stats.received < published  # ZMQ dropped what did not fit
    assert h.delivered() == list(range(h.pub.next_seq))
    assert h.exact() and h.stats.lost_batches == 0 and h.stats.gaps >= 1


@pytest.mark.parametrize("harness", [{"hwm": 20, "rcvhwm": 20, "buffer_steps": 100}], indirect=True)
def test_overflow_beyond_the_replay_buffer_is_incomplete_with_the_lost_count(
    harness: Harness,
) -> None:
    h = harness
    h.connected()
    h.workload(150, poll=False)
    h.sync()
    total = h.pub.next_seq
    delivered, lost = h.delivered(), h.lost()
    assert lost and sorted(delivered + lost) == list(range(total))  # each seq: one or other
    assert h.stats.lost_batches == len(lost)
    assert h.sub.status(KEY) == "incomplete"


def test_absent_replay_socket_late_join_and_drops_are_counted_lost() -> None:
    with Publisher("tcp://127.0.0.1:*") as pub:
        for _ in range(30):
            pub.publish([])  # before the subscriber: only a replay could bring them
        nobody = f"tcp://127.0.0.1:{free_port()}"
        with Subscriber(pub.endpoint, replay=nobody, policy=FAST) as sub:
            h = Harness(pub, sub)
            h.connected()
            pub.drop = lambda seq: seq in (40, 41, 45)
            for _ in range(20):
                pub.publish([])
                h.pump()
            h.sync()
            assert h.lost() == [*range(30), 40, 41, 45]
            assert h.stats.lost_batches == 33
            assert h.delivered() == [s for s in range(51) if s not in h.lost()]
            assert h.sub.status(KEY) == "incomplete"


def test_hung_replay_loses_exactly_what_was_dropped_during_the_outage(harness: Harness) -> None:
    h = harness
    h.connected()
    h.workload(3)
    h.sync()
    assert h.exact()
    h.pub.replay_paused = True  # the replay socket accepts requests and never answers
    outage = {h.pub.next_seq + 2, h.pub.next_seq + 5}
    h.pub.drop = lambda seq: seq in outage
    h.workload(2)
    h.sync()
    assert sorted(h.lost()) == sorted(outage) and h.stats.lost_batches == 2
    assert h.sub.status(KEY) == "incomplete"
    h.pub.replay_paused = False  # the replay is back: later drops are recovered again
    h.pub.drop = lambda seq: seq % 4 == 0
    h.workload(3)
    h.sync()
    assert h.stats.lost_batches == 2 and h.delivered()[-1] == h.pub.next_seq - 1


@pytest.mark.parametrize("harness", [{"buffer_steps": 20}], indirect=True)
def test_gap_longer_than_the_replay_buffer_is_incomplete_with_the_lost_count(
    harness: Harness,
) -> None:
    h = harness
    h.connected()
    for _ in range(30):
        h.pub.publish([])
        h.pump()
    h.pub.drop = lambda seq: 30 <= seq < 80
    for _ in range(50):
        h.pub.publish([])
    h.sync()
    first_kept = h.pub.next_seq - 20  # what the buffer still holds
    assert h.lost() == list(range(30, first_kept))
    assert h.stats.lost_batches == first_kept - 30
    assert h.delivered() == [*range(30), *range(first_kept, 81)]
    assert not any(isinstance(i, Restarted) for i in h.items)
    assert h.sub.status(KEY) == "incomplete"


# -- two publishers, one name ---------------------------------------------------------


def test_two_publishers_cannot_bind_one_endpoint() -> None:
    with Publisher("tcp://127.0.0.1:*") as first:
        with pytest.raises(zmq.ZMQError) as err:
            Publisher(first.endpoint)
        assert err.value.errno == zmq.EADDRINUSE


def test_two_names_for_one_publisher_see_the_same_state() -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        ref = RefRank(pub)
        specs = [InstanceSpec(n, pub.endpoint, pub.replay_endpoint) for n in ("x", "y")]
        with Subscriber(instances=specs, policy=FAST) as sub:
            with pytest.raises(ValueError, match="already followed"):
                sub.add_instance(specs[0])
            index = FleetIndex()
            rng = random.Random(3)
            conv = Conversation(rng, 0)
            for _ in range(10):
                ref.serve(conv.next_prompt())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not all(
                sub.stats(SourceKey(n)).last_seq == pub.next_seq - 1 for n in ("x", "y")
            ):
                for item in sub.poll(0.05):
                    index.handle(item)
            held = {render_hash(h) for h in ref.held()}
            for name in ("x", "y"):
                assert {render_hash(h) for h in index.block_hashes(name)} == held


def test_one_name_twice_across_config_and_flags_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('[[instances]]\nname = "a"\nendpoint = "tcp://127.0.0.1:5557"\n')
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvindex", "serve", "--store", "memory",
            "--config", str(config), "--instance", "a=tcp://127.0.0.1:6557",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )  # fmt: skip
    assert proc.returncode == 2 and "'a' is given twice" in proc.stderr
    assert proc.stderr.count("\n") == 1
