"""What the cases ask `serve` and its stores while they run: HTTP (stdlib only: `kvindex
bench` runs without the dev extras), each instance's state, the stores' checkpoints, a
process's resident memory, and the polling that turns these into timestamps."""

from __future__ import annotations

import http.client
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

__all__ = [
    "POLL",
    "BenchError",
    "Client",
    "connect",
    "counters",
    "free_port",
    "heap_bytes",
    "http_json",
    "ingest_stats",
    "instances",
    "lookup_metric",
    "metrics_text",
    "request",
    "rss_mib",
    "served_blocks",
    "wait_applied",
    "wait_for",
    "wait_live",
    "wait_persisted",
]

POLL = 0.02  # seconds between two polls of serve's state


class BenchError(RuntimeError):
    """A case could not complete (a child died, serve never caught up, ...)."""


# -- HTTP ------------------------------------------------------------------------------------


def connect(url: str, timeout: float = 30) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)


def request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None) -> Any:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    conn.request(method, path, body, headers)
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise BenchError(f"{method} {path}: HTTP {resp.status} {data[:200]!r}")
    return msgspec.json.decode(data)


def http_json(url: str, path: str, body: bytes | None = None) -> Any:
    """GET `path` (POST if there is a body) on a fresh connection."""
    conn = connect(url)
    try:
        return request(conn, "GET" if body is None else "POST", path, body)
    finally:
        conn.close()


