"""The Redis store against a real redis-server: what it appends, compacts and loads back
equals the index it mirrors; appends are idempotent by seq; its URL and its errors."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store_sqlite import (
    B0,
    B1,
    BS,
    PROMPTS,
    A,
    apply_rich,
    chain_hash,
    ops,
    rich_ops,
    same_pools,
    same_state,
)

from kvindex.index import FleetIndex
from kvindex.runtime import MembershipChange
from kvindex.store import StoreError, open_store
from kvindex.store.base import LoadResult
from kvindex.store.mirror import Mirror
from kvindex.store.redis import RedisStore, current_rows
from kvindex.store.redis.append import Appender
from kvindex.store.redis.compact import Compactor
from kvindex.store.redis.feed import SharedSubscriber
from kvindex.store.redis.layout import (
    STATUS,
    ZERO,
    IngestPolicy,
    RedisConfig,
    cp_key,
    decode_rows,
    log_key,
    pack,
    row_field,
    row_value,
    snap_key,
    snapshot_format,
    tag,
)
from kvindex.store.redis.reader import SharedLogReader
from kvindex.store.redis.worker import register_instance, restore_checkpoint
from kvindex.store.rows import BlockRow
from kvindex.subscriber import Delivery, InstanceSpec, Restarted, SourceKey
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvindex.wire.publisher import Publisher, encode_batch

SPECS = {"a": "a=tcp://127.0.0.1:1", "b": "b=tcp://127.0.0.1:3,dp=2"}


class Harness:
    """The worker's parts in process (the same code as the worker) and a reference."""

    def __init__(self, url: str, specs: dict[str, str] = SPECS) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.client.flushdb()
        for name, spec in specs.items():
            register_instance(self.client, name, spec, "harness")
        self.mirror = Mirror()
        self.reader = SharedLogReader(self.mirror, IngestPolicy(), lambda frames: None)
        self.reader.load(self.client, {}, ZERO)
        self.appender = Appender(1_000_000, self.reader.spec, fill_timeout=1.0)
        self.compactor = Compactor(self.mirror, self.reader.cursors, 1e9)
        self.reference = FleetIndex()
        self.seqs: dict[SourceKey, int] = {}

    def batch(self, source: SourceKey, *events: Any) -> None:
        payload = encode_batch(list(events))
        seq = self.seqs.get(source, 0)
        self.seqs[source] = seq + 1
        self.reference.handle(Delivery(source, seq, decode_batch(payload)))
        self.appender.batch(source, seq, payload)

    def restart(self, source: SourceKey) -> None:
        self.seqs[source] = 0
        self.reference.handle(Restarted(source))
        self.appender.restart(source)

    def compact(self) -> None:
        self.appender.flush(self.client)
        while self.reader.step(self.client, None):
            pass
        self.compactor.compact(self.client)

    def reload(self) -> tuple[FleetIndex, LoadResult]:
        self.appender.flush(self.client)
        index = FleetIndex()
        return index, RedisStore(self.url).load(index)

    def entries(self, source: SourceKey) -> list[bytes]:
        return [f[b"k"] for _, f in self.client.xrange(log_key(source))]


@pytest.fixture
def server(module_redis_server: Any) -> Any:
    return module_redis_server


