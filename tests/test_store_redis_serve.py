"""`serve --store redis://...` replicas on one real redis-server, under load.

Killed mid-ingest, a replica converges to the reference that never stopped; a second
replica that ingests nothing answers exactly like the one that ingests; Redis stopping
and coming back under load loses nothing; a replay the publisher can't serve any more
marks the instance `incomplete`, and it stays so.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from netutil import wait_until
from test_store_crash import (
    Serve,
    Workload,
    assert_same,
    caught_up,
    kill_mid_ingest_then_converge,
)

from kvindex.index import FleetIndex
from kvindex.store.redis import RedisStore
from kvindex.subscriber import SourceKey

pytestmark = pytest.mark.timeout(90)
SAME = ("status", "last_seq", "blocks", "lost_batches", "blocks_by_medium")


def post(serve: Serve, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        serve.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


def delete(serve: Serve, path: str) -> None:
    request = urllib.request.Request(serve.url + path, method="DELETE")
    urllib.request.urlopen(request, timeout=5).close()


def answers(serve: Serve, work: Workload) -> tuple[Any, ...]:
    """What a router sees: every instance's blocks and row, and lookups of each prefix."""
    rows = serve.instances()
    blocks = {n: serve.get(f"/v1/instances/{n}/blocks")["block_hashes"] for n in rows}
    views = {n: {k: r[k] for k in SAME} for n, r in rows.items()}
    lookups = [post(serve, "/v1/lookup", {"token_ids": p})["instances"] for p in work.prefixes]
    return blocks, views, lookups


def alike(a: Serve, b: Serve, work: Workload) -> bool:
    try:
        return answers(a, work) == answers(b, work)
    except OSError:
        return False


def test_killed_mid_ingest_converges_to_the_reference(tmp_path: Path, redis_server: Any) -> None:
    kill_mid_ingest_then_converge(redis_server.url, tmp_path, signal.SIGKILL)


def test_two_replicas_answer_alike_while_one_ingests(tmp_path: Path, redis_server: Any) -> None:
    work = Workload(["a", "b"])
    extra = Workload(["c"], seed=7)
    try:
        ingester = Serve(redis_server.url, work.specs(), tmp_path)
        server = Serve(redis_server.url + "?ingest=none", [], tmp_path)
        feeder = threading.Thread(target=work.run, args=(600,))
        feeder.start()
        assert wait_until(lambda: len(server.instances()) == 2, 10)
        assert wait_until(lambda: (server.instances()["a"]["last_seq"] or 0) > 100, 30)
        feeder.join()
        assert wait_until(lambda: caught_up(ingester, work) and caught_up(server, work), 30)
        assert wait_until(lambda: alike(ingester, server, work), 10)
        assert_same(server, work)
        # An instance added on the serving replica is ingested by the other (ingest=all)
        # and served by both; removed on either, it is gone from both.
        post(server, "/v1/instances", {"spec": extra.specs()[0]})
        assert wait_until(lambda: "c" in ingester.instances(), 10)
        time.sleep(0.5)  # the ingester's replay of c finishes
        extra.run(200)
        assert wait_until(lambda: caught_up(server, extra) and caught_up(ingester, extra), 30)
        assert_same(server, extra)
        assert wait_until(lambda: alike(ingester, server, work), 10)
        delete(ingester, "/v1/instances/c")
        assert wait_until(lambda: "c" not in server.instances(), 10)
        ingester.stop(signal.SIGTERM)
        server.stop(signal.SIGTERM)
    finally:
        work.close()
        extra.close()