class Client:
    """A lean HTTP/1.1 keep-alive client for the timed requests: a request is one prepared
    byte string and one `sendall`, an answer read by its Content-Length. `http.client`
    costs ~100 us a request on these machines (it parses headers with the email package),
    which would hide most of a fast server's time; this costs ~10 us."""

    def __init__(self, url: str, timeout: float = 30) -> None:
        parts = urlsplit(url)
        self.host = f"{parts.hostname or '127.0.0.1'}:{parts.port}"
        self.sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port), timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = b""

    def prepare(self, method: str, path: str, body: bytes | None = None) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return head.encode() + b"\r\n" + (body or b"")

    def send(self, prepared: bytes) -> bytes:
        """Send a prepared request; the answer's body, which must be a 200's."""
        self.sock.sendall(prepared)
        while b"\r\n\r\n" not in self.pending:
            self._read()
        head, _, rest = self.pending.partition(b"\r\n\r\n")
        status, length = _head(head)
        while len(rest) < length:
            self.pending = rest
            self._read()
            rest = self.pending
        self.pending = rest[length:]
        if status != 200:
            raise BenchError(f"HTTP {status} {rest[:200]!r}")
        return rest[:length]

    def _read(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise BenchError("the server closed the connection")
        self.pending += chunk

    def close(self) -> None:
        self.sock.close()


def _head(head: bytes) -> tuple[int, int]:
    """(status, Content-Length) of an answer's head; a chunked answer is refused."""
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise BenchError(f"an answer without Content-Length: {head[:200]!r}")
    return status, length


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- serve's state -----------------------------------------------------------------------------


def instances(url: str) -> list[dict[str, Any]]:
    views: list[dict[str, Any]] = http_json(url, "/v1/instances")["instances"]
    return views


def wait_for(what: str, check: Callable[[], bool], timeout: float, step: float = POLL) -> float:
    """Poll `check` until it holds; returns the wall time of the poll that saw it."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return time.time()
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


def wait_live(url: str, timeout: float) -> None:
    def live() -> bool:
        return all(view["status"] == "live" for view in instances(url))

    wait_for("every instance to be live", live, timeout)
    time.sleep(0.2)  # the SUB sockets' subscriptions reach the publishers


def wait_applied(url: str, names: Sequence[str], next_seqs: Sequence[int], timeout: float) -> float:
    want = {name: n - 1 if n else None for name, n in zip(names, next_seqs, strict=True)}

    def applied() -> bool:
        return {view["name"]: view["last_seq"] for view in instances(url)} == want

    return wait_for("serve to apply every batch", applied, timeout)


def served_blocks(url: str, names: Sequence[str]) -> dict[str, set[str]]:
    return {n: set(http_json(url, f"/v1/instances/{n}/blocks")["block_hashes"]) for n in names}


COUNTERS = ("gaps", "replayed_batches", "lost_batches", "decode_errors", "publisher_restarts")


def counters(url: str) -> dict[str, int]:
    views = instances(url)
    return {key: sum(int(view[key]) for view in views) for key in COUNTERS}


def ingest_stats(url: str) -> dict[str, float]:
    """serve's ingest counters (`GET /v1/stats`): batches applied, of them the C path's
    (`batches_in_c`), the ingest threads' seconds holding the GIL (`gil_seconds`), and
    its workers and index shards."""
    stats = http_json(url, "/v1/stats")
    ingest = stats["ingest"]
    return {
        "batches": float(stats["batches"]),
        "batches_in_c": float(ingest["batches_in_c"]),
        "gil_seconds": float(ingest["gil_seconds"]),
        "workers": float(ingest["workers"]),
        "index_shards": float(ingest["index_shards"]),
    }


def metrics_text(url: str) -> str:
    """serve's `/metrics`, as Prometheus text."""
    conn = connect(url)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def lookup_metric(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of serve's token-lookup latency histogram."""
    found = {"sum": 0.0, "count": 0.0}
    for line in metrics_text(url).splitlines():
        for key in found:
            if line.startswith(f'kvindex_lookup_latency_seconds_{key}{{kind="tokens"}}'):
                found[key] = float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


def thread_stages(url: str) -> dict[str, Any]:
    """serve's C lookup thread's answers by stage (kvindex_lookup_thread_stage_seconds:
    cumulative bucket counts by stage) and its preempted / blocked counts; empty when the
    thread does not run."""
    found: dict[str, Any] = {"buckets": {}, "counts": {}}
    prefix = "kvindex_lookup_thread_stage_seconds_bucket{"
    for line in metrics_text(url).splitlines():
        if line.startswith(prefix):
            labels, value = line[len(prefix) :].rsplit("} ", 1)
            fields = dict(part.split("=", 1) for part in labels.split(","))
            stage, bound = fields["stage"].strip('"'), fields["le"].strip('"')
            found["buckets"].setdefault(stage, []).append((float(bound), float(value)))
        for name in ("preempted", "blocked", "answered"):
            if line.startswith(f"kvindex_lookup_thread_{name}_total "):
                found["counts"][name] = float(line.rsplit(" ", 1)[1])
    return found if found["buckets"] else {}


def stages_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the thread answered between two `thread_stages` reads: per stage, its p50, p90
    and p99 (ms) as the upper bound of the bucket they fall in, and the share of answers
    preempted or blocked during their walk."""
    if not before or not after:
        return {}
    out: dict[str, Any] = {}
    for stage, rows in after["buckets"].items():
        was = dict(before["buckets"].get(stage, []))
        diff = [(bound, count - was.get(bound, 0.0)) for bound, count in rows]
        total = diff[-1][1] if diff else 0.0
        if not total:
            continue
        quantiles = {}
        for q in (0.5, 0.9, 0.99):
            bound = next(b for b, c in diff if c >= q * total)
            quantiles[f"p{round(q * 100)}_ms_le"] = round(bound * 1e3, 4)
        out[stage] = quantiles
    answered = after["counts"].get("answered", 0) - before["counts"].get("answered", 0)
    if answered:
        for name in ("preempted", "blocked"):
            done = after["counts"].get(name, 0) - before["counts"].get(name, 0)
            out[f"{name}_share"] = done / answered
    return out


def heap_bytes(url: str) -> dict[str, float]:
    """serve's `kvindex_heap_bytes` by allocator (kvindex.runtime.heap), and their `total`
    (malloc + pymalloc) when both are there."""
    conn = connect(url)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith('kvindex_heap_bytes{allocator="'):
            name = line.split('"')[1]
            found[name] = float(line.rsplit(" ", 1)[1])
    if "malloc" in found and "pymalloc" in found:
        found["total"] = found["malloc"] + found["pymalloc"]
    return found


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """The process's CPU time so far (user + system, all its threads; not its children)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def children_cpu_seconds(pid: int) -> float | None:
    """The CPU time so far of the process's running children (a store's worker process:
    serve's `cpu_seconds` does not count it), summed; None if they can't be read."""
    try:
        kids: list[int] = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids.extend(int(k) for k in f.read().split())
    except (OSError, ValueError):
        return None
    times = [cpu_seconds(kid) for kid in kids]
    return sum(t for t in times if t is not None)


def cpu_per_m_events(before: float | None, after: float | None, events: int) -> float | None:
    """CPU seconds per million block events between two `cpu_seconds` readings."""
    if before is None or after is None or events <= 0:
        return None
    return (after - before) / events * 1e6


# -- what the stores have persisted ----------------------------------------------------------


def sqlite_next_seqs(path: Path) -> dict[str, int]:
    """Each publisher's next seq as the SQLite store has committed it (read-only)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
    except sqlite3.Error:
        return {}
    try:
        rows = db.execute("SELECT instance, next_seq FROM sources WHERE rank = 0").fetchall()
        return {str(name): int(seq) for name, seq in rows}
    except sqlite3.Error:
        return {}
    finally:
        db.close()


def redis_next_seqs(url: str, names: Sequence[str]) -> Callable[[], dict[str, int]]:
    """A reader of each publisher's next seq as Redis holds it (its checkpoint hash)."""
    import redis

    from kvindex.store.redis.layout import cp_key
    from kvindex.subscriber.messages import SourceKey

    client = redis.Redis.from_url(url)

    def read() -> dict[str, int]:
        out = {}
        for name in names:
            value = client.hget(cp_key(SourceKey(name, 0)), "n")
            if value is not None:
                out[name] = int(value)
        return out

    return read


def wait_persisted(
    store: str, names: Sequence[str], next_seqs: Sequence[int], timeout: float
) -> float | None:
    """When the store holds every batch (None for the memory store)."""
    want = dict(zip(names, next_seqs, strict=True))
    if store.startswith("sqlite:///"):
        path = Path(store[len("sqlite:///") :])
        return wait_for(
            "the SQLite store to commit", lambda: sqlite_next_seqs(path) == want, timeout
        )
    if store.startswith("redis://"):
        read = redis_next_seqs(store, names)
        return wait_for("Redis to hold every batch", lambda: read() == want, timeout)
    return None
