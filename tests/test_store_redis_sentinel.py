"""`--store redis+sentinel://...`: the Redis store through a failover, for real.

A `redis-server` primary and replica and three `redis-sentinel`s on loopback
(tests/sentinel.py). Under a live stream the primary is SIGKILLed: Sentinel promotes the
replica, the ingesting replica of kvindex follows the new master (degraded meanwhile,
lookups answered from memory), and afterwards every kvindex replica and the store itself
hold exactly the publishers' state: nothing lost, even the writes asynchronous
replication had not carried over. The times to promotion, to `/healthz` ok and to a
complete store are printed (pytest -s) and bounded.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from netutil import wait_until
from sentinel import SentinelCluster
from test_store_crash import (
    Serve,
    Workload,
    assert_same,
    caught_up,
)

from kvindex.index import FleetIndex
from kvindex.store import StoreError, open_store
from kvindex.store.redis import RedisStore
from kvindex.store.redis.layout import RedisConfig
from kvindex.subscriber import SourceKey

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    cluster = SentinelCluster(tmp_path / "redis")
    cluster.dir.mkdir()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_sentinel_urls() -> None:
    config = RedisConfig.parse("redis+sentinel://10.0.0.1:26379,10.0.0.2/mymaster/2?buffer=10")
    assert config.url == "redis+sentinel://10.0.0.1:26379,10.0.0.2/mymaster/2"
    assert config.buffer == 10
    assert config.where == "master 'mymaster' (db 2) of Sentinel 10.0.0.1:26379,10.0.0.2:26379"
    for bad, says in [
        ("redis+sentinel://h:1/", "MASTER/DB"),
        ("redis+sentinel://h:1/m/x", "MASTER/DB"),
        ("redis+sentinel://h:99999/m/0", "HOST:PORT"),
        ("redis+sentinel://h:1/m/0?colour=red", "unknown option 'colour'"),
    ]:
        with pytest.raises(StoreError, match=says):
            open_store(bad)


def store_complete(url: str, work: Workload) -> bool:
    """The store alone (snapshot + log, as a replica starting now loads it) holds every
    publisher's exact state, up to its last seq."""
    index = FleetIndex()
    try:
        result = RedisStore(url).load(index)
    except StoreError:
        return False
    for name, pub in work.pubs.items():
        checkpoint = result.checkpoints.get(SourceKey(name))
        if checkpoint is None or checkpoint.next_seq != pub.next_seq:
            return False
        if index.block_hashes(name) != work.reference.block_hashes(name):
            return False
    return True


def store_covers(url: str, seqs: dict[str, int]) -> bool:
    """The store (as a replica starting now loads it) has every publisher at least up to
    `seqs` (name -> next seq) and registered: what was sent before an outage is back."""
    try:
        result = RedisStore(url).load(FleetIndex())
    except StoreError:
        return False
    return all(
        name in result.instances
        and (cp := result.checkpoints.get(SourceKey(name))) is not None
        and cp.next_seq >= seq
        for name, seq in seqs.items()
    )


def test_primary_killed_under_a_live_stream_loses_nothing(
    tmp_path: Path, cluster: SentinelCluster
) -> None:
    work = Workload(["a", "b"])
    try:
        ingester = Serve(cluster.url, work.specs(), tmp_path)
        server = Serve(cluster.url + "?ingest=none", [], tmp_path)
        feeder = threading.Thread(target=work.run, args=(1500, 0.002))
        feeder.start()
        assert wait_until(lambda: (server.instances()["a"]["last_seq"] or 0) > 200, 30)
        primary, replica = cluster.ports
        sent = {name: pub.next_seq for name, pub in work.pubs.items()}
        killed = time.monotonic()
        cluster.kill(primary)
        assert wait_until(lambda: cluster.master_port() == replica, 30, 0.05)
        promoted = time.monotonic() - killed
        assert wait_until(lambda: ingester.get("/healthz") == {"status": "ok"}, 30, 0.05)
        healthy = time.monotonic() - killed
        assert wait_until(lambda: store_covers(cluster.url, sent), 30, 0.05)
        covered = time.monotonic() - killed
        feeder.join()
        assert wait_until(lambda: store_complete(cluster.url, work), 60)
        print(
            f"\nSentinel failover: promoted {promoted:.2f} s, ingester /healthz ok "
            f"{healthy:.2f} s, store holding all sent before the kill {covered:.2f} s "
            "after the primary was killed"
        )
        assert wait_until(lambda: caught_up(ingester, work) and caught_up(server, work), 60)
        assert_same(ingester, work)
        assert_same(server, work)
        for serve in (ingester, server):
            rows = serve.instances()
            assert all(r["lost_batches"] == 0 for r in rows.values()), rows
        ingester.stop(signal.SIGTERM)
        server.stop(signal.SIGTERM)
    finally:
        work.close()


def test_redis_restarted_empty_is_refilled(tmp_path: Path, redis_server: Any) -> None:
    """Redis comes back with nothing (its data lost, or FLUSHALL): the ingesting replica
    registers the fleet again and writes back what it holds, so the store is complete
    again and the replica that only reads is exact; nothing is counted lost."""
    work = Workload(["a", "b"])
    try:
        ingester = Serve(redis_server.url, work.specs(), tmp_path)
        server = Serve(redis_server.url + "?ingest=none", [], tmp_path)
        feeder = threading.Thread(target=work.run, args=(1200, 0.002))
        feeder.start()
        assert wait_until(lambda: (server.instances()["a"]["last_seq"] or 0) > 200, 30)
        redis_server.stop()
        for path in redis_server.dir.rglob("appendonly*"):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        redis_server.start()
        back = time.monotonic()
        sent = {name: pub.next_seq for name, pub in work.pubs.items()}
        assert wait_until(lambda: store_covers(redis_server.url, sent), 30, 0.05)
        refilled = time.monotonic() - back
        assert wait_until(lambda: ingester.get("/healthz") == {"status": "ok"}, 30)
        feeder.join()
        assert wait_until(lambda: store_complete(redis_server.url, work), 60)
        complete = time.monotonic() - back
        assert wait_until(lambda: caught_up(ingester, work) and caught_up(server, work), 60)
        print(
            f"\nRedis restarted empty: everything sent before it came back stored again "
            f"{refilled:.2f} s after, the whole stream {complete:.2f} s after (the stream "
            "went on meanwhile)"
        )
        assert_same(ingester, work)
        assert_same(server, work)
        ingester.stop(signal.SIGTERM)
        server.stop(signal.SIGTERM)
    finally:
        work.close()
