"""The in-order path in C end to end: a real publisher on loopback, the compiled index, a
Fleet's ingest thread. Ordinary batches skip Python; the rest (batches lost on the wire
and replayed, a malformed message, a batch the fast parser leaves to the decoder, an
engine restart) goes back to the Python state machine, and the index ends exact either
way. With an item hook nothing goes through C; a store that persists every batch
(`Fleet.record_into`) takes the C path's batches in bulk.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq

from kvindex.index import COMPILED
from kvindex.runtime import Fleet
from kvindex.store.link import WorkerLink, WorkerStore
from kvindex.store.protocol import (
    AppliedBatch,
    AppliedBatches,
    LostMark,
    RestartMark,
    decode_frames,
)
from kvindex.subscriber import (
    Delivery,
    InstanceSpec,
    Item,
    Lost,
    ReplayPolicy,
    Restarted,
    SourceKey,
)
from kvindex.subscriber.inorder import available
from kvindex.wire import BlockRemoved, BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not (COMPILED and available()), reason="no compiled core or C receive"),
]

FAST = ReplayPolicy(first_reply_timeout=0.5, idle_timeout=0.3, deadline=5.0)
DROPPED = {50, 51, 120}  # lost on the wire: the replay brings them
SLOW = 99  # a token id past 32 bits: the Python decoder's


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


def publish_stream(pub: Publisher, first: int, count: int, truth: set[int]) -> None:
    for i in range(first, first + count):
        tokens = [i, i + 1, i + 2, 2**33 if i == SLOW else i + 3]
        events: list[BlockStored | BlockRemoved] = [BlockStored([i], None, tokens, 4)]
        truth.add(i)
        if i % 10 == 0 and i - 5 in truth:
            events.append(BlockRemoved([i - 5]))
            truth.discard(i - 5)
        pub.publish(events)


@pytest.mark.parametrize("hook", [False, True], ids=["memory", "item-hook"])
def test_c_path_exact_through_gaps_malformed_slow_batches_and_a_restart(hook: bool) -> None:
    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub:
            fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)], policy=FAST)
            seen: list[Item] = []
            if hook:
                fleet.on_item.append(seen.append)
            await fleet.start()
            try:
                pub.wait_for_subscriber()
                assert await until(lambda: fleet.status("a") == "live")
                source = fleet.subscriber.sources()[0]
                stats = fleet.source_stats(source)
                truth: set[int] = set()
                publish_stream(pub, 0, 1, truth)  # the first: Python's (a new publisher)
                assert await until(lambda: stats.delivered == 1)
                publish_stream(pub, 1, 99, truth)  # 1-98 in order, 99 the decoder's
                assert await until(lambda: stats.delivered == 100)
                assert fleet.ingest.batches_in_c == (0 if hook else 98)
                pub.send_raw([b"", b"\x00" * 8])  # two frames: malformed
                pub.drop = DROPPED.__contains__
                publish_stream(pub, 100, 100, truth)
                pub.drop = None
                publish_stream(pub, 200, 10, truth)
                assert await until(lambda: fleet.block_hashes("a") == truth)
                assert await until(lambda: stats.delivered == 210)
                assert (stats.lost_batches, stats.malformed_messages) == (0, 1)
                assert stats.replayed_batches >= 1  # 120 at least (50-51 may be held live)

                pub.restart()  # a new engine process: seq 0 again, other blocks
                fresh: set[int] = set()
                publish_stream(pub, 1000, 30, fresh)
                assert await until(lambda: fleet.block_hashes("a") == fresh)
                assert stats.publisher_restarts == 1
                if hook:
                    assert fleet.ingest.batches_in_c == 0
                    assert sum(1 for item in seen if type(item).__name__ == "Delivery") >= 240
                else:  # how many more after the gaps depends on how the reads fell
                    assert fleet.ingest.batches_in_c >= 98
                    assert fleet.ingest.gil_seconds > 0
                assert fleet.index.slow_batches >= 1  # type: ignore[attr-defined]
            finally:
                await fleet.stop()

    asyncio.run(main())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_c_and_python_paths_follow_a_random_stream_to_the_same_exact_state(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Fleets follow one publisher, one with the C path and one without
    (KVINDEX_C_INGEST=0), through a seeded mix of in-order runs, batches lost on the wire
    (replayed), malformed messages, batches the fast parser leaves to the decoder and
    engine restarts; after each step both hold exactly what the publisher's engine does,
    with nothing lost."""
    rng = random.Random(seed)

    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub:
            spec = InstanceSpec("a", pub.endpoint, pub.replay_endpoint)
            fleets = []
            for flag in ("1", "0"):
                monkeypatch.setenv("KVINDEX_C_INGEST", flag)
                fleets.append(Fleet([spec], policy=FAST))
            for fleet in fleets:
                await fleet.start()
            try:
                await _random_steps(rng, pub, fleets)
                c_path, python_path = fleets
                assert c_path.ingest.batches_in_c > 0 and python_path.ingest.batches_in_c == 0
            finally:
                for fleet in fleets:
                    await fleet.stop()

    asyncio.run(main())


