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

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netutil import wait_until
from sentinel import SentinelCluster
from test_store_crash import (
    Serve,
    Workload,
    assert_same,
    caught_up,
    reap_serves,  # noqa: F401  (autouse: stops the serves a failed test left running)
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
        killed = time.monotonic()
        cluster.kill(primary)
        assert wait_until(lambda: cluster.master_port() == replica, 30)
        promoted = time.monotonic() - killed
        assert wait_until(lambda: ingester.get("/healthz") == {"status": "ok"}, 30)
        healthy = time.monotonic() - killed
        feeder.join()
        assert wait_until(lambda: store_complete(cluster.url, work), 60)
        complete = time.monotonic() - killed
        print(
            f"\nSentinel failover: promoted {promoted:.2f} s, ingester /healthz ok "
            f"{healthy:.2f} s, store complete {complete:.2f} s after the primary was killed"
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