def store_event(prompt: list[int], n: int, lora: str | None, medium: str) -> BlockStored:
    last = min(n, len(prompt) // BS)
    hashes = [chain_hash(prompt, i, lora) for i in range(last)]
    extra = [[lora]] * last if lora else None
    return BlockStored(
        hashes, None, prompt[: last * BS], BS, medium=medium, lora_name=lora, extra_keys=extra
    )


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops)
def test_snapshot_plus_log_loads_back_exactly(server: Any, plan: list[Any]) -> None:
    h = Harness(server.url)
    for kind, source, p, n, lora, medium in plan:
        prompt = PROMPTS[p]
        if kind == "store":
            h.batch(source, store_event(prompt, n, lora, medium))
        elif kind == "remove":
            h.batch(source, BlockRemoved([chain_hash(prompt, n % 2, lora)], medium=medium))
        elif kind == "clear":
            h.batch(source, AllBlocksCleared())
        elif kind == "restart":
            h.restart(source)
        else:
            h.compact()
    loaded, _ = h.reload()  # snapshot + log tail, as after a crash
    same_state(loaded, h.reference, PROMPTS)
    rows, _ = current_rows(server.url)  # what `kvindex export` reads
    assert sum(r.copies for r in rows) == sum(
        n for s in (A, B0, B1) for pool in h.reference.copies(s).values() for n in pool.values()
    )
    h.compact()
    loaded, result = h.reload()  # snapshot only
    same_state(loaded, h.reference, PROMPTS)
    assert result.log_batches_replayed == 0


def test_a_reader_the_failover_left_ahead_reloads_from_the_snapshot(server: Any) -> None:
    """A failover loses log entries a serving replica had read (asynchronous
    replication); the ingesting replica, further on, writes its snapshot back (Worker._refill)
    and appends go on from there. The serving replica's next entry then skips seqs it
    never read: it must reload from the snapshot, not apply the rest over what it holds
    (it kept a block removed in the lost entries, and missed one stored: the sentinel
    failover test's rare `assert_same(server)` failure)."""
    h = Harness(server.url, {"a": SPECS["a"]})
    frames: list[list[bytes]] = []
    serving = SharedLogReader(Mirror(), IngestPolicy.parse("none"), frames.append)
    serving.load(h.client, {A: ZERO}, ZERO)

    def held(mirror: Mirror) -> set[int]:
        return {h for pool in mirror.copies(A).values() for h in pool}

    def store(block: int) -> BlockStored:
        return BlockStored([block], None, [block] * BS, BS)

    def read(reader: SharedLogReader) -> None:
        while reader.step(h.client, None):
            pass

    for block in (0, 1, 2, 3, 4):
        h.batch(A, store(block))  # seqs 0-4
    h.batch(A, BlockRemoved([0]))  # seq 5
    h.appender.flush(h.client)
    read(serving)  # the serving replica stands at seq 6
    h.batch(A, BlockRemoved([3]))  # seq 6
    h.batch(A, store(7))  # seq 7
    h.appender.flush(h.client)
    read(h.reader)  # the ingesting replica's mirror at seq 8
    # The failover: the new primary had seqs 0-2 only.
    lost = [i for i, f in h.client.xrange(log_key(A)) if int(f[b"s"]) > 2]
    h.client.xdel(log_key(A), *lost)
    h.client.hset(cp_key(A), mapping={"n": "3", "d": "", "l": "0"})
    # The ingesting replica writes back what it holds, and appends go on.
    assert h.compactor.rewrite(h.client, [A]) == [A]
    restore_checkpoint(h.client, A, h.reader.cursors[A])
    h.batch(A, store(8))  # seq 8
    h.batch(A, BlockRemoved([4]))  # seq 9
    h.appender.flush(h.client)
    truth = h.reference.block_hashes("a")
    assert truth == {1, 2, 7, 8}
    read(serving)
    assert held(serving.mirror) == truth
    assert serving.cursors[A].next_seq == 10
    assert serving.stats.resyncs == 1
    assert any(msgspec.msgpack.decode(f[0])[0] == "z" for f in frames)  # the service too