async def _random_steps(rng: random.Random, pub: Publisher, fleets: list[Fleet]) -> None:
    for _ in range(2):  # a subscription per Fleet: none may miss the first batches
        pub.wait_for_subscriber()
    for fleet in fleets:
        assert await until(lambda f=fleet: f.status("a") == "live")
    truth: set[int] = set()
    base = 0
    for _step in range(25):
        kind = rng.choice(["run", "run", "drop", "malformed", "slow", "restart"])
        if kind == "restart":
            pub.restart()
            truth = set()
        elif kind == "malformed":
            pub.send_raw([b"", b"\x00" * 8])
        if kind == "drop":
            lost = pub.next_seq + rng.randrange(3)
            pub.drop = lost.__eq__
        count = rng.randrange(1, 40)
        for i in range(base, base + count):
            slow = kind == "slow" and i == base + count // 2
            tokens = [i, i + 1, i + 2, 2**33 if slow else i + 3]
            events: list[BlockStored | BlockRemoved] = [BlockStored([i], None, tokens, 4)]
            truth.add(i)
            if truth and rng.random() < 0.3:
                gone = rng.choice(sorted(truth))
                events.append(BlockRemoved([gone]))
                truth.discard(gone)
            pub.publish(events)
        pub.drop = None
        base += count
        for fleet in fleets:
            assert await until(lambda f=fleet, t=truth: f.block_hashes("a") == t), kind
    assert pub.dropped > 0  # the replay was tried (every seed here drops some)
    for fleet in fleets:
        source = fleet.subscriber.sources()[0]
        stats = fleet.source_stats(source)
        assert stats.lost_batches == 0 and stats.replayed_batches > 0
        assert stats.malformed_messages > 0 and stats.publisher_restarts > 0


def test_a_closed_subscriber_lets_go_of_its_c_sequencers() -> None:
    """serve freezes its objects (gc.freeze): a Subscriber lives to the process's end, and
    each closed publisher's C Sequencer (its digest ring) with it, a leak LeakSanitizer
    reported at exit. Closing a publisher now drops its Sequencer, whose state Python
    has taken back first."""

    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
            fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
            await fleet.start()
            try:
                assert await until(lambda: fleet.status("a").value == "live")
                # The first read of the link goes to Python, and a loaded machine's timing
                # may give Python more: rounds until some batches went through C.
                for round_ in range(50):
                    for i in range(round_ * 10, round_ * 10 + 10):
                        pub.publish([BlockStored([i], None, [i, i + 1, i + 2, i + 3], 4)])
                    want = round_ * 10 + 10
                    assert await until(lambda want=want: fleet.index.block_count("a") == want)
                    if round_ >= 3 and fleet._workers[0].counters.batches_in_c > 0:
                        break
                assert fleet._workers[0].counters.batches_in_c > 0
                subscriber = fleet._workers[0].subscriber
                (src,) = subscriber._sources.values()
                assert src.inorder is not None
                sequencer = src.inorder.sequencer
                held = sys.getrefcount(sequencer)
                where = subscriber.checkpoint(src.spec.source)
            finally:
                await fleet.stop()
            assert sys.getrefcount(sequencer) == held - 1
            assert src.inorder is None
            assert subscriber.checkpoint(src.spec.source) == where  # handed back whole

    asyncio.run(main())


Entry = tuple[object, ...]


class _Log:
    """A persistent store's view of what the index applied, as `Fleet.record_into` hands
    it: every batch (seq, payload) in order, restarts and lost ranges between them. The C
    path's packed payloads are kept as they came (a read-only view of the C receive's
    buffer, which is then the view's own) and read only at the end, after the Fleet and its
    Sequencers are gone: a buffer the C side reused or freed would show here."""

    def __init__(self) -> None:
        self._entries: list[Entry | tuple[int, int, bytes | memoryview]] = []
        self.in_bulk = 0  # batches that came through record_batches

    def record(self, item: Item) -> None:
        if isinstance(item, Delivery):
            self._entries.append(("b", item.seq, item.payload))
        elif isinstance(item, Restarted):
            self._entries.append(("r",))
        elif isinstance(item, Lost):
            self._entries.append(("l", item.first, item.last))

    def record_batches(
        self, source: SourceKey, first_seq: int, count: int, packed: bytes | memoryview
    ) -> None:
        assert isinstance(packed, memoryview) and packed.readonly  # the C buffer, not a copy
        self.in_bulk += count
        self._entries.append((first_seq, count, packed))

    @property
    def entries(self) -> list[Entry]:
        out: list[Entry] = []
        for entry in self._entries:
            if isinstance(entry[0], str):
                out.append(entry)
                continue
            first_seq, count, packed = entry
            payloads = msgspec.msgpack.decode(packed, type=list[bytes])  # type: ignore[call-overload]
            assert len(payloads) == count
            out.extend(("b", seq, payload) for seq, payload in enumerate(payloads, first_seq))
        return out


