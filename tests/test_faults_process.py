"""Faults that kill processes: an engine (publisher) killed with SIGKILL mid-stream and a
new one started on the same endpoints; `kvindex serve` killed with SIGKILL or stopped with
SIGTERM while batches flow, then started again. Memory store: a restarted service
rebuilds its state from the publishers' replay buffers and must converge exactly.

(Persistence across a service restart -- nothing persisted lost -- is the store's to test:
`--store sqlite://...` / `redis://...` in its own tests. `start_service` takes the store
URL, so those cases can reuse `test_serve_killed_mid_stream_converges_by_replay`.)"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from clitools import Proc
from netutil import free_port, serve_url, wait_until
from service_workload import Conversation, RefRank

from kvindex.index import FleetIndex
from kvindex.subscriber import ReplayPolicy, Restarted, SourceKey, Subscriber
from kvindex.wire import render_hash
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

HERE = Path(__file__).parent
FAST = ReplayPolicy(first_reply_timeout=0.5, idle_timeout=0.3, deadline=5.0, idle_probe=0.5)


def engine(endpoint: str, replay: str, seed: int, turns: int, drop: float = 0.0) -> Proc:
    args = [endpoint, replay, str(seed), str(turns), str(drop)]
    return Proc([sys.executable, str(HERE / "pubproc.py"), *args])


def test_engine_killed_mid_stream_and_restarted() -> None:
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    index = FleetIndex()
    restarts: list[Restarted] = []
    with Subscriber(pub_ep, replay=replay_ep, policy=FAST) as sub:

        def pump(until: object, timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for item in sub.poll(0.02):
                    index.handle(item)
                    if isinstance(item, Restarted):
                        restarts.append(item)
                if until():  # type: ignore[operator]
                    return True
            return False

        first = engine(pub_ep, replay_ep, seed=1, turns=10_000)
        try:
            first.wait_for(first.out, lambda line: int(line.split()[1]) >= 150)
            assert pump(lambda: (sub.stats(SourceKey("vllm")).last_seq or 0) >= 100, 10)
        finally:
            first.proc.send_signal(signal.SIGKILL)  # mid-stream, no goodbye
            first.proc.wait(5)
        second = engine(pub_ep, replay_ep, seed=2, turns=30, drop=0.1)
        try:
            line = second.wait_for(second.out, lambda s: s.startswith("held "), timeout=20)
            held = set(line.split()[1:])
            assert pump(lambda: {render_hash(h) for h in index.block_hashes("vllm")} == held, 15)
        finally:
            second.kill()
    stats = sub.stats(SourceKey("vllm"))
    assert len(restarts) == 1 and stats.publisher_restarts == 1
    assert stats.lost_since_restart == 0 and len(held) > 10


# -- kvindex serve killed --------------------------------------------------------------


class Traffic:
    """Two engines (one with dp=2) publishing a workload on a thread, with drops."""

    def __init__(self) -> None:
        self.ranks = [RefRank(Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))]
        base, replay = free_port(), free_port()
        while True:  # two consecutive free ports for each socket kind
            base, replay = free_port(), free_port()
            if abs(base - replay) > 2:
                try:
                    self.b = [
                        RefRank(
                            Publisher(
                                f"tcp://127.0.0.1:{base + r}",
                                f"tcp://127.0.0.1:{replay + r}",
                                dp_rank=r,
                            )
                        )
                        for r in range(2)
                    ]
                    break
                except Exception:  # a port taken meanwhile: try others
                    continue
        self.specs = [
            f"a={self.ranks[0].pub.endpoint},replay={self.ranks[0].pub.replay_endpoint}",
            f"b={self.b[0].pub.endpoint},replay={self.b[0].pub.replay_endpoint},dp=2",
        ]
        self.rng = random.Random(9)
        self.convs = [Conversation(self.rng, i) for i in range(6)]
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def all(self) -> list[RefRank]:
        return [*self.ranks, *self.b]

    def start(self) -> None:
        self.stop.clear()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        homes = self.all()
        drops = random.Random(4)
        for r in homes:
            r.pub.drop = lambda seq: drops.random() < 0.05
        i = 0
        while not self.stop.is_set():
            conv = self.convs[i % len(self.convs)]
            home = homes[i % len(homes)]
            home.serve(conv.next_prompt())
            home.evict(self.rng, self.rng.randrange(0, 3))
            i += 1
            time.sleep(0.002)

    def pause(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5)
        for r in self.all():
            r.pub.drop = None
            r.pub.publish([])  # the tail becomes visible

    def close(self) -> None:
        self.pause()
        for r in self.all():
            r.pub.close()


@pytest.fixture
def traffic() -> Iterator[Traffic]:
    t = Traffic()
    try:
        yield t
    finally:
        t.close()


def start_service(traffic: Traffic, store: str = "memory") -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", store]
    for spec in traffic.specs:
        cmd += ["--instance", spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return proc, serve_url(proc)


def converged(client: httpx.Client, traffic: Traffic) -> bool:
    want = {
        "a": {render_hash(h) for h in traffic.ranks[0].held()},
        "b": {render_hash(h) for r in traffic.b for h in r.held()},
    }
    for name, held in want.items():
        r = client.get(f"/v1/instances/{name}/blocks")
        if r.status_code != 200 or set(r.json()["block_hashes"]) != held:
            return False
    rows = client.get("/v1/instances").json()["instances"]
    return all(i["status"] == "live" and i["lost_batches"] == 0 for i in rows)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_serve_killed_mid_stream_converges_by_replay(traffic: Traffic, sig: int) -> None:
    proc, url = start_service(traffic)
    try:
        traffic.start()
        with httpx.Client(base_url=url, timeout=5) as client:
            assert wait_until(lambda: client.get("/v1/stats").json()["batches"] > 50, 15)
        proc.send_signal(sig)  # while batches flow
        code = proc.wait(10)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        time.sleep(0.3)  # the engines go on without it
        proc, url = start_service(traffic)
        time.sleep(0.3)
        traffic.pause()
        with httpx.Client(base_url=url, timeout=5) as client:
            assert wait_until(lambda: converged(client, traffic), 20), client.get(
                "/v1/instances"
            ).json()
            assert sum(len(r.held()) for r in traffic.all()) > 20
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
