"""`Fleet` membership under concurrency (issue 27, items 8-12 and the two read by eye):
instances added, removed and re-discovered on other threads while lookups and views run,
a worker that stopped, batches read for an instance its own read removed."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
import zmq
from netutil import free_ports

from kvindex.index import FleetIndex
from kvindex.runtime import Fleet, MembershipChange, UnknownInstance, WorkerUnavailable, ingest
from kvindex.subscriber import InstanceSpec, SourceKey, Status
from kvindex.wire import BlockStored, EventBatch
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(90)


def stored(i: int) -> list[BlockStored]:
    return [BlockStored([i], None, [i, i, i, i], 4)]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Changes:
    """A MembershipFeed as a shared store's Subscriber is one: changes made elsewhere."""

    def __init__(self) -> None:
        self.pending: list[MembershipChange] = []

    def membership_changes(self) -> list[MembershipChange]:
        taken, self.pending = self.pending, []
        return taken


def hammer(reads: list[Callable[[], object]], stop: threading.Event, errors: list[str]) -> None:
    while not stop.is_set():
        for read in reads:
            try:
                read()
            except Exception as exc:  # what the HTTP layer would answer 500 for
                errors.append(f"{type(exc).__name__}: {exc}")


def test_a_failed_delete_leaves_the_instance_whole_and_the_api_working() -> None:
    """Item 12: the owning worker stopped; DELETE says so (WorkerUnavailable: the service
    answers 503), and the instance stays followed: views, lookups and a second DELETE
    behave as before (it used to lose its owner: every view raised KeyError after)."""

    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
            fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
            await fleet.start()
            try:
                fleet._workers[0].stop()  # a worker that is gone (a bug would do it)
                for _ in range(2):
                    with pytest.raises(WorkerUnavailable):
                        fleet.remove_instance("a")
                    assert [v.spec.name for v in fleet.instance_views()] == ["a"]
                    assert fleet.status("a") in set(Status)
                    assert [r.name for r in fleet.lookup([1, 2, 3, 4]).instances] == ["a"]
                    fleet.lookup_json([1, 2, 3, 4])
            finally:
                await fleet.stop()

    asyncio.run(main())


def test_batches_read_for_an_instance_the_same_read_removed_are_not_applied() -> None:
    """Item 8: the feed removed the instance after the read that holds its batches; they
    are dropped, not applied to a gone instance (each was a KeyError and a traceback)."""
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        feed = Changes()
        fleet = Fleet(membership=feed)
        try:
            feed.pending = [MembershipChange("r", InstanceSpec("r", pub.endpoint))]
            fleet.step()
            wait_until(lambda: fleet.step() is not None and fleet.status("r") == Status.LIVE)
            for i in range(20):
                pub.publish(stored(i))
            sub = fleet.subscriber._sources[SourceKey("r")].sub
            wait_until(lambda: bool(sub.poll(0, zmq.POLLIN)))  # the next read takes them
            time.sleep(0.1)
            feed.pending = [MembershipChange("r", None)]
            assert fleet.step()
            assert not fleet.has_instance("r") and not fleet.index.instances()
            assert fleet.ingest.errors == 0
        finally:
            fleet.close()


def test_adds_removes_and_rediscoveries_while_lookups_and_views_run() -> None:
    """Items 9-11: one thread adds and removes instances, another re-discovers one on
    other ports (what `_swap` does for SGLang), while two threads read every view and
    lookup: no read fails (KeyError, UnknownInstance, 'dictionary changed size'...), and
    when it is over the fleet holds what was last added, nothing more."""
    base = free_ports(4)
    pubs = [Publisher(f"tcp://127.0.0.1:{base + i}") for i in range(4)]
    swap_specs = [InstanceSpec("s", pub.endpoint) for pub in pubs[:2]]
    churn = InstanceSpec("c", pubs[2].endpoint)
    fleet = Fleet([swap_specs[0], InstanceSpec("k", pubs[3].endpoint)], ingest_workers=2)
    stop = threading.Event()
    errors: list[str] = []
    hit_tokens = [7, 7, 7, 7]

    def churning() -> None:
        while not stop.is_set():
            fleet.add_instance(churn)
            fleet.remove_instance("c")

    def swapping() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            fleet._rediscovered(swap_specs[i % 2])

    def lookup_json() -> object:
        return fleet.lookup_json(hit_tokens)

    reads: list[Callable[[], object]] = [
        fleet.instance_views,
        fleet.summary,
        lookup_json,
        lambda: fleet.lookup(hit_tokens),
        lambda: fleet.lookup_hashes([7]),
        fleet.models,
    ]

    async def main() -> None:
        await fleet.start()
        threads = [
            threading.Thread(target=churning),
            threading.Thread(target=swapping),
            *(threading.Thread(target=hammer, args=(reads, stop, errors)) for _ in range(2)),
        ]
        try:
            for thread in threads:
                thread.start()
            await asyncio.sleep(4.0)
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
            await fleet.stop()

    try:
        asyncio.run(main())
    finally:
        for pub in pubs:
            pub.close()
    assert errors[:5] == []
    assert sorted(fleet.specs) == ["k", "s"]
    assert set(fleet.index.instances()) <= {"k", "s"}
    assert fleet.ingest.errors == 0