class _LinkLog(WorkerStore):
    """What a store's worker process is handed over the real link (`WorkerLink`: groups
    in frames, the C path's payloads each a frame of its own, sent zero-copy whatever
    their size here), read as a worker reads it (`decode_frames`), as a log."""

    def __init__(self) -> None:
        self._link = WorkerLink("the test worker")
        base = self._link.open()
        self._link.sockets["in"].copy_threshold = 0  # every frame zero-copy, small ones too
        self.worker = zmq.Context.instance().socket(zmq.PULL)
        self.worker.setsockopt(zmq.RCVHWM, 0)
        self.worker.connect(f"{base}/in")
        self.messages: list[object] = []
        self.multipart = 0  # groups that came in several frames

    @property
    def url(self) -> str:
        return "test://"

    def receive(self) -> None:
        """Everything the link has sent or still holds, as the worker gets it."""
        link = self._link
        while True:
            with link._lock:
                link._send_waiting()
            if not self.worker.poll(300):
                if link._sent == link._next_id - 1:
                    return
                continue
            frames = self.worker.recv_multipart(copy=False)
            self.multipart += len(frames) > 1
            self.messages.extend(decode_frames([f.buffer for f in frames]).messages)

    @property
    def entries(self) -> list[Entry]:
        out: list[Entry] = []
        for m in self.messages:
            if isinstance(m, AppliedBatch):
                out.append(("b", m.seq, m.payload))
            elif isinstance(m, AppliedBatches):
                out.extend(("b", seq, p) for seq, p in enumerate(m.payloads, m.first_seq))
            elif isinstance(m, RestartMark):
                out.append(("r",))
            elif isinstance(m, LostMark):
                out.append(("l", m.first, m.last))
        return out

    def close(self, timeout: float = 1.0) -> None:
        self.worker.close(linger=0)
        self._link.close(timeout)


@pytest.mark.parametrize("via", ["hook", "link"])
@pytest.mark.parametrize("seed", [4, 5])
def test_a_store_logs_every_batch_with_the_c_path_on_as_with_python(
    seed: int, via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A persistent store (`record_into`) no longer keeps every batch on the Python path:
    the C path applies the ordinary ones and hands their payloads over in bulk, once per
    read, in the very buffer C kept them in. Through gaps and replays, malformed messages,
    decoder batches and restarts, the store sees exactly what it sees with every batch in
    Python: each batch once, in order, as the publisher sent it, with the restarts where
    they were; `hook`: as the store's hooks are handed it; `link`: as a store's worker
    process receives it over the link (the C path's buffers sent as frames of their own)."""
    rng = random.Random(seed)

    async def main() -> None:
        with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub:
            spec = InstanceSpec("a", pub.endpoint, pub.replay_endpoint)
            fleets: list[Fleet] = []
            logs: list[_Log | _LinkLog] = []
            try:
                for flag in ("1", "0"):
                    monkeypatch.setenv("KVINDEX_C_INGEST", flag)
                    fleet = Fleet([spec], policy=FAST)
                    log = _Log() if via == "hook" else _LinkLog()
                    fleets.append(fleet)
                    logs.append(log)
                    fleet.record_into(log.record, log.record_batches)
                    if isinstance(log, _LinkLog):
                        fleet.on_read.append(log.flush)
                for fleet in fleets:
                    await fleet.start()
                try:
                    await _random_steps(rng, pub, fleets)
                finally:
                    for fleet in fleets:
                        await fleet.stop()
                c_path, python_path = fleets
                assert c_path.ingest.batches_in_c > 0 and python_path.ingest.batches_in_c == 0
                fleets.clear()  # the Fleets, their Sequencers and their buffers' old owner go
                del c_path, python_path, fleet
                for log in logs:
                    if isinstance(log, _LinkLog):
                        log.flush()
                        log.receive()
                if isinstance(logs[0], _Log) and isinstance(logs[1], _Log):
                    assert logs[0].in_bulk > 0 and logs[1].in_bulk == 0
                else:
                    assert isinstance(logs[0], _LinkLog) and isinstance(logs[1], _LinkLog)
                    assert logs[0].multipart > 0 and logs[1].multipart == 0
                assert logs[0].entries == logs[1].entries
                assert sum(e[0] == "b" for e in logs[0].entries) > 100
            finally:
                for log in logs:
                    if isinstance(log, _LinkLog):
                        log.close()

    asyncio.run(main())
