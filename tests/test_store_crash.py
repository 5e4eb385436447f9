"""`serve` with the SQLite store, killed in the middle of heavy ingest and started again.

The state it converges to must equal a reference that never stopped (every batch the
publishers sent, applied in order); when the publisher no longer holds the missing range,
the instance must say `incomplete` with the number of lost batches, and keep saying it
after another restart.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from netutil import serve_line, wait_until

from kvindex.index import FleetIndex
from kvindex.subscriber import Delivery, SourceKey
from kvindex.wire import BlockRemoved, BlockStored, decode_batch
from kvindex.wire.publisher import Publisher, encode_batch

pytestmark = pytest.mark.timeout(120)
BS = 16


class Workload:
    """Publishers with a steady store/evict workload, and the reference they imply."""

    def __init__(self, names: list[str], buffer_steps: int = 100_000, seed: int = 5) -> None:
        self.pubs = {
            n: Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=buffer_steps)
            for n in names
        }
        self.reference = FleetIndex()
        self.rng = random.Random(seed)
        self.held: dict[str, list[int]] = {n: [] for n in names}
        self.prefixes = [[self.rng.randrange(30_000) for _ in range(BS * 4)] for _ in range(6)]

    def specs(self) -> list[str]:
        return [f"{n}={p.endpoint},replay={p.replay_endpoint}" for n, p in self.pubs.items()]

    def step(self, name: str) -> None:
        rng, held = self.rng, self.held[name]
        n = rng.randint(1, 6)
        prefix = rng.choice(self.prefixes)[: BS * rng.randint(0, 4)]
        tokens = (prefix + [rng.randrange(30_000) for _ in range(BS * n)])[: BS * n]
        hashes = [rng.getrandbits(64) for _ in range(n)]
        events: list[Any] = [BlockStored(hashes, None, tokens, BS)]
        if rng.random() < 0.2 and held:
            events.append(BlockStored([held[-1]], None, [], 0))  # another copy, hash only
            held.append(held[-1])
        held.extend(hashes)
        while len(held) > 300:
            events.append(BlockRemoved([held.pop(0)]))
        payload = encode_batch(events)
        pub = self.pubs[name]
        seq = pub.publish_payload(payload)
        self.reference.handle(Delivery(SourceKey(name), seq, decode_batch(payload)))

    def run(self, batches: int, pace: float = 0.0005) -> None:
        for _ in range(batches):
            for name in self.pubs:
                self.step(name)
            time.sleep(pace)

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.close()


class Serve:
    def __init__(self, store: str, specs: list[str], workdir: Path) -> None:
        cmd = [sys.executable, "-m", "kvindex", "serve", "--http", "127.0.0.1:0", "--store", store]
        for spec in specs:
            cmd += ["--instance", spec]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=workdir)
        self.start_line = serve_line(self.proc)
        self.url = self.start_line.split("listening on ")[1].split()[0].rstrip("/")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=5) as resp:
            return json.loads(resp.read())

    def instances(self) -> dict[str, Any]:
        return {i["name"]: i for i in self.get("/v1/instances")["instances"]}

    def stop(self, sig: int) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(30)


def caught_up(serve: Serve, work: Workload) -> bool:
    try:
        rows = serve.instances()
    except OSError:
        return False
    return all(
        rows[n]["last_seq"] == p.next_seq - 1 and rows[n]["status"] in ("live", "incomplete")
        for n, p in work.pubs.items()
    )


def persisted(serve: Serve) -> bool:
    """Everything the service applied is durable in its store."""
    return serve.get("/v1/stats")["store"]["pending_groups"] == 0


def assert_same(serve: Serve, work: Workload) -> None:
    for name in work.pubs:
        blocks = serve.get(f"/v1/instances/{name}/blocks")["block_hashes"]
        assert {int(h) for h in blocks} == work.reference.block_hashes(name), name


def kill_mid_ingest_then_converge(store: str, tmp_path: Path, sig: int) -> None:
    """Stop `serve` with `sig` in the middle of ingest, start it again on the same store:
    it must converge to the reference; then, after a clean stop, come back from the store
    alone (the publishers send and replay nothing)."""
    work = Workload(["a", "b"])
    try:
        serve = Serve(store, work.specs(), tmp_path)
        feeder = threading.Thread(target=work.run, args=(1500,))
        feeder.start()
        assert wait_until(lambda: (serve.instances()["a"]["last_seq"] or 0) > 300, 30)
        serve.stop(sig)  # in the middle of ingest
        time.sleep(0.3)
        serve = Serve(store, work.specs(), tmp_path)
        assert "warm start" in serve.start_line
        feeder.join()
        assert wait_until(lambda: caught_up(serve, work), 60), serve.instances()
        assert_same(serve, work)
        rows = serve.instances()
        assert all(r["lost_batches"] == 0 and r["status"] == "live" for r in rows.values())
        serve.stop(signal.SIGTERM)
        for pub in work.pubs.values():
            pub.drop = lambda _seq: True
            pub.replay_paused = True
        serve = Serve(store, work.specs(), tmp_path)
        assert_same(serve, work)
        serve.stop(signal.SIGTERM)
    finally:
        work.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_mid_ingest_converges_to_the_reference(tmp_path: Path, sig: int) -> None:
    kill_mid_ingest_then_converge(f"sqlite:///{tmp_path / 'state.sqlite'}", tmp_path, sig)


def test_range_the_publisher_no_longer_holds_marks_incomplete(tmp_path: Path) -> None:
    work = Workload(["a"], buffer_steps=50)
    store = f"sqlite:///{tmp_path / 'state.sqlite'}"
    try:
        serve = Serve(store, work.specs(), tmp_path)
        work.run(100)
        assert wait_until(lambda: caught_up(serve, work), 30)
        serve.stop(signal.SIGKILL)
        work.run(200)  # 200 batches while the service is down; the buffer keeps only 50
        serve = Serve(store, work.specs(), tmp_path)
        assert wait_until(lambda: caught_up(serve, work), 30)
        row = serve.instances()["a"]
        assert row["status"] == "incomplete"
        assert row["lost_batches"] == 150
        serve.stop(signal.SIGTERM)
        serve = Serve(store, work.specs(), tmp_path)  # still incomplete after a restart
        assert wait_until(lambda: serve.instances()["a"]["status"] == "incomplete", 10)
        serve.stop(signal.SIGTERM)
    finally:
        work.close()
