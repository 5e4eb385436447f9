"""`Fleet`: ingest interleaves with other tasks, wakes on new sockets, feeds hooks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from netutil import free_ports

from kvindex.runtime import DuplicateInstance, Fleet, UnknownInstance
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
            backlog_seen: list[int] = []

            async def ticker() -> None:
                while True:
                    backlog_seen.append(fleet.backlog)
                    await asyncio.sleep(0)

            await fleet.start()
            tick = asyncio.create_task(ticker())
            try:
                assert await until(lambda: fleet.index.block_count("a") == 3000)
            finally:
                tick.cancel()
                await fleet.stop()
            # Other tasks ran while read items were still waiting to be applied.
            assert max(backlog_seen) > 0
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
                assert await until(lambda: fleet.index.block_count("a") == 50)
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
