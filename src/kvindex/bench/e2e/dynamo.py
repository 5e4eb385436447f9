"""The end-to-end peer: NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`,
PyPI `ai-dynamo-runtime`, the `[bench]` extra), run as a user would run it beside vLLM.

It is started with its defaults (`--threads 4`) on a free port, and each publisher is
registered over HTTP as a worker (`POST /register`: worker id = instance index + 1, its PUB
and replay endpoints, block size 16, model `bench`). It then subscribes to the same kind of
ZMQ stream `kvindex serve` gets, replays gaps from the replay endpoint, and answers
`POST /query {"token_ids", "model_name"}` with matched *tokens* per worker and DP rank.

When has it applied everything? Its Prometheus counter
`dynamo_kvrouter_kv_cache_events_applied{event_type, status}` counts every vLLM event it
took off the wire, one per event (a `BlockRemoved` of 10 hashes is one), whatever the
outcome: the sum over all labels reaching the number of events published means applied.
What it holds afterwards comes from `GET /dump` (its tree as store events per worker).
docs/peers.md has the API as measured on the real process.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvindex.bench.common import BLOCK
from kvindex.bench.e2e.probes import BenchError, connect, free_port, http_json, rss_mib, wait_for
from kvindex.bench.e2e.procs import Child, child

__all__ = ["MODEL", "Peer", "standalone", "standalone_status", "worker_id"]

MODEL = "bench"
_APPLIED = "dynamo_kvrouter_kv_cache_events_applied{"
_BANNER = "Standalone KV cache indexer"


def worker_id(instance: int) -> int:
    """The worker id instance `instance` (its index) is registered under."""
    return instance + 1


def standalone_status() -> dict[str, Any]:
    """Whether the peer can run here: `{"available": True, "version", "command"}` or
    `{"available": False, "reason"}` (the bench then says why instead of failing)."""
    try:
        found = importlib.util.find_spec("dynamo.indexer") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return {
            "available": False,
            "reason": "ai-dynamo-runtime is not installed (pip install -e '.[bench]')",
        }
    command = [sys.executable, "-m", "dynamo.indexer", "--help"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "reason": f"python -m dynamo.indexer: {exc}"[:200]}
    said = done.stdout + done.stderr
    if _BANNER not in said:
        last = (said.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"available": False, "reason": f"python -m dynamo.indexer: {last}"[:200]}
    return {
        "available": True,
        "version": importlib.metadata.version("ai-dynamo-runtime"),
        "command": "python -m dynamo.indexer --port PORT (default --threads 4)",
        "model_name": MODEL,
    }


@dataclass(slots=True)
class Peer:
    """A running `python -m dynamo.indexer` with every publisher registered."""

    child: Child
    url: str
    instances: int

    @property
    def pid(self) -> int:
        return int(self.child.proc.pid)

    def status(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """One request on a fresh connection: (HTTP status, body)."""
        conn = connect(self.url)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {} if data is None else {"Content-Type": "application/json"}
            conn.request(method, path, data, headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def healthy(self) -> bool:
        if self.child.proc.poll() is not None:
            raise BenchError(f"dynamo.indexer exited with {self.child.proc.returncode}")
        try:
            return self.status("GET", "/health")[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def register(self, instance: int, endpoint: str, replay: str) -> None:
        body = {
            "instance_id": worker_id(instance),
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "model_name": MODEL,
            "block_size": BLOCK,
        }
        code, answer = self.status("POST", "/register", body)
        if code != 201:
            raise BenchError(f"POST /register: HTTP {code} {answer[:200]!r}")

    def active(self) -> bool:
        """Every registered listener is subscribed and past its catch-up."""
        workers = http_json(self.url, "/workers")
        listeners = [ls for w in workers for ls in w["listeners"].values()]
        return len(listeners) == self.instances and all(
            ls["status"] == "active" for ls in listeners
        )

    def metrics(self) -> str:
        return self.status("GET", "/metrics")[1].decode()

    def applied(self) -> dict[str, int]:
        """The applied-events counter by its labels (`event_type=...,status=...`)."""
        out = {}
        for line in self.metrics().splitlines():
            if line.startswith(_APPLIED):
                labels, value = line[len(_APPLIED) :].rsplit(" ", 1)
                if float(value):
                    out[labels.rstrip("}")] = int(float(value))
        return out

    def wait_applied(self, events: int, timeout: float) -> float:
        """The wall time of the poll that first counted `events` applied events."""
        return wait_for(
            f"Dynamo's indexer to apply {events:,} events",
            lambda: sum(self.applied().values()) >= events,
            timeout,
        )

    def refused(self) -> int:
        """Events applied with another outcome than ok (a parent it did not know, ...)."""
        return sum(n for labels, n in self.applied().items() if 'status="ok"' not in labels)

    def held(self) -> list[set[str]]:
        """Per instance, every block hash its `/dump` lists (hashes as decimal strings)."""
        out: list[set[str]] = [set() for _ in range(self.instances)]
        for part in http_json(self.url, "/dump").values():
            for record in part.get("events", []):
                data = record["event"]["data"]
                stored = data.get("stored") if isinstance(data, dict) else None
                instance = int(record["worker_id"]) - 1
                if stored and 0 <= instance < self.instances:
                    out[instance].update(str(b["block_hash"]) for b in stored["blocks"])
        return out

    def rss_mib(self) -> float | None:
        return rss_mib(self.pid)


@contextlib.contextmanager
def standalone(
    workdir: Path, endpoints: Sequence[tuple[str, str]], tag: str, timeout: float
) -> Iterator[Peer]:
    """Dynamo's indexer on a free port with a worker per (PUB, replay) endpoint pair,
    every listener active, stopped at the end."""
    port = free_port()
    args = [sys.executable, "-m", "dynamo.indexer", "--port", str(port)]
    # Its log is kept (warnings: gaps, replays, refused events); info lines are per worker.
    env = dict(os.environ, DYN_LOG=os.environ.get("DYN_LOG", "warn"))
    with child(args, workdir / f"dynamo-{tag}.log", env=env) as c:
        peer = Peer(c, f"http://127.0.0.1:{port}", len(endpoints))
        wait_for("Dynamo's indexer to answer /health", peer.healthy, 60, 0.05)
        for instance, (pub, replay) in enumerate(endpoints):
            peer.register(instance, pub, replay)
        wait_for("Dynamo's listeners to be active", peer.active, timeout)
        time.sleep(0.2)  # the SUB sockets' subscriptions reach the publishers
        yield peer
