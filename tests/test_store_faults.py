"""The store can't take the service down (issue 17, points 1, 2 and 6), tried for real:

- the SQLite writer killed with SIGKILL under ingest: seen within a second, `/healthz` says
  `degraded` with the reason while lookups keep answering, the writer is started again
  and handed what it had not made durable: the file ends exact;
- a full filesystem (a small tmpfs): the store says so and stops writing, the service's
  memory stays bounded, and writing resumes once there is room;
- seqs past 2**63 stored and resumed from exactly;
- one owner per store: a second `serve` on the same file stops with one line naming the
  owner; `serve` started again right after a `kill -9`, twenty times, ends exact;
- a damaged store, or a file that is not a kvindex store: one line naming the file (and
  what to do), exit 2, and not a byte written to a file not known to be kvindex's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from netutil import wait_until
from test_store_crash import Serve, Workload, assert_same, caught_up, persisted

from kvindex.index import FleetIndex
from kvindex.store import open_store
from kvindex.store.redis.layout import cp_key, log_key
from kvindex.subscriber import SourceKey
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher, encode_batch

pytestmark = pytest.mark.timeout(180)


def writer_pids(serve: Serve) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(serve.proc.pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def health(serve: Serve) -> dict[str, str]:
    answer: dict[str, str] = serve.get("/healthz")
    return answer


def store_health(serve: Serve) -> dict[str, object]:
    answer: dict[str, object] = serve.get("/v1/stats")["store"]
    return answer


def sources(path: Path) -> dict[str, object]:
    db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        return {i: n for i, n in db.execute("SELECT instance, next_seq FROM sources")}
    finally:
        db.close()


def test_a_killed_writer_is_restarted_and_the_store_ends_exact(tmp_path: Path) -> None:
    work = Workload(["a", "b"])
    path = tmp_path / "s.sqlite"
    serve = Serve(f"sqlite:///{path}", work.specs(), tmp_path)
    try:
        work.run(200)
        (writer,) = writer_pids(serve)
        os.kill(writer, signal.SIGKILL)
        killed = time.monotonic()
        said = "store: the SQLite writer stopped (killed by signal 9)"
        assert wait_until(lambda: health(serve).get("reason") == said, 5)
        assert time.monotonic() - killed < 1.0  # seen, and said why, within a second
        lookup = urllib.request.Request(
            serve.url + "/v1/lookup", b'{"token_ids": [1, 2, 3]}', method="POST"
        )
        with urllib.request.urlopen(lookup, timeout=5) as resp:  # still answered
            assert resp.status == 200
        work.run(200)  # while it comes back, and after
        assert wait_until(lambda: caught_up(serve, work) and persisted(serve), 30)
        # The writer commits before its report reaches serve: health follows.
        assert wait_until(lambda: health(serve) == {"status": "ok"}, 5)
        assert store_health(serve)["restarts"] == 1
        metrics = urllib.request.urlopen(serve.url + "/metrics", timeout=5).read().decode()
        assert "kvindex_store_restarts_total 1.0" in metrics
        assert 'last_error="the SQLite writer stopped (killed by signal 9)' in metrics
    finally:
        serve.stop(signal.SIGTERM)
    assert sources(path) == {n: p.next_seq for n, p in work.pubs.items()}
    serve = Serve(f"sqlite:///{path}", work.specs(), tmp_path)  # what the file says
    try:
        time.sleep(0.5)  # subscribed
        work.run(5)
        assert wait_until(lambda: caught_up(serve, work), 30)
        assert_same(serve, work)
        assert all(r["replayed_batches"] == 0 for r in serve.instances().values())
    finally:
        serve.stop(signal.SIGTERM)
        work.close()


def test_immediate_restart_after_kill9_is_exact_every_time(tmp_path: Path) -> None:
    work = Workload(["a"])
    store = f"sqlite:///{tmp_path / 's.sqlite'}"
    try:
        for _ in range(20):
            serve = Serve(store, work.specs(), tmp_path)
            work.run(50, pace=0.0002)
            serve.stop(signal.SIGKILL)  # mid-ingest, its writer left behind
        serve = Serve(store, work.specs(), tmp_path)
        try:
            assert wait_until(lambda: caught_up(serve, work), 30)
            assert_same(serve, work)
            assert serve.instances()["a"]["status"] == "live"
        finally:
            serve.stop(signal.SIGTERM)
    finally:
        work.close()


def test_a_second_serve_on_the_same_store_stops_naming_the_owner(tmp_path: Path) -> None:
    work = Workload(["a"])
    store = f"sqlite:///{tmp_path / 's.sqlite'}"
    serve = Serve(store, work.specs(), tmp_path)
    try:
        cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0"]
        second = subprocess.run(
            [*cmd, "--store", store], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert f"in use by kvindex serve pid {serve.proc.pid} on " in lines[0]
    finally:
        serve.stop(signal.SIGTERM)
        work.close()


@contextlib.contextmanager
def small_filesystem(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"can't mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_stops_writing_says_so_and_resumes(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "small", "24m") as disk:
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (22 << 20))  # taken now, given back later
        pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=100_000)
        spec = f"a={pub.endpoint},replay={pub.replay_endpoint}"
        serve = Serve(f"sqlite:///{disk / 's.sqlite'}", [spec], tmp_path)
        try:
            tokens = list(range(16 * 64))

            def publish(n: int) -> None:
                for _ in range(n):
                    seq = pub.next_seq
                    hashes = [seq * 64 + i for i in range(64)]
                    pub.publish_payload(encode_batch([BlockStored(hashes, None, tokens, 16)]))
                    time.sleep(0.001)

            publish(800)  # ~3.5 MB of batches: more than the disk has left
            assert wait_until(lambda: health(serve)["status"] == "degraded", 30)
            assert "database or disk is full" in health(serve)["reason"]
            publish(200)  # kept by the service meanwhile (bounded: see test_store_link)
            lookup = urllib.request.Request(
                serve.url + "/v1/lookup", b'{"token_ids": [0, 1, 2, 3]}', method="POST"
            )
            with urllib.request.urlopen(lookup, timeout=5) as resp:  # still answered
                assert resp.status == 200
            filler.unlink()  # room again
            assert wait_until(lambda: persisted(serve), 60)
            assert wait_until(lambda: health(serve) == {"status": "ok"}, 5)
        finally:
            serve.stop(signal.SIGTERM)
            pub.close()
        # It stopped as asked (not killed after the wait), though the snapshot a stop
        # writes may have found no room: the log holds everything all the same.
        assert serve.proc.returncode == 0
        db = sqlite3.connect(disk / "s.sqlite")
        assert db.execute("SELECT next_seq FROM sources").fetchone() == (1000,)
        db.close()
        index = FleetIndex()
        open_store(f"sqlite:///{disk / 's.sqlite'}").load(index)
        assert len(index.block_hashes("a")) == 1000 * 64


def fill(path: Path) -> None:
    """Write zeros to `path` until its filesystem has no room left."""
    with open(path, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (64 << 10))
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 512)


def test_a_stop_with_no_room_for_its_snapshot_stops_cleanly(tmp_path: Path) -> None:
    """Everything is committed, then the disk fills: the snapshot a stop writes has no
    room. The service still stops at once with exit 0 (its writer neither fails nor is
    started again until the stop's wait runs out), and the log alone restores it all."""
    with small_filesystem(tmp_path / "small", "24m") as disk:
        pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=100_000)
        spec = f"a={pub.endpoint},replay={pub.replay_endpoint}"
        url = f"sqlite:///{disk / 's.sqlite'}"
        serve = Serve(url, [spec], tmp_path)
        try:
            tokens = list(range(16 * 64))
            for _ in range(400):
                hashes = [pub.next_seq * 64 + i for i in range(64)]
                pub.publish_payload(encode_batch([BlockStored(hashes, None, tokens, 16)]))
                time.sleep(0.001)
            assert wait_until(lambda: serve.instances()["a"]["last_seq"] == 399, 30)
            assert wait_until(lambda: persisted(serve), 30)
            fill(disk / "filler")
        finally:
            serve.stop(signal.SIGTERM)
            pub.close()
        assert serve.proc.returncode == 0
        (disk / "filler").unlink()
        index = FleetIndex()
        open_store(url).load(index)
        assert len(index.block_hashes("a")) == 400 * 64