def test_counts_are_never_kept_from_before_a_batch() -> None:
    """By reading (`_counts_of`): counts computed before a batch, stored after the batch
    dropped the cache, would be shown until the instance changes again. Views read while
    batches arrive; once ingest is idle, the view must count every block. Idle: the
    worker's step that applied the last batch is over (a no-op run on its thread), not
    10 ms after the index holds it: C applies a batch during the read, the cache is
    dropped after it, and a loaded machine can keep the thread off the CPU in between
    (2 in 18 runs failed so; the C path's own drop, without the epoch, was the bug
    this found, 1 in 18)."""

    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
            fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
            await fleet.start()
            stop = threading.Event()
            errors: list[str] = []
            reader = threading.Thread(
                target=hammer, args=([lambda: fleet.instance_view("a")], stop, errors)
            )
            try:
                wait_until(lambda: fleet.status("a") == Status.LIVE)
                reader.start()
                for round_ in range(30):
                    for i in range(50):
                        pub.publish(stored(round_ * 50 + i))
                    want = (round_ + 1) * 50
                    wait_until(lambda want=want: fleet.index.block_count("a") == want)
                    fleet._workers[0].call(lambda: None)
                    assert fleet.instance_view("a").blocks == want
            finally:
                stop.set()
                reader.join(10)
                await fleet.stop()
            assert errors == []

    asyncio.run(main())


def test_a_worker_that_outlives_its_stop_keeps_its_wake_pipe() -> None:
    """By reading (`IngestWorker.stop`): a join that timed out closed the wake pipe the
    thread still polls (its fd number may then be another file's). Now it stays open
    until the thread is gone."""
    fleet = Fleet(idle_wait=0.5, ingest_workers=1)
    worker = fleet._workers[0]
    worker.start()
    wake_r, wake_w = worker._wake_r, worker._wake_w
    try:
        time.sleep(0.05)
        worker.stop(timeout=0)
        if worker.running:
            os.fstat(wake_r)
            os.fstat(wake_w)
    finally:
        worker.stop()
    assert not worker.running and worker.failure is None
    with pytest.raises(OSError):
        os.fstat(wake_r)


def test_remove_of_an_unknown_or_changing_name() -> None:
    fleet = Fleet()
    try:
        with pytest.raises(UnknownInstance):
            fleet.remove_instance("nope")
    finally:
        fleet.close()


def test_a_new_publisher_is_never_left_out_of_the_cached_layout() -> None:
    """Item 10: `_lay_out` built the layout from a snapshot outside the publishers' lock
    and stored it after a publisher registered meanwhile had cleared it: that publisher's
    row was missing from lookups until the next membership change. Lookups run on one
    thread while publishers join on another; each joined one must be in the layout."""
    index = FleetIndex()
    stop = threading.Event()

    def looking() -> None:
        while not stop.is_set():
            index.lookup([1, 2, 3, 4])  # item 5: never "empty rows do not match"

    thread = threading.Thread(target=looking)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: more interleavings
    thread.start()
    missing = []
    try:
        deadline = time.monotonic() + 5.0
        for i in range(1500):
            if time.monotonic() > deadline:
                break
            source = SourceKey(f"n{i}")
            index.apply(source, EventBatch(0.0, stored(i)), 0)
            if f"n{i}" not in {name for name, _ in index.layout()}:
                missing.append(i)
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(interval)
    assert missing == []


def test_a_remove_the_busy_worker_does_not_take_in_time_is_not_made_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A remove waits COMMAND_TIMEOUT for the owning worker (here 0.3 s; a hook holds the
    worker 1 s for real): it raises WorkerUnavailable (the service answers 503), the
    instance stays whole, and the command, cancelled, never runs afterwards."""
    monkeypatch.setattr(ingest, "COMMAND_TIMEOUT", 0.3)

    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
            fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
            busy = threading.Event()

            def slow(item: object) -> None:
                if busy.is_set():
                    busy.clear()
                    time.sleep(1.0)

            fleet.on_item.append(slow)
            await fleet.start()
            try:
                wait_until(lambda: fleet.status("a") == Status.LIVE)
                busy.set()
                pub.publish(stored(1))
                wait_until(lambda: not busy.is_set())  # the worker is in the hook now
                with pytest.raises(WorkerUnavailable):
                    fleet.remove_instance("a")
                assert fleet.has_instance("a") and fleet.instance_view("a").spec.name == "a"
                await asyncio.sleep(1.2)  # the hook is over: the worker reads again
                pub.publish(stored(2))
                wait_until(lambda: fleet.index.block_count("a") == 2)
                assert fleet.has_instance("a")
                fleet.remove_instance("a")  # now it answers
                assert not fleet.has_instance("a")
            finally:
                await fleet.stop()

    asyncio.run(main())