def test_redis_stopped_and_restarted_under_load_loses_nothing(
    tmp_path: Path, redis_server: Any
) -> None:
    """The outage outlasts the worker's queue (buffer=100), so the batches dropped from it
    must be fetched again from the publishers' replay buffers once Redis is back."""
    work = Workload(["a", "b"])
    try:
        ingester = Serve(redis_server.url + "?buffer=100", work.specs(), tmp_path)
        server = Serve(redis_server.url + "?ingest=none", [], tmp_path)
        feeder = threading.Thread(target=work.run, args=(1200, 0.002))
        feeder.start()
        assert wait_until(lambda: (server.instances()["a"]["last_seq"] or 0) > 100, 30)
        redis_server.stop()
        time.sleep(1.5)  # the ingester keeps serving from memory meanwhile
        assert (ingester.instances()["a"]["last_seq"] or 0) > 150
        # ... and says why it can't persist.
        assert wait_until(lambda: ingester.get("/healthz")["status"] == "degraded", 10)
        assert ingester.get("/healthz")["reason"].startswith("store: Redis is unreachable: ")
        redis_server.start()
        feeder.join()
        assert wait_until(lambda: caught_up(ingester, work) and caught_up(server, work), 60)
        assert wait_until(lambda: ingester.get("/healthz") == {"status": "ok"}, 10)
        assert_same(ingester, work)
        assert_same(server, work)  # it only has the shared log: that is gap-free
        for serve in (ingester, server):
            rows = serve.instances()
            assert all(r["lost_batches"] == 0 for r in rows.values()), rows
        ingester.stop(signal.SIGTERM)
        server.stop(signal.SIGTERM)
        index = FleetIndex()
        result = RedisStore(redis_server.url).load(index)
        for name, pub in work.pubs.items():
            assert index.block_hashes(name) == work.reference.block_hashes(name)
            checkpoint = result.checkpoints[SourceKey(name)]
            assert (checkpoint.next_seq, checkpoint.lost_since_restart) == (pub.next_seq, 0)
    finally:
        work.close()


def test_range_the_publisher_no_longer_holds_marks_incomplete(
    tmp_path: Path, redis_server: Any
) -> None:
    work = Workload(["a"], buffer_steps=50)
    try:
        serve = Serve(redis_server.url, work.specs(), tmp_path)
        server = Serve(redis_server.url + "?ingest=none", [], tmp_path)
        work.run(100)
        assert wait_until(lambda: caught_up(serve, work), 30)
        serve.stop(signal.SIGKILL)
        work.run(200)  # 200 batches while nobody ingests; the buffer keeps only 50
        serve = Serve(redis_server.url, work.specs(), tmp_path)
        assert wait_until(lambda: caught_up(serve, work), 30)
        row = serve.instances()["a"]
        assert (row["status"], row["lost_batches"]) == ("incomplete", 150)
        # The other replica learns it from the shared log.
        assert wait_until(lambda: server.instances()["a"]["status"] == "incomplete", 10)
        assert server.instances()["a"]["lost_batches"] == 150
        serve.stop(signal.SIGTERM)
        serve = Serve(redis_server.url, work.specs(), tmp_path)  # still incomplete
        assert wait_until(lambda: serve.instances()["a"]["status"] == "incomplete", 10)
        serve.stop(signal.SIGTERM)
        server.stop(signal.SIGTERM)
    finally:
        work.close()


def test_a_replica_never_takes_its_own_changes_back(tmp_path: Path, redis_server: Any) -> None:
    """Item 7: the control stream handed a replica its own adds and removes back, applied
    again on its ingest thread: an instance DELETEd (204) was back within 300 ms in most
    tries. Now a replica skips its own entries; the other replica follows every change and
    ends where the first did."""
    work = Workload(["x"])
    spec = work.specs()[0]
    try:
        a = Serve(redis_server.url, [], tmp_path)
        b = Serve(redis_server.url, [], tmp_path)
        back = 0
        for _ in range(12):
            post(a, "/v1/instances", {"spec": spec})
            delete(a, "/v1/instances/x")
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:  # not even for a moment
                back += "x" in a.instances()
                time.sleep(0.005)
        assert back == 0
        post(a, "/v1/instances", {"spec": spec})
        time.sleep(0.3)
        assert list(a.instances()) == ["x"]
        assert wait_until(lambda: list(b.instances()) == ["x"], 10)
        delete(b, "/v1/instances/x")
        assert wait_until(lambda: not a.instances() and not b.instances(), 10)
        time.sleep(0.3)
        assert not a.instances() and not b.instances()
        a.stop(signal.SIGTERM)
        b.stop(signal.SIGTERM)
    finally:
        work.close()
