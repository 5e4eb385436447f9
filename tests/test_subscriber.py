"""The Subscriber on real ZMQ sockets (loopback) against the vLLM-compatible Publisher."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq
from netutil import free_port, free_ports
from pubsub import joined

from kvindex.subscriber import (
    Connection,
    DecodeFailed,
    Delivery,
    InstanceSpec,
    Item,
    Lost,
    Malformed,
    Replayed,
    ReplayPolicy,
    Restarted,
    SourceKey,
    Subscriber,
)
from kvindex.wire import BlockRemoved, BlockStored
from kvindex.wire.publisher import Publisher

FAST = ReplayPolicy(first_reply_timeout=0.5, idle_timeout=0.3, deadline=5.0, max_attempts=3)


def stored(i: int) -> list[BlockStored]:
    return [BlockStored([i], None, list(range(16)), 16)]


def collect(
    sub: Subscriber, until: Callable[[list[Item]], bool], timeout: float = 10.0
) -> list[Item]:
    items: list[Item] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(items):
        items.extend(sub.poll(0.05))
    return items


def deliveries(items: list[Item], instance: str | None = None) -> list[Delivery]:
    return [i for i in items if isinstance(i, Delivery) and instance in (None, i.instance)]


def seqs(items: list[Item], instance: str | None = None) -> list[int]:
    return [d.seq for d in deliveries(items, instance)]


def hashes(items: list[Item]) -> list[int]:
    out = []
    for d in deliveries(items):
        for e in d.batch.events:
            assert isinstance(e, BlockStored)
            out.extend(e.block_hashes)  # type: ignore[arg-type]
    return out


def publish_slowly(
    pub: Publisher, start: int, stop: int, sub: Subscriber, items: list[Item]
) -> None:
    for i in range(start, stop):
        pub.publish(stored(i))
        items.extend(sub.poll(0))


def test_every_batch_once_in_order_despite_drops() -> None:
    rng = random.Random(7)
    with (
        Publisher(
            "tcp://127.0.0.1:*",
            "tcp://127.0.0.1:*",
            drop=lambda s: rng.random() < 0.25,
            subscriptions=True,
        ) as pub,
        Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub,
    ):
        items = joined(pub, sub)
        publish_slowly(pub, 0, 400, sub, items)
        pub.drop = None
        pub.publish(stored(400))  # the tail can only be seen missing once a later batch arrives
        items += collect(sub, lambda it: len(seqs(items + it)) >= 401)
        assert seqs(items) == list(range(401))
        assert hashes(items) == list(range(401))
        stats = sub.stats(SourceKey("vllm"))
        assert pub.dropped > 50
        assert stats.gaps > 0 and stats.replayed_batches >= pub.dropped
        assert stats.lost_batches == 0 and stats.publisher_restarts == 0


def test_late_join_replays_what_is_already_cached() -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub:
        for i in range(120):
            pub.publish(stored(i))
        with Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub:
            items = collect(sub, lambda it: len(seqs(it)) >= 120)
            assert seqs(items) == list(range(120))
            assert all(d.replayed for d in deliveries(items))
            pub.publish(stored(120))
            items += collect(sub, lambda it: len(seqs(it)) >= 1)
            assert seqs(items)[-1] == 120


def test_replay_truncated_by_buffer_is_reported_lost() -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=10) as pub:
        for i in range(50):
            pub.publish(stored(i))
        with Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub:
            # Until the replay's end marker is read, the source is rightly `replaying`, even
            # with all ten batches delivered (under load the marker comes a poll later):
            # wait for the replay to finish, which the `Replayed` notice says.
            items = collect(sub, lambda it: any(isinstance(i, Replayed) for i in it))
            lost = [i for i in items if isinstance(i, Lost)]
            assert [(x.first, x.last) for x in lost] == [(0, 39)]
            assert seqs(items) == list(range(40, 50))
            key = SourceKey("vllm")
            assert sub.stats(key).lost_batches == 40
            assert sub.status(key) == "incomplete"


def test_small_replay_hwm_of_old_vllm_is_overcome_by_retries() -> None:
    # vLLM <= 0.32 answers with a send HWM of 1000 and silently drops the rest (even the
    # end marker); here the HWM is 25 for a 300-batch backlog.
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", replay_hwm=25) as pub:
        for i in range(300):
            pub.publish(stored(i))
        with Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub:
            items = collect(sub, lambda it: len(seqs(it)) >= 300, timeout=30)
            assert seqs(items) == list(range(300))
            assert not [i for i in items if isinstance(i, Lost)]


@pytest.mark.parametrize("layout", [3, 4])
def test_both_replay_reply_layouts(layout: int) -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", reply_layout=layout) as pub:  # type: ignore[arg-type]
        for i in range(5):
            pub.publish(stored(i))
        with Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub:
            assert seqs(collect(sub, lambda it: len(seqs(it)) >= 5)) == list(range(5))


def test_engine_restart_is_announced_before_the_new_stream() -> None:
    pub_port, replay_port = free_port(), free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    with Subscriber(pub_ep, replay=replay_ep, policy=FAST) as sub:
        pub = Publisher(pub_ep, replay_ep, subscriptions=True)
        items = joined(pub, sub)
        publish_slowly(pub, 0, 30, sub, items)
        items += collect(sub, lambda it: len(seqs(items + it)) >= 30)
        pub.close()
        time.sleep(0.3)
        pub = Publisher(pub_ep, replay_ep)  # a new engine process: seq starts at 0 again
        try:
            after = collect(sub, lambda it: any(isinstance(i, Restarted) for i in it), 10)
            publish_slowly(pub, 1000, 1005, sub, after)
            after += collect(sub, lambda it: 1004 in hashes(after + it), 10)
        finally:
            pub.close()
        kinds = [type(i).__name__ for i in after if isinstance(i, (Restarted, Delivery))]
        assert kinds[0] == "Restarted"
        new = [d for d in deliveries(after)]
        assert [d.seq for d in new] == list(range(5))
        assert hashes(after) == list(range(1000, 1005))
        assert sub.stats(SourceKey("vllm")).publisher_restarts == 1


def test_restart_seen_by_seq_going_back_without_reconnect() -> None:
    with (
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub,
        Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub,
    ):
        items = joined(pub, sub)
        publish_slowly(pub, 0, 20, sub, items)
        items += collect(sub, lambda it: len(seqs(items + it)) >= 20)
        pub.restart()
        pub.publish(stored(500))
        after = collect(sub, lambda it: 500 in hashes(it))
        assert isinstance(next(i for i in after if isinstance(i, (Restarted, Delivery))), Restarted)
        assert seqs(after) == [0]


def test_malformed_messages_are_counted_and_skipped() -> None:
    with (
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub,
        Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub,
    ):
        items = joined(pub, sub)
        pub.publish(stored(0))
        pub.send_raw([b"", b"\x00" * 3, b"x"])  # seq frame of the wrong width
        pub.send_raw([b"only-one-frame"])
        pub.publish_payload(b"\xc1garbage")  # seq 1: not msgpack
        pub.publish_payload(msgspec.msgpack.encode([1.0, [["BlockStored", "bad"]]]))  # seq 2
        pub.publish(stored(3))
        items += collect(sub, lambda it: 3 in hashes(it))
        assert seqs(items) == [0, 2, 3]
        failed = [i for i in items if isinstance(i, DecodeFailed)]
        assert [f.seq for f in failed] == [1]
        assert len([i for i in items if isinstance(i, Malformed)]) == 2
        stats = sub.stats(SourceKey("vllm"))
        assert stats.decode_errors == 2  # seq 1 whole, and the bad event of seq 2
        assert stats.malformed_messages == 2
        assert stats.lost_batches == 0


def test_hung_replay_of_one_instance_does_not_stall_another() -> None:
    ctx = zmq.Context.instance()
    hung = ctx.socket(zmq.ROUTER)  # accepts replay requests and never answers
    hung.bind("tcp://127.0.0.1:*")
    hung_ep = hung.getsockopt_string(zmq.LAST_ENDPOINT)
    with (
        Publisher("tcp://127.0.0.1:*") as bad,
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as good,
        Subscriber(
            instances=[
                InstanceSpec("bad", bad.endpoint, hung_ep),
                InstanceSpec("good", good.endpoint, good.replay_endpoint),
            ],
            policy=ReplayPolicy(first_reply_timeout=1.0, idle_timeout=1.0, max_attempts=2),
        ) as sub,
    ):
        items = collect(sub, lambda it: sum(isinstance(i, Connection) for i in it) >= 2, 5)
        items += collect(sub, lambda it: False, 0.3)  # subscriptions reach the publishers
        bad.drop = lambda s: s == 0
        bad.publish(stored(0))
        bad.publish(stored(1))  # gap: the replay of seq 0 hangs
        t0 = time.monotonic()
        publish_slowly(good, 0, 20, sub, items)
        items += collect(sub, lambda it: len(seqs(items + it, "good")) >= 20, 5)
        assert seqs(items, "good") == list(range(20))
        assert time.monotonic() - t0 < 1.5  # while "bad" still waits on its replay
        items += collect(sub, lambda it: any(isinstance(i, Lost) for i in it), 10)
        lost = [i for i in items if isinstance(i, Lost)]
        assert [(x.instance, x.first, x.last) for x in lost] == [("bad", 0, 0)]
        assert seqs(items, "bad") == [1]
        assert sub.status(SourceKey("bad")) == "incomplete"
    hung.close(linger=0)


def test_data_parallel_ranks_on_consecutive_ports() -> None:
    base = free_ports(4)
    pubs = [
        Publisher(f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{base + 2 + r}", dp_rank=r)
        for r in range(2)
    ]
    try:
        for r, pub in enumerate(pubs):
            for i in range(3):
                pub.publish(stored(100 * r + i))
        spec = InstanceSpec.parse(
            f"engine=tcp://127.0.0.1:{base},replay=tcp://127.0.0.1:{base + 2},dp=2"
        )
        with Subscriber(instances=[spec], policy=FAST) as sub:
            items = collect(sub, lambda it: len(seqs(it)) >= 6)
            by_rank = {
                r: [d.batch.data_parallel_rank for d in deliveries(items) if d.rank == r]
                for r in (0, 1)
            }
            assert by_rank == {0: [0, 0, 0], 1: [1, 1, 1]}
            assert sorted(hashes(items)) == [0, 1, 2, 100, 101, 102]
            assert {d.instance for d in deliveries(items)} == {"engine"}
    finally:
        for pub in pubs:
            pub.close()


def test_topic_filter() -> None:
    with (
        Publisher("tcp://127.0.0.1:*", topic="kv") as pub,
        Subscriber(pub.endpoint, topic="other", policy=FAST) as other,
        Subscriber(pub.endpoint, topic="kv", policy=FAST) as mine,
    ):
        time.sleep(0.3)
        pub.publish(stored(1))
        assert seqs(collect(mine, lambda it: len(seqs(it)) >= 1, 5)) == [0]
        assert seqs(collect(other, lambda it: False, 0.3)) == []


def test_async_iteration() -> None:
    async def main(pub: Publisher) -> list[int]:
        got: list[int] = []
        with Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub:
            async for item in sub:
                if isinstance(item, Delivery):
                    got.append(item.seq)
                    if len(got) == 10:
                        break
        return got

    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub:
        for i in range(5):
            pub.publish(stored(i))

        async def both() -> list[int]:
            task = asyncio.create_task(main(pub))
            await asyncio.sleep(0.3)
            for i in range(5, 10):
                pub.publish(stored(i))
                await asyncio.sleep(0.01)
            return await asyncio.wait_for(task, 10)

        assert asyncio.run(both()) == list(range(10))


def test_delivery_unpacks_and_removed_events_decode() -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub:
        pub.publish([BlockRemoved([5, 6], medium="CPU")])
        with Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST) as sub:
            (delivery,) = deliveries(collect(sub, lambda it: len(seqs(it)) >= 1))
            instance, seq, batch = delivery
            assert (instance, seq) == ("vllm", 0)
            (event,) = batch.events
            assert isinstance(event, BlockRemoved) and event.block_hashes == [5, 6]
            assert event.medium == "CPU"