def test_a_batch_logged_again_over_its_snapshot_is_not_applied_twice(server: Any) -> None:
    """The failover lost seq 7; the ingesting replica's appender logs it again (new id)
    before its refill writes back the snapshot that holds it already (at seq 8, the old
    id of 7: an older position than the new entry's). Every reader of snapshot + tail
    (a replica reloading, a replica starting, `RedisStore.load`) met seq 7 twice: its
    block held twice, one removal left it held (the Sentinel failover test's snapshot
    with 2 blocks too many, written from such a mirror)."""
    h = Harness(server.url, {"a": SPECS["a"]})
    serving = SharedLogReader(Mirror(), IngestPolicy.parse("none"), lambda frames: None)
    serving.load(h.client, {A: ZERO}, ZERO)
    for block in range(8):
        h.batch(A, BlockStored([block], None, [block] * BS, BS))  # seqs 0-7
    h.appender.flush(h.client)
    while serving.step(h.client, None):
        pass
    while h.reader.step(h.client, None):
        pass
    # The failover: the new primary had seqs 0-6. The appender logs 7 again at once.
    logged = {int(f[b"s"]): (i, f[b"p"]) for i, f in h.client.xrange(log_key(A))}
    h.client.xdel(log_key(A), logged[7][0])
    digest = str(zlib.crc32(logged[6][1]))
    h.client.hset(cp_key(A), mapping={"n": "7", "d": digest, "l": "0"})
    again = Appender(1000, h.reader.spec)
    again.mine[A] = (7, digest)
    again.batch(A, 7, logged[7][1])
    again.flush(h.client)
    assert h.compactor.rewrite(h.client, [A]) == [A]  # the snapshot at seq 8
    h.batch(A, BlockRemoved([7]))  # seq 8
    h.appender.flush(h.client)
    truth = h.reference.block_hashes("a")
    assert 7 not in truth
    index, result = h.reload()
    assert index.block_hashes("a") == truth
    assert result.checkpoints[A].next_seq == 9
    fresh = SharedLogReader(Mirror(), IngestPolicy.parse("none"), lambda frames: None)
    fresh.load(h.client, {A: ZERO}, ZERO)  # a replica starting now
    for reader in (serving, fresh):
        while reader.step(h.client, None):
            pass
        held = {b for pool in reader.mirror.copies(A).values() for b in pool}
        assert held == truth
        assert reader.cursors[A].next_seq == 9


def test_gaps_of_one_publisher_in_one_pipeline_are_filled_not_lost(server: Any) -> None:
    """After an outage the queue holds a publisher's batches past a gap, more than one run
    (RUN items) of them: every run in the pipeline meets the gap. The first fill brings
    the log to the gap's end; the later runs' fills took the log's seq from the stale reply
    and its digest from now, failed the replay's check and logged the publisher's real
    batches as lost (the Sentinel failover test's incomplete store)."""
    pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=10_000)
    try:
        spec = f"p={pub.endpoint},replay={pub.replay_endpoint}"
        h = Harness(server.url, {"p": spec})
        h.reader.specs["p"] = spec  # where the Appender finds the replay endpoint
        source = SourceKey("p")
        payloads = [encode_batch([BlockStored([i], None, [i] * BS, BS)]) for i in range(700)]
        for payload in payloads:
            pub.publish_payload(payload)
        for seq in range(10):
            h.appender.batch(source, seq, payloads[seq])
        h.appender.flush(h.client)
        for seq in range(30, 700):  # 10-29 never reached this replica's queue
            h.appender.batch(source, seq, payloads[seq])
        live = threading.Event()

        def publish_live() -> None:  # a replay starts from what the live stream says
            while not live.wait(0.01):
                pub.publish_payload(encode_batch([BlockStored([7], None, [7] * BS, BS)]))

        feeder = threading.Thread(target=publish_live)
        feeder.start()
        try:
            h.appender.fill_timeout = 10.0
            while not h.appender.flush(h.client):
                pass
        finally:
            live.set()
            feeder.join()
        entries = [f for _, f in h.client.xrange(log_key(source))]
        assert [(f[b"k"], int(f.get(b"s", -1))) for f in entries] == [(b"b", i) for i in range(700)]
        assert h.client.hgetall(cp_key(source))[b"l"] == b"0"
        assert h.appender.stats.lost == 0
    finally:
        pub.close()


