"""`Fleet`: ingest interleaves with other tasks, wakes on new sockets, feeds hooks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from netutil import free_ports

from kvindex.runtime import DuplicateInstance, Fleet, MembershipChange, UnknownInstance
from kvindex.subscriber import Delivery, InstanceSpec, Item, Status
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)


def stored(i: int) -> list[BlockStored]:
    return [BlockStored([i], None, [i, i, i, i], 4)]


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.005)
    return predicate()


def test_ingest_yields_to_other_tasks_in_the_middle_of_a_burst() -> None:
    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
            for i in range(3000):
                pub.publish(stored(i))  # buffered: the late join replays them in one burst
            fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
            counts_seen: list[int] = []

            async def ticker() -> None:
                while True:
                    counts_seen.append(fleet.index.block_count("a"))
                    await asyncio.sleep(0)

            await fleet.start()
            tick = asyncio.create_task(ticker())
            try:
                assert await until(lambda: fleet.index.block_count("a") == 3000)
            finally:
                tick.cancel()
                await fleet.stop()
            # Other tasks ran in the middle of the burst: some tick saw part of it applied.
            # (Not `backlog` > 0, items read and not applied yet: the ingest thread drops
            # the GIL in each poll, before its items are read, and applies a slice within
            # the 5 ms it then holds it; a tick landed mid-slice only by chance, in 5 of 6
            # runs it did not with KVINDEX_PURE=1.)
            assert any(0 < n < 3000 for n in counts_seen), sorted(set(counts_seen))[:10]
            assert fleet.ingest.slices > 3

    asyncio.run(main())


def test_hooks_see_every_item_and_a_failing_hook_does_not_stop_ingest() -> None:
    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
            fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
            seen: list[Item] = []
            removed: list[str] = []

            def broken(item: Item) -> None:
                raise RuntimeError("store is down")

            fleet.on_item += [broken, seen.append]
            fleet.on_remove.append(removed.append)
            await fleet.start()
            try:
                assert await until(lambda: fleet.status("a") == Status.LIVE)
                for i in range(50):
                    pub.publish(stored(i))

                def delivered() -> int:  # the hooks run just after the index applied
                    return sum(isinstance(i, Delivery) for i in seen)

                assert await until(lambda: fleet.index.block_count("a") == 50)
                assert await until(lambda: delivered() == 50)
                seqs = [i.seq for i in seen if isinstance(i, Delivery)]
                assert seqs == list(range(50))
                assert fleet.ingest.hook_errors >= 50 and fleet.running
                fleet.remove_instance("a")
                assert removed == ["a"]
            finally:
                await fleet.stop()

    asyncio.run(main())


def test_new_instances_are_followed_at_once_even_while_ingest_sleeps() -> None:
    """A long idle wait must be cut short by membership changes, and sockets closed by a
    removal must not leave a stale registration that silences later sockets."""

    async def main() -> None:
        fleet = Fleet(idle_wait=30.0)
        await fleet.start()
        try:
            for round_ in range(4):
                with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
                    await asyncio.sleep(0.05)  # ingest is asleep now
                    fleet.add_instance(InstanceSpec("x", pub.endpoint, pub.replay_endpoint))
                    assert await until(lambda: fleet.status("x") == Status.LIVE, 5)
                    start = time.monotonic()
                    pub.publish(stored(round_))
                    assert await until(lambda: fleet.index.block_count("x") == 1, 5)
                    assert time.monotonic() - start < 2.0
                    fleet.remove_instance("x")
                    assert not fleet.index.instances()
        finally:
            await fleet.stop()

    asyncio.run(main())


def test_membership_errors_and_worst_rank_status() -> None:
    base = free_ports(2)
    with Publisher(f"tcp://127.0.0.1:{base}"):
        fleet = Fleet([InstanceSpec("d", f"tcp://127.0.0.1:{base}", dp=2)])
        try:
            with pytest.raises(DuplicateInstance):
                fleet.add_instance(InstanceSpec("d", "tcp://127.0.0.1:1"))
            with pytest.raises(UnknownInstance):
                fleet.remove_instance("nope")
            deadline = time.monotonic() + 5
            while fleet.subscriber.status(fleet.subscriber.sources()[0]) != Status.LIVE:
                fleet.step()
                assert time.monotonic() < deadline
                time.sleep(0.01)
            view = fleet.instance_view("d")
            assert [r.status for r in view.ranks][1] == Status.CONNECTING
            assert view.status == Status.CONNECTING  # the worst of its ranks
        finally:
            fleet.close()


class Changes:
    """A MembershipFeed as a shared store's Subscriber is one: changes made elsewhere."""

    def __init__(self) -> None:
        self.pending: list[MembershipChange] = []

    def membership_changes(self) -> list[MembershipChange]:
        taken, self.pending = self.pending, []
        return taken


