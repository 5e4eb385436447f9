"""Membership under stress (issue 27): real `serve` processes while instances are added
and removed every few milliseconds, an SGLang engine restarts on other ports (read again
from its /server_info), publishers keep publishing, and every read endpoint and the
lookup fast path are hammered meanwhile.

For each store (memory, SQLite, Redis with two replicas): no 5xx, no fast-path 400, no
traceback in the service's log, every answer holds the instances that are never removed;
once it is over, each instance holds exactly what its publisher sent; SQLite and Redis
give it all back after a warm restart (with the publishers silent: from the store alone),
the instance removed and added again hundreds of times included. Runs on both
implementations (the serves inherit KVINDEX_PURE: the Makefile's PURE_TESTS).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from netutil import serve_line, wait_until
from sglang_fake import FakeSGLang
from test_store_crash import BS, Workload

from kvindex.wire import BlockStored

pytestmark = pytest.mark.timeout(240)

SECONDS = float(os.environ.get("KVINDEX_STRESS_SECONDS", "5"))
STABLE = ["s0", "s1"]  # never removed: every answer holds them
CHURNED = ["c0", "c1"]  # added and removed all the time, all following publisher `c`


class Service:
    """One `serve`: its URL, and its log (stderr) in a file."""

    def __init__(self, store: str, instances: list[str], workdir: Path, name: str) -> None:
        self.log = workdir / f"{name}.log"
        cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0"]
        cmd += ["--store", store, "--discovery-interval", "0.05"]
        for spec in instances:
            cmd += ["--instance", spec]
        with self.log.open("a") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        self.start_line = serve_line(self.proc, self.log.read_text)
        where = self.start_line.split("listening on http://")[1].split()[0].rstrip("/")
        self.host, port = where.rsplit(":", 1)
        self.port = int(port)

    def client(self) -> Client:
        return Client(self.host, self.port)

    def get(self, path: str) -> Any:
        status, body = self.client().call("GET", path)
        assert status == 200, (path, status, body)
        return json.loads(body)

    def instances(self) -> dict[str, Any]:
        return {i["name"]: i for i in self.get("/v1/instances")["instances"]}

    def blocks(self, name: str) -> set[int]:
        return {int(h) for h in self.get(f"/v1/instances/{name}/blocks")["block_hashes"]}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0, self.log.read_text()[-3000:]

    def tracebacks(self) -> list[str]:
        text = self.log.read_text()
        return [part[:1500] for part in text.split("Traceback")[1:]]


class Client:
    """A keep-alive HTTP/1.1 connection (what the fast path answers on)."""

    def __init__(self, host: str, port: int) -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=30)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        self.conn.request(method, path, data, headers)
        resp = self.conn.getresponse()
        return resp.status, resp.read()


class Stress:
    """Publishers, an SGLang engine, and the threads that change and read the fleet."""

    def __init__(self) -> None:
        self.work = Workload([*STABLE, "c"])
        self.engine = FakeSGLang()
        self.engine.start_publishers(dp=1)
        self.engine.start_http()
        self.engine_lock = threading.Lock()
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.cycles = 0
        self.reads = 0
        self.restarts = 0
        self.last_added: str | None = None

    def stable_specs(self) -> list[str]:
        pubs = self.work.pubs
        specs = [f"{n}={pubs[n].endpoint},replay={pubs[n].replay_endpoint},model=m" for n in STABLE]
        return [*specs, f"sg={self.engine.url}"]

    def churned_spec(self, name: str) -> str:
        pub = self.work.pubs["c"]
        return f"{name}={pub.endpoint},replay={pub.replay_endpoint},model=m"

    # -- the threads ------------------------------------------------------------------------

    def feed(self) -> None:
        while not self.stop.is_set():
            for name in self.work.pubs:
                self.work.step(name)
            with self.engine_lock:  # not while it restarts
                for pub in self.engine.publishers:
                    pub.publish([BlockStored([10_000 + self.restarts], None, [1] * BS, BS)])
            time.sleep(0.002)

    def churn(self, service: Service) -> None:
        client = service.client()
        while not self.stop.is_set():
            for name in CHURNED:
                status, body = client.call(
                    "POST", "/v1/instances", {"spec": self.churned_spec(name)}
                )
                if status != 201:
                    self.failures.append(f"POST {name}: {status} {body[:300]!r}")
                status, body = client.call("DELETE", f"/v1/instances/{name}")
                if status != 204:
                    self.failures.append(f"DELETE {name}: {status} {body[:300]!r}")
            self.cycles += 1
            time.sleep(0.003)
        status, body = client.call("POST", "/v1/instances", {"spec": self.churned_spec("c0")})
        if status != 201:
            self.failures.append(f"last POST c0: {status} {body[:300]!r}")
        self.last_added = "c0"

    def rediscover(self) -> None:
        """The SGLang engine restarts on other ports, one DP rank or two, every 0.6 s."""
        while not self.stop.wait(0.6):
            with self.engine_lock:
                self.restarts += 1
                self.engine.restart(dp=1 + self.restarts % 2)

    def hammer(self, service: Service) -> None:
        client = service.client()
        prefix = self.work.prefixes[0][: BS * 2]
        plain = {"token_ids": prefix}
        steps: list[tuple[str, str, Any, Callable[[bytes], str | None]]] = [
            ("GET", "/v1/instances", None, self._holds_stable("instances")),
            ("POST", "/v1/lookup", plain, self._holds_stable("instances")),  # the fast path
            ("POST", "/v1/lookup/hashes", {"block_hashes": ["1", "2"]}, _anything),
            ("POST", "/v1/lookup", {**plain, "model": "m"}, _anything),
            ("POST", "/v1/route", {**plain, "model": "m"}, _anything),
            ("GET", "/v1/stats", None, _anything),
            ("GET", "/metrics", None, _anything),
            ("GET", "/v1/instances/s0/blocks", None, _anything),
            ("GET", "/v1/instances/c0/blocks", None, _anything),
            ("POST", "/query", {"token_ids": prefix, "model_name": "m"}, _anything),
            ("GET", "/workers", None, _anything),
            ("GET", "/v1/dashboard/snapshot", None, _anything),
            ("GET", "/healthz", None, _anything),
        ]
        while not self.stop.is_set():
            for method, path, body, check in steps:
                status, answer = client.call(method, path, body)
                self.reads += 1
                bad = status >= 500 or (path == "/v1/lookup" and status == 400)
                wrong = check(answer) if status == 200 else None
                if bad or wrong:
                    self.failures.append(f"{method} {path}: {status} {wrong} {answer[:300]!r}")

    @staticmethod
    def _holds_stable(key: str) -> Callable[[bytes], str | None]:
        def check(answer: bytes) -> str | None:
            names = [row["name"] for row in json.loads(answer)[key]]
            if len(names) != len(set(names)) or not set(STABLE) <= set(names):
                return f"instances {names}"
            return None

        return check

    def run(self, churned: Service, read: list[Service]) -> None:
        threads = [
            threading.Thread(target=self.feed),
            threading.Thread(target=self.churn, args=(churned,)),
            threading.Thread(target=self.rediscover),
            *(threading.Thread(target=self.hammer, args=(s,)) for s in read for _ in range(2)),
        ]
        for thread in threads:
            thread.start()
        try:
            time.sleep(SECONDS)
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(60)
        assert self.failures[:10] == [], f"{len(self.failures)} failures"
        assert self.cycles > 20 and self.reads > 100 and self.restarts >= 2

    # -- after ------------------------------------------------------------------------------

    def expected(self) -> dict[str, set[int]]:
        """What each instance must hold once all is applied (its publisher's blocks)."""
        want = {name: self.work.reference.block_hashes(name) for name in STABLE}
        want["c0"] = self.work.reference.block_hashes("c")
        return want

    def caught_up(self, service: Service) -> bool:
        rows = service.instances()
        pubs = self.work.pubs
        want = {**{n: pubs[n] for n in STABLE}, "c0": pubs["c"]}
        return set(rows) == {*want, "sg"} and all(
            rows[n]["last_seq"] == pub.next_seq - 1 for n, pub in want.items()
        )

    def holds_all(self, service: Service, sglang: bool = True) -> None:
        """`sglang`: the engine is followed at its last ports (a replica that does not
        ingest it knows it by its URL only: the shared registry keeps no more)."""
        seqs = {n: p.next_seq - 1 for n, p in self.work.pubs.items()}
        rows = lambda: {n: (r["last_seq"], r["status"]) for n, r in service.instances().items()}  # noqa: E731
        # A replica that falls behind under churn (it took one change per idle wait) is
        # far more than this behind when the churn stops.
        assert wait_until(lambda: self.caught_up(service), 12), (service.log.name, seqs, rows())
        for name, hashes in self.expected().items():
            assert service.blocks(name) == hashes, name
        if sglang:
            sg = lambda: service.instances()["sg"]  # noqa: E731
            assert wait_until(lambda: sg()["dp"] == self.engine_dp(), 20), (sg(), service.log)

    def engine_dp(self) -> int:
        return len(self.engine.publishers)

    def silence(self) -> None:
        """The publishers answer nothing more: a warm start has only the store."""
        for pub in self.work.pubs.values():
            pub.drop = lambda _seq: True
            pub.replay_paused = True

    def close(self) -> None:
        self.stop.set()
        self.engine.close()
        self.work.close()


def _anything(_answer: bytes) -> str | None:
    return None


def no_tracebacks(*services: Service) -> None:
    for service in services:
        assert service.tracebacks() == [], service.log


def test_memory_store(tmp_path: Path) -> None:
    stress = Stress()
    try:
        service = Service("memory", stress.stable_specs(), tmp_path, "memory")
        stress.run(service, [service])
        stress.holds_all(service)
        service.stop()
        no_tracebacks(service)
    finally:
        stress.close()


def test_sqlite_store_and_its_warm_restart(tmp_path: Path) -> None:
    stress = Stress()
    store = f"sqlite:///{tmp_path / 'state.sqlite'}"
    try:
        service = Service(store, stress.stable_specs(), tmp_path, "sqlite")
        stress.run(service, [service])
        stress.holds_all(service)
        service.stop()
        stress.silence()
        again = Service(store, stress.stable_specs(), tmp_path, "sqlite-again")
        assert "warm start" in again.start_line
        for name, hashes in stress.expected().items():
            assert again.blocks(name) == hashes, name
        again.stop()
        no_tracebacks(service, again)
    finally:
        stress.close()


def test_redis_store_two_replicas_and_a_warm_restart(tmp_path: Path, redis_server: Any) -> None:
    stress = Stress()
    try:
        a = Service(redis_server.url, stress.stable_specs(), tmp_path, "redis-a")
        b = Service(redis_server.url + "?ingest=none", [], tmp_path, "redis-b")
        assert wait_until(lambda: set(STABLE) <= set(b.instances()), 20)
        stress.run(a, [a, b])
        stress.holds_all(a)
        stress.holds_all(b, sglang=False)
        a.stop()
        b.stop()
        stress.silence()
        again = Service(redis_server.url, stress.stable_specs(), tmp_path, "redis-again")
        assert "warm start" in again.start_line
        for name, hashes in stress.expected().items():
            assert again.blocks(name) == hashes, name
        again.stop()
        no_tracebacks(a, b, again)
        # b does not subscribe to the SGLang engine: it must not read its /server_info and
        # try to follow its publishers (it did, and failed every time: already followed).
        assert "could not follow" not in b.log.read_text()
    finally:
        stress.close()