def test_seqs_past_2_63_are_stored_and_resumed_exactly(tmp_path: Path) -> None:
    pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    spec = f"a={pub.endpoint},replay={pub.replay_endpoint}"
    path = tmp_path / "s.sqlite"
    first = 2**64 - 40
    try:
        serve = Serve(f"sqlite:///{path}", [spec], tmp_path)
        try:
            time.sleep(0.5)  # subscribed
            for i in range(20):
                pub.put(first + i, encode_batch([BlockStored([i], None, [i] * 16, 16)]))
            assert wait_until(lambda: serve.instances()["a"]["last_seq"] == first + 19, 30)
            assert wait_until(lambda: persisted(serve), 30)
            assert health(serve) == {"status": "ok"}
        finally:
            serve.stop(signal.SIGTERM)
        assert sources(path)["a"] == (first + 20).to_bytes(9, "big")
        db = sqlite3.connect(path)
        # Every seq before the first it saw was lost to it: a count past 2**63 too.
        assert db.execute("SELECT lost_since_restart FROM sources").fetchone() == (
            first.to_bytes(9, "big"),
        )
        db.close()
        for i in range(20, 30):  # while it is down: replayed from the checkpoint
            pub.put(first + i, encode_batch([BlockStored([i], None, [i] * 16, 16)]), live=False)
        serve = Serve(f"sqlite:///{path}", [spec], tmp_path)
        try:
            assert wait_until(lambda: serve.instances()["a"]["last_seq"] == first + 29, 30)
            row = serve.instances()["a"]
            assert (row["replayed_batches"], row["lost_batches"]) == (10, 0)
            blocks = serve.get("/v1/instances/a/blocks")["block_hashes"]
            assert sorted(int(h) for h in blocks) == list(range(30))
        finally:
            serve.stop(signal.SIGTERM)
    finally:
        pub.close()