def test_changes_made_elsewhere_are_followed_without_echoing_them() -> None:
    """Instances another replica adds or removes are followed at the next read; the hooks
    (the store, which would write them back) never see them; a repeated change is a no-op."""
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        feed = Changes()
        fleet = Fleet(membership=feed)
        added: list[InstanceSpec] = []
        removed: list[str] = []
        fleet.on_add.append(added.append)
        fleet.on_remove.append(removed.append)
        spec = InstanceSpec("r", pub.endpoint, pub.replay_endpoint)
        try:
            feed.pending = [MembershipChange("r", spec), MembershipChange("r", spec)]
            fleet.step()
            assert fleet.has_instance("r") and not feed.pending
            deadline = time.monotonic() + 5
            while fleet.status("r") != Status.LIVE:
                fleet.step()
                assert time.monotonic() < deadline
                time.sleep(0.01)
            pub.publish(stored(1))
            while fleet.index.block_count("r") != 1:
                fleet.step()
                assert time.monotonic() < deadline
                time.sleep(0.01)
            feed.pending = [MembershipChange("r", None), MembershipChange("r", None)]
            fleet.step()
            assert not fleet.has_instance("r") and not fleet.index.instances()
            assert added == [] and removed == []
        finally:
            fleet.close()


def test_lookup_answers_every_instance_best_first_ties_by_name() -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        fleet = Fleet(
            [InstanceSpec("b", pub.endpoint, pub.replay_endpoint), InstanceSpec("a", pub.endpoint)]
        )
        try:
            deadline = time.monotonic() + 5
            while fleet.status("b") != Status.LIVE:
                fleet.step()
                assert time.monotonic() < deadline
                time.sleep(0.01)
            pub.publish(stored(7))
            while fleet.index.block_count("b") != 1 or fleet.index.block_count("a") != 1:
                fleet.step()
                assert time.monotonic() < deadline
                time.sleep(0.01)
            answer = fleet.lookup([7, 7, 7, 7, 8])
            assert answer.hit and answer.best == "a"  # a tie: by name
            assert [(r.name, r.matched_blocks, r.matched_tokens) for r in answer.instances] == [
                ("a", 1, 4),
                ("b", 1, 4),
            ]
            miss = fleet.lookup_hashes([99])
            assert not miss.hit and miss.best is None
            assert [(r.matched_tokens, r.block_size) for r in miss.instances] == [(None, None)] * 2
        finally:
            fleet.close()


def test_instances_are_split_between_ingest_workers() -> None:
    """Two workers share the instances; each ingests its own, and a lookup sees both."""

    async def run() -> None:
        pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
        try:
            specs = [
                InstanceSpec(f"w{i}", p.endpoint, p.replay_endpoint) for i, p in enumerate(pubs)
            ]
            fleet = Fleet(specs, ingest_workers=2)
            assert fleet.workers == 2
            assert {w.subscriber.sources()[0].instance for w in fleet._workers} == {"w0", "w1"}
            await fleet.start()
            try:
                tokens = list(range(32))
                for i, pub in enumerate(pubs):
                    await asyncio.sleep(0.3)  # the SUB sockets connect
                    pub.publish([BlockStored([1000 + i, 2000 + i], None, tokens, 16)])
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    answer = fleet.lookup(tokens)
                    if all(r.matched_blocks == 2 for r in answer.instances):
                        break
                    await asyncio.sleep(0.05)
                assert [r.matched_blocks for r in fleet.lookup(tokens).instances] == [2, 2]
                assert fleet.ingest.deliveries >= 2
            finally:
                await fleet.stop()
        finally:
            for pub in pubs:
                pub.close()

    asyncio.run(run())