def test_appends_are_idempotent_by_seq(server: Any) -> None:
    """Two replicas ingest one publisher, which restarts; the second lags a whole stream
    behind: each batch and the restart are logged once, and none of the old stream's
    batches is taken for the new one's."""
    h = Harness(server.url)
    old = [encode_batch([BlockStored([i], None, [i] * BS, BS)], ts=1.0) for i in range(5)]
    new = [encode_batch([BlockStored([i], None, [i] * BS, BS)], ts=2.0) for i in range(2)]
    second = Appender(1000, h.reader.spec)
    for appender in (h.appender, second):
        for seq, payload in enumerate(old):
            appender.batch(A, seq, payload)
        appender.restart(A)
        appender.batch(A, 0, new[0])
        appender.flush(h.client)
    second.batch(A, 1, new[1])
    second.flush(h.client)
    assert h.entries(A) == [b"b"] * 5 + [b"r", b"b", b"b"]
    assert h.client.hget(cp_key(A), "n") == b"2"
    assert second.stats.conflicts == 4


def test_a_replica_that_lost_a_range_does_not_hide_another_replicas_batches(
    server: Any,
) -> None:
    """Item 16: two replicas ingest one publisher; the first lost seqs 1..3 (its SUB
    dropped them, the replay could not bring them), the second has them. The first's
    lost mark, logged first, won: the second's real batches were skipped as duplicates,
    the log said `lost` for batches one replica holds. Now a lost range waits a moment
    (LOST_HOLD) and the real batches logged meanwhile win; the mark then covers nothing."""
    h = Harness(server.url)
    payloads = [encode_batch([BlockStored([i], None, [i] * BS, BS)]) for i in range(5)]
    first = h.appender
    first.lost_hold = 0.5
    first.batch(A, 0, payloads[0])
    first.lost(A, 1, 3)
    first.batch(A, 4, payloads[4])
    assert not first.flush(h.client)  # the lost range and what follows it wait
    assert h.entries(A) == [b"b"]
    second = Appender(1000, h.reader.spec)
    for seq, payload in enumerate(payloads):
        second.batch(A, seq, payload)
    second.flush(h.client)
    time.sleep(0.6)
    assert first.flush(h.client)
    assert h.entries(A) == [b"b"] * 5
    assert h.client.hget(cp_key(A), "l") == b"0"


def test_a_range_nobody_has_is_logged_lost_after_the_hold(server: Any) -> None:
    h = Harness(server.url)
    h.appender.lost_hold = 0.2
    h.appender.batch(A, 0, encode_batch([BlockStored([0], None, [0] * BS, BS)]))
    h.appender.lost(A, 1, 3)
    h.appender.batch(A, 4, encode_batch([BlockStored([4], None, [4] * BS, BS)]))
    h.appender.flush(h.client)
    held = h.appender.held_for()
    assert held is not None and 0 < held <= 0.2
    time.sleep(0.25)
    assert h.appender.flush(h.client)
    assert h.entries(A) == [b"b", b"l", b"b"]
    assert h.client.hget(cp_key(A), "l") == b"3"


def test_gap_without_replay_is_logged_as_lost(server: Any) -> None:
    h = Harness(server.url)
    h.batch(A, BlockStored([1], None, [1] * BS, BS))
    h.appender.flush(h.client)
    h.appender.batch(A, 5, encode_batch([BlockStored([2], None, [2] * BS, BS)]))
    h.appender.flush(h.client)  # seqs 1..4 never reached the store: no replay to ask
    assert h.entries(A) == [b"b", b"l", b"b"]
    _, result = h.reload()
    assert result.checkpoints[A] == (6, result.checkpoints[A].last_digest, 4)


def test_nothing_is_appended_for_an_unregistered_instance(server: Any) -> None:
    h = Harness(server.url, {"a": SPECS["a"]})
    h.batch(SourceKey("ghost"), BlockStored([1], None, [1] * BS, BS))
    h.appender.flush(h.client)
    assert h.appender.stats.unregistered == 1
    assert h.entries(SourceKey("ghost")) == []