def serve_once(store: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", store]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_a_damaged_store_is_one_line_with_advice_and_can_be_set_aside(tmp_path: Path) -> None:
    work = Workload(["a"])
    path = tmp_path / "s.sqlite"
    store = f"sqlite:///{path}"
    serve = Serve(store, work.specs(), tmp_path)
    try:
        work.run(300)
        assert wait_until(lambda: caught_up(serve, work) and persisted(serve), 30)
    finally:
        serve.stop(signal.SIGTERM)
        work.close()
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page : 4 * page] = b"\xa5" * (2 * page)  # two pages of garbage
    path.write_bytes(bytes(data))
    out = serve_once(store, tmp_path)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert f"the store {path} is damaged" in line
    assert f"kvindex store check {store}" in line and "--reset" in line
    kvindex = [sys.executable, "-m", "kvindex", "store", "check", store]
    checked = subprocess.run(kvindex, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 1 and str(path) in checked.stdout
    reset = subprocess.run([*kvindex, "--reset"], capture_output=True, text=True, timeout=60)
    assert reset.returncode == 0 and "set aside as" in reset.stdout
    assert not path.exists() and list(tmp_path.glob("s.sqlite.damaged-*"))


def test_a_foreign_sqlite_file_is_refused_without_a_byte_written(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    db.execute("INSERT INTO users VALUES (1, 'x')")
    db.commit()
    db.close()
    before = path.read_bytes()
    out = serve_once(f"sqlite:///{path}", tmp_path)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert f"{path} is not a kvindex store" in line
    assert path.read_bytes() == before  # still in rollback-journal mode, as it was
    assert not Path(f"{path}-wal").exists()
    text = tmp_path / "notes.txt"
    text.write_text("not a database at all\n" * 10)
    out = serve_once(f"sqlite:///{text}", tmp_path)
    assert out.returncode == 2 and "not a kvindex store" in out.stderr
    assert text.read_text() == "not a database at all\n" * 10


def test_killed_redis_workers_are_restarted_where_their_service_stands(
    tmp_path: Path, redis_server: Any
) -> None:
    """The ingesting replica's worker and the serving one's, killed under ingest: both
    come back, the shared log gets every batch once, and the replica that only serves
    (its batches forwarded by its worker from the log) ends exact: nothing missed, nothing
    applied twice."""
    work = Workload(["a"])
    ingest = Serve(redis_server.url, work.specs(), tmp_path)
    server = Serve(redis_server.url + "?ingest=none", [], tmp_path)
    try:
        work.run(200)
        assert wait_until(lambda: caught_up(server, work), 30)
        for replica in (ingest, server):
            (worker,) = writer_pids(replica)
            os.kill(worker, signal.SIGKILL)
        said = "store: the Redis worker stopped (killed by signal 9)"
        assert wait_until(lambda: health(server).get("reason") == said, 5)
        work.run(200)
        for replica in (ingest, server):
            done = wait_until(lambda r=replica: caught_up(r, work) and persisted(r), 30)  # type: ignore[misc]
            # Which replica stalled, where it stands and what its store link says, in full
            # (a string: pytest cuts a tuple's repr). It failed twice in CI, never here:
            # 2026-12-06, the serving replica stood at seq 199 with its worker restarted
            # once and up; the worker's own counters were cut from that message.
            stalled = {
                "server": replica is server,
                "instances": replica.instances(),
                "store": store_health(replica),
            }
            assert done, json.dumps(stalled, default=str)
            # The worker writes to Redis before its report reaches serve: health follows.
            assert wait_until(lambda r=replica: health(r) == {"status": "ok"}, 5)  # type: ignore[misc]
            assert store_health(replica)["restarts"] == 1
            assert_same(replica, work)
        client = redis.Redis.from_url(redis_server.url)
        assert int(client.hget(cp_key(SourceKey("a")), "n") or 0) == work.pubs["a"].next_seq
        assert client.xlen(log_key(SourceKey("a"))) <= work.pubs["a"].next_seq  # once each
        client.close()
    finally:
        ingest.stop(signal.SIGTERM)
        server.stop(signal.SIGTERM)
        work.close()


def test_seqs_past_2_53_are_exact_in_the_shared_redis_log(
    tmp_path: Path, redis_server: Any
) -> None:
    """Redis's Lua numbers are doubles: the append script keeps seqs as decimal strings."""
    pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    first = 2**64 - 40
    try:
        serve = Serve(
            redis_server.url, [f"a={pub.endpoint},replay={pub.replay_endpoint}"], tmp_path
        )
        try:
            time.sleep(0.5)  # subscribed
            for i in range(20):
                pub.put(first + i, encode_batch([BlockStored([i], None, [i] * 16, 16)]))
            assert wait_until(lambda: serve.instances()["a"]["last_seq"] == first + 19, 30)
            assert wait_until(lambda: persisted(serve), 30)
        finally:
            serve.stop(signal.SIGTERM)
        client = redis.Redis.from_url(redis_server.url)
        assert client.hget(cp_key(SourceKey("a")), "n") == str(first + 20).encode()
        assert client.hget(cp_key(SourceKey("a")), "l") == str(first).encode()
        seqs = [int(f[b"s"]) for _, f in client.xrange(log_key(SourceKey("a"))) if b"s" in f]
        assert seqs == [first + i for i in range(20)]
        client.close()
    finally:
        pub.close()