def test_redis_that_forgot_a_registered_instance_is_said_loudly_once(
    server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis restarted empty or flushed: every append is refused as unregistered. That
    was silent; it is one ERROR per instance (until its appends land again)."""
    h = Harness(server.url, {"a": SPECS["a"]})
    reader = SharedLogReader(Mirror(), IngestPolicy(), lambda frames: None)
    reader.load(h.client, {A: ZERO}, ZERO)  # as a worker's: it knows `a` is registered
    h.appender.spec_of = reader.spec
    h.batch(A, BlockStored([1], None, [1] * BS, BS))
    h.appender.flush(h.client)
    h.client.flushdb()  # what a restart without persistence leaves
    with caplog.at_level(logging.WARNING, logger="kvindex.store.redis"):
        for i in range(3):
            h.batch(A, BlockStored([2 + i], None, [2 + i] * BS, BS))
            h.appender.flush(h.client)
    said = [r for r in caplog.records if "does not know instance 'a'" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert h.appender.stats.unregistered == 3


def test_a_spec_with_fewer_ranks_drops_the_keys_of_the_ranks_gone(server: Any) -> None:
    """Item 15: `b` had two DP ranks; registered again with one, rank 1's checkpoint, log,
    snapshot and status go (they were left behind for good); rank 0's stay."""
    h = Harness(server.url)
    b0, b1 = SourceKey("b", 0), SourceKey("b", 1)
    for source in (b0, b1):
        h.batch(source, BlockStored([7], None, [7] * BS, BS))
    h.compact()
    h.client.hset(STATUS, mapping={tag(b0): b"x", tag(b1): b"x"})
    gone = [cp_key(b1), log_key(b1), snap_key(b1)]
    assert all(h.client.exists(key) for key in gone)
    dropped = register_instance(h.client, "b", "b=tcp://127.0.0.1:3", "test")
    assert dropped == [b1]
    assert [key for key in gone if h.client.exists(key)] == []
    assert h.client.hkeys(STATUS) == [tag(b0).encode()]
    assert h.client.exists(cp_key(b0)) and h.client.exists(log_key(b0))
    assert register_instance(h.client, "b", "b=tcp://127.0.0.1:3", "test") == []


@pytest.mark.parametrize("value", [0, -1, -(2**63), 2**63, 2**64 - 1, b"", b"\x00" * 32])
def test_snapshot_rows_keep_hashes_exact(value: int | bytes) -> None:
    row = BlockRow(A, 1, "CPU", value, value, [1, 2], 2, "x", 3, 1.5)
    fields = {row_field(1, "CPU", value): row_value(row), b"": b"cursor"}
    (back,) = decode_rows(A, fields)
    assert back == row and type(back.block_hash) is type(value)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://", "must be redis://HOST"),
        ("redis://h:1/x", "not a number"),
        ("redis://h:1/0?ingest=", "ingest="),
        ("redis://h:1/0?colour=red", "unknown option"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store(url)


def test_url_options() -> None:
    config = RedisConfig.parse("redis://h:7/3?ingest=a,b&buffer=10&compact=0.5")
    assert (config.url, config.buffer, config.compact) == ("redis://h:7/3", 10, 0.5)
    assert config.ingest.ingests("a") and not config.ingest.ingests("c")
    assert not RedisConfig.parse("redis://h/0?ingest=none").ingest.ingests("a")


def test_unreachable_redis_is_one_line_and_exit_2(tmp_path: Path, port: int) -> None:
    url = f"redis://127.0.0.1:{port}/0"
    with pytest.raises(StoreError, match=r"cannot reach Redis at 127\.0\.0\.1"):
        RedisStore(url).load(FleetIndex())
    cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot reach Redis" in proc.stderr


class Replica:
    """Another replica's worker parts on the same Redis: its own mirror and compactor."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.mirror = Mirror()
        self.reader = SharedLogReader(self.mirror, IngestPolicy(), lambda frames: None)
        self.reader.load(client, {}, ZERO)
        self.compactor = Compactor(self.mirror, self.reader.cursors, 1e9)

    def compact(self) -> None:
        while self.reader.step(self.client, None):
            pass
        self.compactor.compact(self.client)
        self.compactor.release(self.client)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(rich_ops, st.lists(st.integers(0, 49), max_size=4), st.lists(st.integers(0, 49), max_size=2))
def test_runs_cut_continued_and_compacted_by_turns_load_back_exactly(
    server: Any, plan: list[Any], compact_at: list[int], other_at: list[int]
) -> None:
    """Snapshots of runs, written by one replica then another (each then rewrites a
    publisher's snapshot whole once), load back exactly."""
    h = Harness(server.url)
    other = Replica(h.client)
    for i, op in enumerate(plan):
        apply_rich(h, [op])  # type: ignore[arg-type]
        if i in compact_at:
            h.compact()
            h.compactor.release(h.client)
        if i in other_at:
            h.appender.flush(h.client)
            other.compact()
    loaded, _ = h.reload()  # snapshot + log tail
    same_pools(loaded, h.reference)
    h.compact()
    loaded, result = h.reload()  # snapshot only
    same_state(loaded, h.reference, PROMPTS)
    assert result.log_batches_replayed == 0
    rows, _ = current_rows(server.url)
    assert {(r.source, r.group, r.medium, r.block_hash): r.copies for r in rows} == {
        (s, g, m, b): n
        for s in (A, B0, B1)
        for (g, m), pool in h.reference.copies(s).items()
        for b, n in pool.items()
    }


def test_a_format_1_snapshot_loads_and_is_rewritten_as_runs(server: Any) -> None:
    """A snapshot written by kvindex before runs (one field per block) still loads, and
    the next compaction rewrites it as runs."""
    h = Harness(server.url)
    h.batch(A, BlockStored([1, 2], None, list(range(8)), BS))
    h.batch(A, BlockStored([1], None, list(range(4)), BS))  # a second copy
    h.appender.flush(h.client)
    old = [
        BlockRow(A, 0, "GPU", 1, None, [0, 1, 2, 3], BS, None, 2, 1.0),
        BlockRow(A, 0, "GPU", 2, 1, [4, 5, 6, 7], BS, None, 1, 1.0),
    ]
    last = h.client.xrevrange(log_key(A), count=1)[0][0].decode()
    cursor = msgspec.msgpack.encode([last, 2, None, 0, 1])  # format 1: five fields
    fields = {row_field(r.group, r.medium, r.block_hash): row_value(r) for r in old}
    h.client.hset(snap_key(A), mapping={b"": cursor, **fields})
    loaded, result = h.reload()
    assert result.log_batches_replayed == 0 and result.blocks_restored == 2
    assert loaded.count(A, 0, "GPU", 1) == 2
    assert loaded.lookup(list(range(8)))[0].matched_blocks == 2
    fresh = Replica(h.client)
    h.batch(A, BlockRemoved([2]))
    h.appender.flush(h.client)
    fresh.compact()
    assert snapshot_format(h.client.hgetall(snap_key(A))) == 2
    loaded, _ = h.reload()
    assert loaded.count(A, 0, "GPU", 1) == 2 and loaded.count(A, 0, "GPU", 2) == 0
    assert loaded.lookup(list(range(8)))[0].matched_blocks == 1


class CuttingProxy:
    """A TCP relay to redis-server that goes down at the first client write holding
    `trigger`, once armed: that connection is cut and new ones are closed at once until
    `up()` (Redis lost mid-compaction for real, not a mock)."""

    def __init__(self, port: int, trigger: bytes) -> None:
        self.target, self.trigger = port, trigger
        self.armed = self.down = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def up(self) -> None:
        self.down = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(client, upstream, pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: Any) -> None:
        try:
            while data := src.recv(65536):
                if pair is not None and self.armed and self.trigger in data:
                    self.armed, self.down = False, True
                    for sock in pair:
                        sock.shutdown(socket.SHUT_RDWR)
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_compaction_cut_off_midway_loses_nothing_from_the_snapshot(server: Any) -> None:
    """Item 14: the compactor took the mirror's changes, then Redis went away before its
    write (a ConnectionError out of the compaction): those changes were never given back,
    so the next compaction wrote only newer runs with a newer cursor, and a reload missed
    the lost ones (their log entries sit before the cursor). Now the publisher's next
    snapshot is written whole."""
    h = Harness(server.url, {"a": SPECS["a"]})
    proxy = CuttingProxy(server.port, b"WATCH")
    cut = redis.Redis.from_url(proxy.url, socket_connect_timeout=1)
    try:
        for i in range(5):
            h.batch(A, BlockStored([i], None, [i] * BS, BS))
        h.compact()  # a snapshot: the next ones write only what changed
        h.batch(A, BlockStored([10], None, [10] * BS, BS))
        h.appender.flush(h.client)
        while h.reader.step(h.client, None):
            pass
        proxy.armed = True
        with pytest.raises(redis.ConnectionError):
            h.compactor.compact(cut)
        assert proxy.down
        proxy.up()
        h.batch(A, BlockStored([11], None, [11] * BS, BS))
        h.compact()
        index, _ = h.reload()
        assert index.block_hashes("a") == h.reference.block_hashes("a") == {0, 1, 2, 3, 4, 10, 11}
    finally:
        cut.close()
        proxy.close()


def test_an_instance_removed_and_added_again_in_one_group_keeps_its_new_batches(
    server: Any,
) -> None:
    """The worker forgot an instance's queued batches when it applied the removal, after
    taking the whole group: the batches of the instance added again right after (in the
    same group) went with it, and its new log stayed empty. Now the removal forgets what
    came before it only."""
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    store = RedisStore(server.url)
    store.load(FleetIndex())
    store.start()
    spec = InstanceSpec.parse("c=tcp://127.0.0.1:1")
    c = SourceKey("c")

    def batches(first: int) -> None:
        for seq in range(5):
            payload = encode_batch([BlockStored([first + seq], None, [seq] * BS, BS)])
            store.record(Delivery(c, seq, decode_batch(payload), payload=payload))

    try:
        store.save_instance(spec)
        batches(0)
        store.sync()
        store.remove_instance("c")  # and at once again, with its engine's replay from 0
        store.save_instance(spec)
        batches(100)
        store.sync()
    finally:
        store.close()
    assert client.hget(cp_key(c), "n") == b"5"
    index = FleetIndex()
    RedisStore(server.url).load(index)
    assert index.block_hashes("c") == set(range(100, 105))


def test_a_replica_that_ingests_nothing_wakes_on_the_feed_at_once() -> None:
    """The feed socket (other replicas' entries, forwarded by the worker) was not in the
    Subscriber's poller: a replica with no publisher of its own took it only when its
    idle wait ran out, one membership change per wait, so under churn it fell far behind.
    Now an entry wakes the poll at once."""
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://feed-wakes")
    push.connect("inproc://feed-wakes")
    sub = SharedSubscriber(IngestPolicy.parse("none"), lambda _report: None, {}, {})
    wake_r, wake_w = os.pipe()
    sub.wake_on(wake_r)  # as an ingest worker has it
    sub.connect_feed(pull)
    try:
        sub.poll(0)
        spec = InstanceSpec.parse("r=tcp://127.0.0.1:1")
        push.send_multipart([pack(["a", "r", spec.render(), False, "1-0"])])
        start = time.monotonic()
        sub.poll(5.0)
        assert time.monotonic() - start < 1.0
        assert sub.membership_changes() == [MembershipChange("r", spec)]
    finally:
        sub.close()
        push.close(linger=0)
        pull.close(linger=0)
        os.close(wake_r)
        os.close(wake_w)
