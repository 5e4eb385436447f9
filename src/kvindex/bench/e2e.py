"""The end-to-end cases: real processes, real sockets, `kvindex serve` as users run it.

Every process the cases start is a child of the bench: publishers (vLLM-compatible
`Publisher`s, one per instance, all in one child process so they never share serve's
GIL), `kvindex serve` itself, and the clients (a naive subscriber, HTTP lookup and
freshness clients). Children talk to the bench in JSON lines (commands on stdin, answers
on stdout) and are always stopped in a `finally` (SIGTERM, then SIGKILL).

The stream is the bench's steady-state workload (`workloads.ingest_workload`: the
simulator with no restarts or resets, several instances): its warm-up, which fills every
instance's pool, is sent first and untimed; the measured part follows. The simulator's
`reference()` at the end is the truth: every ingest case checks that the blocks serve
lists per instance equal it.

Cases and how each is measured (times are wall clock, `time.time()`, compared across
processes of one machine):

1. ingest into `serve --store memory`: the publisher child sends the measured part at
   once (send and receive high-water marks unbounded, so ZeroMQ queues instead of
   dropping; gaps and replays are reported if any happen anyway). Rate = block events /
   (the poll of `GET /v1/instances` that first shows every instance's `last_seq` at its
   final seq - the first send). Polled every 20 ms: the end is late by at most a poll.
   Baseline, same run: a naive subscriber child (SUB sockets, untyped msgspec decode, a
   dict of sets) receiving the same stream from a fresh publisher, stamping its own end:
   what the transport and a minimal consumer manage.
2. the same with `--store sqlite:///...` and `--store redis://...` (a throwaway
   `redis-server`; skipped with a notice when none is installed). The end is when serve
   applied everything *and* the store persisted it: the SQLite file's `sources`
   checkpoint table (read on a read-only connection) or Redis's per-publisher checkpoint
   hash (`cp:...`, field `n`) holds each publisher's final next seq. Applied-only rates
   are reported beside.
3. `POST /v1/lookup` of 512-block prompts from a client child (a keep-alive stdlib HTTP
   connection, one lookup every 5 ms). The prompts are staged chains that each instance
   holds to its own depth, so lookups partly hit; every answer is checked. Once against
   the idle service (the baseline), once while the publisher sends the stream paced at
   200k block events/s. Latency = the client's round trip (request written to answer
   read; includes the stdlib client's own ~0.1 ms).
4. freshness at 100k block events/s: beside the paced stream, the publisher sends a
   marker batch every 10 ms (one new block chaining onto the previous marker, on the first
   instance) and stamps each send. A client child polls `POST /v1/lookup/hashes` with the
   markers not seen yet (a chain, so the answer's `matched_blocks` counts the visible
   ones) with a 1 ms pause between polls, and stamps each marker with the arrival time of
   the first answer that shows it. Latency = that stamp - the send stamp: an upper bound,
   late by up to one poll cycle (round trip + pause; its median is reported as the
   resolution). The polls cost serve a few percent of its loop.
5. warm restart: serve builds a SQLite store by ingesting N blocks (chains of 32, never
   removed) from a publisher, persists it and stops (SIGTERM). `kvindex serve` on that
   store is then timed from process start until `/healthz` answers ok (serve loads the
   store before it binds its port, so an answer means loaded) and until `/v1/instances`
   counts all N blocks. Baseline, same run: the same start with an empty memory store
   (interpreter, imports, sockets: what any start costs).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import msgspec

from kvindex.bench.common import BLOCK, percentile, redis_server

__all__ = ["child_main", "run_e2e", "table_rows"]

PROMPT_BLOCKS = 512
LOAD_RATE = 200_000  # block events/s while lookups run (case 3)
FRESH_RATE = 100_000  # block events/s while freshness is measured (case 4)
MARKER_BASE = 7 * 10**18  # marker block hashes: far from the simulator's
WARM_BASE = 5 * 10**18  # warm-restart block hashes
POLL = 0.02  # seconds between two polls of serve's state
FRESH_PAUSE = 0.001  # seconds between two freshness polls

TARGETS = {
    "ingest_memory_per_s": 800_000,
    "ingest_sqlite_per_s": 500_000,
    "ingest_redis_per_s": 300_000,
    "lookup_p99_ms": 2.0,
    "fresh_p99_ms": 10.0,
    "warm_seconds": 3.0,
    "warm_blocks": 1_000_000,
}


class BenchError(RuntimeError):
    """A case could not complete (a child died, serve never caught up, ...)."""


# -- sizes -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    instances: int
    batches: int  # measured batches of the steady-state stream
    prompts: int  # staged 512-block prompts (case 3)
    lookups: int  # per phase (case 3), one every `lookup_interval` seconds
    lookup_interval: float
    fresh_seconds: float  # case 4's paced phase
    marker_every: float  # seconds between two markers
    warm_blocks: int  # case 5
    timeout: float  # for any one wait


# Cases 3 and 4 consume the measured stream at 200k and 100k block events/s (~27 block
# events a batch): it must outlast both (quick: ~0.55 M of its 0.68 M block events; smoke
# runs out, which the results say as `load_ran_out`).
SMOKE = Sizes(3, 1_500, 6, 40, 0.005, 1.0, 0.01, 4_000, 60.0)
QUICK = Sizes(4, 25_000, 32, 200, 0.005, 1.5, 0.01, 100_000, 120.0)
FULL = Sizes(8, 100_000, 64, 1_200, 0.005, 8.0, 0.01, 1_000_000, 600.0)


def sizes_for(quick: bool, smoke: bool) -> Sizes:
    return SMOKE if smoke else QUICK if quick else FULL


# -- workloads ---------------------------------------------------------------------------

# One batch to publish: (instance index, payload as vLLM sends it). The publisher child
# numbers each instance's batches from 0, in order.
Item = tuple[int, bytes]


@dataclass(slots=True)
class Workload:
    """The steady-state stream: `items[:warmup]` fill every instance's pool (sent
    untimed), the rest is what the cases time."""

    names: list[str]
    items: list[Item]
    warmup: int
    events: int  # block events in items[warmup:]
    reference: dict[str, set[str]]  # per instance: every block hash held at the end
    path: Path  # the items, as the publisher child reads them

    @property
    def measured(self) -> int:
        return len(self.items) - self.warmup

    @property
    def events_per_batch(self) -> float:
        return self.events / max(1, self.measured)


def steady_state(sizes: Sizes, workdir: Path) -> Workload:
    from kvindex.bench.workloads import IngestSpec, ingest_workload

    w = ingest_workload(IngestSpec(instances=sizes.instances, batches=sizes.batches))
    items = [(idx, payload) for idx, _, payload in (*w.warmup, *w.measured)]
    reference = {n: {str(h) for h in held} for n, held in zip(w.names, w.truth, strict=True)}
    path = workdir / "workload.msgpack"
    write_items(path, items)
    return Workload(list(w.names), items, len(w.warmup), w.events, reference, path)


def write_items(path: Path, items: Sequence[Item]) -> None:
    path.write_bytes(msgspec.msgpack.encode(list(items)))


def read_items(path: str | Path) -> list[Item]:
    return msgspec.msgpack.decode(Path(path).read_bytes(), type=list[Item])


@dataclass(slots=True)
class Staged:
    """512-block prompts, each held by every instance to its own depth (case 3)."""

    prompts: list[list[int]]
    depth: list[list[int]]  # depth[p][i]: blocks of prompt p that instance i holds
    items: list[Item]


def staged_prompts(count: int, instances: int, seed: int = 3) -> Staged:
    from kvindex.wire import BlockHash, BlockStored
    from kvindex.wire.publisher import encode_batch

    rng = random.Random(seed)
    staged = Staged([], [], [])
    for _ in range(count):
        tokens = [rng.randrange(32_000) for _ in range(BLOCK * PROMPT_BLOCKS)]
        hashes: list[BlockHash] = [rng.getrandbits(62) for _ in range(PROMPT_BLOCKS)]
        depths = [rng.randrange(PROMPT_BLOCKS) for _ in range(instances)]
        staged.prompts.append(tokens)
        staged.depth.append(depths)
        for i, keep in enumerate(depths):
            if keep:
                event = BlockStored(hashes[:keep], None, tokens[: BLOCK * keep], BLOCK)
                staged.items.append((i, encode_batch([event])))
    return staged


def warm_items(blocks: int, instances: int) -> list[Item]:
    """`blocks` blocks in chains of 32 (one batch each), spread over the instances."""
    from kvindex.wire import BlockHash, BlockStored
    from kvindex.wire.publisher import encode_batch

    items: list[Item] = []
    stored = 0
    while stored < blocks:
        n = min(32, blocks - stored)
        first = len(items) * 32 * BLOCK
        tokens = list(range(first, first + BLOCK * n))
        hashes: list[BlockHash] = list(range(WARM_BASE + stored, WARM_BASE + stored + n))
        event = BlockStored(hashes, None, tokens, BLOCK, medium="GPU")
        items.append((len(items) % instances, encode_batch([event])))
        stored += n
    return items


def marker_payload(j: int) -> bytes:
    """Marker j: one block chained onto marker j - 1 (so a prefix lookup counts them)."""
    from kvindex.wire import BlockStored
    from kvindex.wire.publisher import encode_batch

    parent = MARKER_BASE + j - 1 if j else None
    return encode_batch([BlockStored([MARKER_BASE + j], parent, [j % 32_000] * BLOCK, BLOCK)])


# -- child processes -------------------------------------------------------------------------


class Child:
    """A child process; its stdout is read line by line on a thread, stderr goes to a log."""

    def __init__(self, args: list[str], log: Path, cwd: Path | None = None) -> None:
        self.log_path = log
        self._log: IO[str] = log.open("w")
        self.started = time.time()
        try:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                cwd=cwd,
            )
        except OSError:
            self._log.close()
            raise
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in stdout:
                self.lines.put(line)
        self.lines.put(None)

    @property
    def name(self) -> str:
        return self.log_path.stem

    def send(self, command: dict[str, Any]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()
        except OSError as exc:
            raise BenchError(f"{self.name} is gone ({exc}); {self.tail()}") from None

    def line(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=max(0.01, timeout))
        except queue.Empty:
            raise BenchError(f"{self.name}: no answer in {timeout:.0f} s; {self.tail()}") from None
        if line is None:
            self.lines.put(None)  # stays at its end
            code = self.proc.wait(10)
            raise BenchError(f"{self.name} exited with {code}; {self.tail()}")
        return line

    def expect(self, op: str, timeout: float) -> dict[str, Any]:
        """The next JSON line whose `op` is `op` (other lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.line(deadline - time.monotonic())
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict) and message.get("op") == op:
                    return message

    def tail(self) -> str:
        with contextlib.suppress(ValueError):
            self._log.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return "its stderr: " + (" | ".join(lines[-4:]) if lines else "(empty)")

    def stop(self, grace: float = 30.0) -> int | None:
        """End of stdin, SIGTERM (a graceful stop), SIGKILL after `grace` seconds."""
        proc = self.proc
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._reader.join(5)
        self._log.close()
        return proc.returncode


@contextlib.contextmanager
def child(args: list[str], log: Path, cwd: Path | None = None) -> Iterator[Child]:
    c = Child(args, log, cwd)
    try:
        yield c
    finally:
        c.stop()


def bench_child(role: str, *args: str) -> list[str]:
    """The command line that runs `child_main([role, *args])` in a fresh interpreter."""
    code = f"import sys; from {__name__} import child_main; child_main(sys.argv[1:])"
    return [sys.executable, "-c", code, role, *args]


@dataclass(slots=True)
class Publishers:
    """The publisher child: one vLLM-like publisher per instance, sending on command."""

    child: Child
    endpoints: list[tuple[str, str]]  # (PUB, replay ROUTER) per instance

    def burst(self, timeout: float, count: int | None = None, file: Path | None = None) -> Any:
        """Send the next `count` items (all that are left if None; or a file's items) at
        full speed. Answers the first and last send's times and each next seq."""
        where = None if file is None else str(file)
        self.child.send({"op": "burst", "count": count, "file": where})
        return self.child.expect("burst", timeout)

    def paced(self, batch_rate: float, seconds: float, markers: int = 0, every: float = 1) -> None:
        command = {"op": "paced", "rate": batch_rate, "seconds": seconds, "markers": markers}
        self.child.send(command | {"marker_every": every})
        self.child.expect("started", 30)

    def stats(self) -> dict[str, Any]:
        self.child.send({"op": "stats"})
        return self.child.expect("stats", 30)


@contextlib.contextmanager
def publishers(workdir: Path, items: Path, instances: int, tag: str) -> Iterator[Publishers]:
    args = bench_child("publish", str(items), str(instances))
    with child(args, workdir / f"publisher-{tag}.log") as c:
        endpoints = c.expect("endpoints", 60)["endpoints"]
        yield Publishers(c, [(str(a), str(b)) for a, b in endpoints])


@dataclass(slots=True)
class Serve:
    child: Child
    url: str = ""
    banner: str = ""

    def wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.url:
            line = self.child.line(deadline - time.monotonic())
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].split()[0].rstrip("/")
                self.banner = line.strip()
        return self.url


@contextlib.contextmanager
def serve(
    workdir: Path,
    names: Sequence[str],
    endpoints: Sequence[tuple[str, str]],
    store: str,
    tag: str,
    http: str = "127.0.0.1:0",
    wait: bool = True,
) -> Iterator[Serve]:
    args = [sys.executable, "-m", "kvindex", "serve", "--http", http, "--store", store]
    for name, (pub, replay) in zip(names, endpoints, strict=True):
        args += ["--instance", f"{name}={pub},replay={replay}"]
    with child(args, workdir / f"serve-{tag}.log", cwd=workdir) as c:
        s = Serve(c)
        if wait:
            s.wait_url(60)
        yield s


# -- HTTP (stdlib only: `kvindex bench` runs without the dev extras) ----------------------


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


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    from kvindex.store.redis_keys import cp_key
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


# -- cases 1 and 2: ingest -------------------------------------------------------------------


def case_naive(work: Workload, sizes: Sizes, workdir: Path) -> dict[str, Any]:
    """The baseline: a naive subscriber child receives the same stream."""
    with publishers(workdir, work.path, len(work.names), "naive") as pub:
        endpoints = json.dumps([p for p, _ in pub.endpoints])
        args = bench_child("naive", endpoints, str(work.warmup), str(len(work.items)))
        with child([*args, str(sizes.timeout)], workdir / "naive.log") as naive:
            naive.expect("ready", 60)
            pub.burst(sizes.timeout, count=work.warmup)
            naive.expect("warm", sizes.timeout)
            sent = pub.burst(sizes.timeout)
            done = naive.expect("done", sizes.timeout + 10)
    seconds = done["t_done"] - sent["t0"]
    blocks = {name: set(b) for name, b in zip(work.names, done["blocks"], strict=True)}
    return {
        "consumer": "naive SUB + untyped msgspec + dict of sets",
        "block_events": work.events,
        "seconds": seconds,
        "per_s": work.events / seconds,
        "send_seconds": sent["t1"] - sent["t0"],
        "received": done["received"],
        "gaps": done["gaps"],
        "complete": done["received"] == len(work.items),
        "exact": blocks == work.reference,  # it ignores copies and media: often not
    }


def case_ingest(work: Workload, sizes: Sizes, workdir: Path, store: str, kind: str) -> Any:
    """The stream into `serve --store STORE`, as fast as it takes it."""
    with (
        publishers(workdir, work.path, len(work.names), kind) as pub,
        serve(workdir, work.names, pub.endpoints, store, kind) as srv,
    ):
        wait_live(srv.url, sizes.timeout)
        warm = pub.burst(sizes.timeout, count=work.warmup)
        wait_applied(srv.url, work.names, warm["next_seqs"], sizes.timeout)
        rss_before = rss_mib(srv.child.proc.pid)
        sent = pub.burst(sizes.timeout)
        applied = wait_applied(srv.url, work.names, sent["next_seqs"], sizes.timeout)
        persisted = wait_persisted(store, work.names, sent["next_seqs"], sizes.timeout)
        out = ingest_figures(work, sent["t0"], applied, persisted)
        out |= counters(srv.url)
        out["exact"] = served_blocks(srv.url, work.names) == work.reference
        # Resident memory before the burst and once it is all applied (the burst is
        # queued in ZeroMQ's buffers meanwhile: the growth is mostly that).
        out["serve_rss_mib"] = {"before": rss_before, "after": rss_mib(srv.child.proc.pid)}
        out["replays_served"] = pub.stats()["replays_served"]
        out["send_seconds"] = sent["t1"] - sent["t0"]
    return {"store": kind, "instances": len(work.names), "batches": work.measured, **out}


def ingest_figures(work: Workload, t0: float, applied: float, persisted: float | None) -> Any:
    out: dict[str, Any] = {"block_events": work.events, "seconds": applied - t0}
    out["per_s"] = out["applied_per_s"] = work.events / (applied - t0)
    if persisted is not None:
        out["seconds"] = max(applied, persisted) - t0
        out["per_s"] = work.events / out["seconds"]
        out["persist_lag_seconds"] = max(0.0, persisted - applied)
    return out


def case_redis(work: Workload, sizes: Sizes, workdir: Path) -> dict[str, Any]:
    with redis_server(workdir) as url:
        if url is None:
            return {"skipped": "redis-server is not installed"}
        result: dict[str, Any] = case_ingest(work, sizes, workdir, url, "redis")
        return result


# -- cases 3 and 4: lookups and freshness while ingesting ------------------------------------


def case_lookup_and_fresh(work: Workload, sizes: Sizes, workdir: Path) -> tuple[Any, Any]:
    """On one memory-store serve: staged prompts, lookups idle, lookups under a 200k/s
    stream, then freshness under a 100k/s stream."""
    staged = staged_prompts(sizes.prompts, len(work.names))
    stage_file = workdir / "staged.msgpack"
    write_items(stage_file, staged.items)
    prompts_file = workdir / "prompts.msgpack"
    prompts_file.write_bytes(msgspec.msgpack.encode(staged.prompts))
    with (
        publishers(workdir, work.path, len(work.names), "lookup") as pub,
        serve(workdir, work.names, pub.endpoints, "memory", "lookup") as srv,
    ):
        wait_live(srv.url, sizes.timeout)
        pub.burst(sizes.timeout, file=stage_file)
        sent = pub.burst(sizes.timeout, count=work.warmup)
        wait_applied(srv.url, work.names, sent["next_seqs"], sizes.timeout)
        lookup = lookup_phases(srv, pub, work, staged, prompts_file, sizes, workdir)
        fresh = fresh_phase(srv, pub, work, sizes, workdir)
        lookup["counters"] = fresh["counters"] = counters(srv.url)
        lookup["serve_rss_mib"] = rss_mib(srv.child.proc.pid)
    return lookup, fresh


def lookup_phases(
    srv: Serve,
    pub: Publishers,
    work: Workload,
    staged: Staged,
    prompts_file: Path,
    sizes: Sizes,
    workdir: Path,
) -> dict[str, Any]:
    idle = run_lookups(srv.url, prompts_file, sizes, workdir, "idle")
    loaded = run_lookups(srv.url, prompts_file, sizes, workdir, "loaded", pub, work)
    pub.child.send({"op": "stop"})
    paced = pub.child.expect("paced", 60)
    caught_up = wait_applied(srv.url, work.names, paced["next_seqs"], sizes.timeout)
    answers = (idle["answers"], loaded["answers"])
    return {
        "prompt_blocks": PROMPT_BLOCKS,
        "prompts": sizes.prompts,
        "lookups": sizes.lookups,
        "idle": summarize_ms(idle["latencies"], idle["in_service_mean_ms"]),
        "loaded": summarize_ms(loaded["latencies"], loaded["in_service_mean_ms"]),
        **load_figures(paced, work, LOAD_RATE),
        # How long serve took to apply what was sent before the stop (its lag then).
        "catch_up_seconds": None if paced["exhausted"] else max(0.0, caught_up - paced["t1"]),
        "answers_correct": all(check_lookups(a, staged, work.names) for a in answers),
        "p99_target_ms": TARGETS["lookup_p99_ms"],
    }


def load_figures(paced: dict[str, Any], work: Workload, target: int) -> dict[str, Any]:
    seconds = paced["t1"] - paced["t0"]
    return {
        "load_target_per_s": target,
        "load_achieved_per_s": paced["batches"] * work.events_per_batch / seconds,
        "load_seconds": seconds,
        "load_ran_out": paced["exhausted"],
    }


def run_lookups(
    url: str,
    prompts_file: Path,
    sizes: Sizes,
    workdir: Path,
    tag: str,
    load: Publishers | None = None,
    work: Workload | None = None,
) -> dict[str, Any]:
    """One lookup client's run; with `load`, the paced stream starts once the client is
    ready (and runs until the caller stops it). Also the mean time serve itself says a
    lookup took (its `kvindex_lookup_latency_seconds`: the index walk and the answer,
    without HTTP and without waiting for the loop), to tell the two apart."""
    args = bench_child("lookups", url, str(prompts_file), str(sizes.lookups))
    with child([*args, str(sizes.lookup_interval)], workdir / f"lookups-{tag}.log") as c:
        c.expect("ready", 60)
        if load is not None and work is not None:
            load.paced(LOAD_RATE / work.events_per_batch, 3600)
            time.sleep(0.2)  # serve's backlog settles at the paced rate
        before = lookup_metric(url)
        c.send({"op": "go"})
        done = c.expect("done", sizes.timeout + sizes.lookups * 0.1)
        after = lookup_metric(url)
    count = after[1] - before[1]
    done["in_service_mean_ms"] = (after[0] - before[0]) / count * 1e3 if count else None
    return done


def lookup_metric(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of serve's token-lookup latency histogram."""
    conn = connect(url)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for key in found:
            if line.startswith(f'kvindex_lookup_latency_seconds_{key}{{kind="tokens"}}'):
                found[key] = float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


def check_lookups(answers: list[dict[str, int]], staged: Staged, names: Sequence[str]) -> bool:
    """Every answer gives each instance's depth of its prompt (lookup i asks prompt i % P)."""
    for i, answer in enumerate(answers):
        depth = staged.depth[i % len(staged.prompts)]
        if answer != {name: depth[j] for j, name in enumerate(names)}:
            return False
    return bool(answers)


def summarize_ms(seconds: Sequence[float], in_service_ms: float | None = None) -> Any:
    ordered = sorted(seconds)
    out = {
        "p50_ms": percentile(ordered, 0.5) * 1e3,
        "p99_ms": percentile(ordered, 0.99) * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "count": len(ordered),
    }
    if in_service_ms is not None:
        out["in_service_mean_ms"] = in_service_ms
    return out


def fresh_phase(
    srv: Serve, pub: Publishers, work: Workload, sizes: Sizes, workdir: Path
) -> dict[str, Any]:
    count = int(sizes.fresh_seconds / sizes.marker_every)
    args = bench_child("fresh", srv.url, str(count), work.names[0], str(sizes.fresh_seconds + 20))
    with child(args, workdir / "fresh.log") as client:
        client.expect("ready", 60)
        rate = FRESH_RATE / work.events_per_batch
        pub.paced(rate, sizes.fresh_seconds, count, sizes.marker_every)
        paced = pub.child.expect("paced", sizes.fresh_seconds + 60)
        seen = client.expect("done", sizes.fresh_seconds + 30)
    sent_at: list[float] = paced["markers"]
    seen_at: list[float | None] = seen["seen"]
    pairs = [(t, s - t) for t, s in zip(sent_at, seen_at, strict=False) if s is not None]
    if not pairs:
        raise BenchError("no marker became visible")
    latencies = [latency for _, latency in pairs]
    # The slowest markers, as (seconds into the phase, ms): one stall or a spread?
    worst = sorted(pairs, key=lambda p: -p[1])[:5]
    return {
        "markers": len(sent_at),
        "markers_seen": len(latencies),
        **summarize_ms(latencies),
        "worst": [(round(t - paced["t0"], 3), round(ms * 1e3, 2)) for t, ms in worst],
        "resolution_ms": seen["cycle_p50"] * 1e3,
        "polls": seen["polls"],
        **load_figures(paced, work, FRESH_RATE),
        "p99_target_ms": TARGETS["fresh_p99_ms"],
    }


# -- case 5: warm restart ------------------------------------------------------------------


def case_warm(sizes: Sizes, workdir: Path) -> dict[str, Any]:
    """Build a SQLite store of `warm_blocks` blocks through serve, then time a restart."""
    names = [f"warm-{i}" for i in range(4)]
    items_file = workdir / "warm.msgpack"
    write_items(items_file, warm_items(sizes.warm_blocks, len(names)))
    db = workdir / "warm.sqlite"
    store = f"sqlite:///{db}"
    with publishers(workdir, items_file, len(names), "warm") as pub:
        build_start = time.time()
        with serve(workdir, names, pub.endpoints, store, "warm-build") as srv:
            wait_live(srv.url, sizes.timeout)
            sent = pub.burst(sizes.timeout)
            wait_applied(srv.url, names, sent["next_seqs"], sizes.timeout)
            wait_persisted(store, names, sent["next_seqs"], sizes.timeout)
            if srv.child.stop(grace=sizes.timeout) != 0:  # graceful: the writer compacts
                raise BenchError(f"serve did not stop cleanly; {srv.child.tail()}")
        built = time.time() - build_start
        cold = time_start(workdir, names, pub.endpoints, "memory", None, sizes, "cold")
        warm = time_start(workdir, names, pub.endpoints, store, sizes.warm_blocks, sizes, "warm")
    return {
        "blocks": sizes.warm_blocks,
        "build_seconds": built,
        "store_mib": db.stat().st_size / 2**20,
        "cold_healthz_seconds": cold["healthz_seconds"],
        **warm,
        "target_seconds": TARGETS["warm_seconds"],
        "target_blocks": TARGETS["warm_blocks"],
    }


def time_start(
    workdir: Path,
    names: Sequence[str],
    endpoints: Sequence[tuple[str, str]],
    store: str,
    blocks: int | None,
    sizes: Sizes,
    tag: str,
) -> dict[str, Any]:
    """Seconds from `kvindex serve`'s start to /healthz ok (and to all `blocks` counted)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve(workdir, names, endpoints, store, tag, f"127.0.0.1:{port}", wait=False) as srv:
        start = srv.child.started
        healthy = wait_for("/healthz", lambda: healthz_ok(url, srv.child), sizes.timeout, 0.005)
        out: dict[str, Any] = {"healthz_seconds": healthy - start}
        if blocks is not None:

            def all_counted() -> bool:
                return sum(int(view["blocks"]) for view in instances(url)) == blocks

            counted = wait_for("every block counted", all_counted, sizes.timeout, 0.005)
            out["blocks_listed_seconds"] = counted - start
            srv.wait_url(10)
            out["serve_says"] = srv.banner.split("(", 1)[-1].rstrip(")")
    return out


def healthz_ok(url: str, c: Child) -> bool:
    if c.proc.poll() is not None:
        raise BenchError(f"serve exited with {c.proc.returncode}; {c.tail()}")
    try:
        return bool(http_json(url, "/healthz").get("status") == "ok")
    except (OSError, BenchError, http.client.HTTPException):
        return False


# -- the suite -------------------------------------------------------------------------------


class _Runner:
    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def run(self, key: str, case: Callable[[], dict[str, Any]]) -> None:
        """Run one case; a failure is recorded (with its traceback) and the next runs."""
        started = time.monotonic()
        try:
            self.results[key] = case()
        except Exception as exc:
            tb = traceback.format_exc(limit=4)
            self.results[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}
        self.results[key]["case_seconds"] = time.monotonic() - started


def run_e2e(quick: bool, workdir: Path, smoke: bool = False) -> dict[str, Any]:
    """Every end-to-end case; one key per case (see the module's docstring)."""
    sizes = sizes_for(quick, smoke)
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    work = steady_state(sizes, workdir)
    run = _Runner()
    run.results["e2e_workload"] = {
        "instances": len(work.names),
        "warmup_batches": work.warmup,
        "batches": work.measured,
        "block_events": work.events,
        "prepare_seconds": time.monotonic() - started,
    }
    run.run("e2e_naive", lambda: case_naive(work, sizes, workdir))
    run.run("e2e_ingest_memory", lambda: case_ingest(work, sizes, workdir, "memory", "memory"))
    sqlite = f"sqlite:///{workdir / 'ingest.sqlite'}"
    run.run("e2e_ingest_sqlite", lambda: case_ingest(work, sizes, workdir, sqlite, "sqlite"))
    run.run("e2e_ingest_redis", lambda: case_redis(work, sizes, workdir))
    pair: list[dict[str, Any]] = []

    def lookup() -> dict[str, Any]:
        pair.extend(case_lookup_and_fresh(work, sizes, workdir))
        return pair[0]

    run.run("e2e_lookup_http", lookup)
    failed = run.results["e2e_lookup_http"].get("error", "not run")
    run.results["e2e_freshness"] = pair[1] if pair else {"error": failed}
    run.run("e2e_warm_restart", lambda: case_warm(sizes, workdir))
    run.results["e2e_seconds"] = time.monotonic() - started
    return run.results


# -- the table -------------------------------------------------------------------------------


def table_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(case, kvindex, baseline, target) rows for the bench table."""
    memory = results.get("e2e_ingest_memory", {})
    vs_memory = _rate(memory, "serve, memory store")
    return [
        (
            "e2e ingest: ZMQ -> serve, memory store (block events/s)",
            _ingest(memory),
            _rate(results.get("e2e_naive", {}), "naive SUB consumer"),
            ">= 0.8 M/s",
        ),
        (
            "e2e ingest: ZMQ -> serve, SQLite store (until committed)",
            _ingest(results.get("e2e_ingest_sqlite", {})),
            vs_memory,
            ">= 0.5 M/s",
        ),
        (
            "e2e ingest: ZMQ -> serve, Redis store (until in Redis)",
            _ingest(results.get("e2e_ingest_redis", {})),
            vs_memory,
            ">= 0.3 M/s",
        ),
        _lookup_row(results.get("e2e_lookup_http", {})),
        _fresh_row(results.get("e2e_freshness", {})),
        _warm_row(results.get("e2e_warm_restart", {})),
    ]


def _failed(case: dict[str, Any]) -> str | None:
    if not case:
        return "not run"
    if "error" in case:
        return f"failed: {str(case['error'])[:160]}"
    if "skipped" in case:
        return f"skipped: {case['skipped']}"
    return None


def _rate(case: dict[str, Any], label: str) -> str:
    return _failed(case) or f"{label} {case['per_s'] / 1e6:.2f} M/s"


def _ingest(case: dict[str, Any]) -> str:
    failed = _failed(case)
    if failed:
        return failed
    text = f"{case['per_s'] / 1e6:.2f} M/s"
    if "persist_lag_seconds" in case:
        text += f" (applied {case['applied_per_s'] / 1e6:.2f} M/s)"
    trouble = [f"{k} {case[k]}" for k in ("gaps", "replayed_batches", "lost_batches") if case[k]]
    if not case["exact"]:
        trouble.append("NOT EXACT")
    return text + (f" [{', '.join(trouble)}]" if trouble else "")


def _lookup_row(case: dict[str, Any]) -> tuple[str, str, str, str]:
    name = "e2e POST /v1/lookup, 512-block prompt, during ingest at 200k/s"
    target = "p99 <= 2 ms"
    failed = _failed(case)
    if failed:
        return (name, failed, "-", target)
    loaded, idle = case["loaded"], case["idle"]
    ours = f"p50 {loaded['p50_ms']:.2f} ms, p99 {loaded['p99_ms']:.2f} ms"
    ours += f" (load {case['load_achieved_per_s'] / 1e3:.0f}k/s)"
    if not case["answers_correct"]:
        ours += " [WRONG ANSWERS]"
    return (name, ours, f"idle: p50 {idle['p50_ms']:.2f} ms, p99 {idle['p99_ms']:.2f} ms", target)


def _fresh_row(case: dict[str, Any]) -> tuple[str, str, str, str]:
    name = "e2e freshness: publish -> visible over HTTP, at 100k/s"
    target = "p99 <= 10 ms"
    failed = _failed(case)
    if failed:
        return (name, failed, "-", target)
    ours = f"p50 {case['p50_ms']:.2f} ms, p99 {case['p99_ms']:.2f} ms"
    missing = case["markers"] - case["markers_seen"]
    if missing:
        ours += f" [{missing} markers never seen]"
    return (name, ours, f"resolution {case['resolution_ms']:.2f} ms (one poll)", target)


def _warm_row(case: dict[str, Any]) -> tuple[str, str, str, str]:
    target = "<= 3 s (1M blocks)"
    name = f"e2e warm restart: serve on a {case.get('blocks', 0):,}-block SQLite store"
    failed = _failed(case)
    if failed:
        return (name, failed, "-", target)
    ours = f"{case['healthz_seconds']:.2f} s to healthz"
    ours += f", {case['blocks_listed_seconds']:.2f} s to all blocks counted"
    return (name, ours, f"empty memory store: {case['cold_healthz_seconds']:.2f} s", target)


# -- the children's side ---------------------------------------------------------------------


def child_main(argv: list[str]) -> None:
    """`bench_child(role, ...)`'s entry point, in the child process."""
    role, args = argv[0], argv[1:]
    if role == "publish":
        publish_main(args[0], int(args[1]))
    elif role == "naive":
        naive_main(json.loads(args[0]), int(args[1]), int(args[2]), float(args[3]))
    elif role == "lookups":
        lookups_main(args[0], Path(args[1]), int(args[2]), float(args[3]))
    elif role == "fresh":
        fresh_main(args[0], int(args[1]), args[2], float(args[3]))
    else:
        raise SystemExit(f"unknown bench child {role!r}")


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def publish_main(items_file: str, count: int) -> None:
    """Publishers on free loopback ports, sending what stdin's commands say."""
    from kvindex.wire.publisher import Publisher

    items = read_items(items_file)
    room = len(items) + 100_000  # the replay buffer can answer for the whole run
    pubs = [
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", hwm=0, buffer_steps=room)
        for _ in range(count)
    ]
    say({"op": "endpoints", "endpoints": [[p.endpoint, p.replay_endpoint] for p in pubs]})
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    stop = threading.Event()
    threading.Thread(target=_read_commands, args=(commands, stop), daemon=True).start()
    sender = _Sender(pubs, items, stop)
    try:
        while (command := commands.get())["op"] != "exit":
            sender.handle(command)
    finally:
        for p in pubs:
            p.close()


def _read_commands(commands: queue.Queue[dict[str, Any]], stop: threading.Event) -> None:
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "stop":
            stop.set()
        else:
            commands.put(command)
    stop.set()
    commands.put({"op": "exit"})


class _Sender:
    def __init__(self, pubs: list[Any], items: list[Item], stop: threading.Event) -> None:
        self.pubs = pubs
        self.items = items
        self.cursor = 0
        self.stop = stop

    def next_seqs(self) -> list[int]:
        return [int(p.next_seq) for p in self.pubs]

    def handle(self, command: dict[str, Any]) -> None:
        op = command["op"]
        if op == "burst":
            self.burst(command.get("count"), command.get("file"))
        elif op == "paced":
            self.stop.clear()
            self.paced(command)
        elif op == "stats":
            say({"op": "stats", "replays_served": sum(p.replays_served for p in self.pubs)})

    def burst(self, count: int | None, file: str | None) -> None:
        if file:
            items = read_items(file)
        else:
            end = len(self.items) if count is None else self.cursor + count
            items, self.cursor = self.items[self.cursor : end], min(end, len(self.items))
        pubs = self.pubs
        t0 = time.time()
        for idx, payload in items:
            pubs[idx].publish_payload(payload)
        t1 = time.time()
        say(
            {
                "op": "burst",
                "t0": t0,
                "t1": t1,
                "batches": len(items),
                "next_seqs": self.next_seqs(),
            }
        )

    def paced(self, command: dict[str, Any]) -> None:
        """Send `rate` batches/s for `seconds` (or until stopped or out of items), in
        slices of about half a millisecond; and `markers` marker batches on the first
        publisher, one every `marker_every` seconds, each send stamped."""
        rate, seconds = float(command["rate"]), float(command["seconds"])
        markers, every = int(command["markers"]), float(command["marker_every"])
        stamps: list[float] = []
        sent, items, pubs = 0, self.items, self.pubs
        t0, m0 = time.time(), time.monotonic()
        say({"op": "started", "t0": t0})
        while not self.stop.is_set():
            elapsed = time.monotonic() - m0
            if elapsed >= seconds or (self.cursor >= len(items) and len(stamps) >= markers):
                break
            if len(stamps) < markers and elapsed >= (len(stamps) + 0.5) * every:
                payload = marker_payload(len(stamps))
                stamps.append(time.time())
                pubs[0].publish_payload(payload)
            while sent < rate * elapsed and self.cursor < len(items):
                idx, payload = items[self.cursor]
                pubs[idx].publish_payload(payload)
                self.cursor += 1
                sent += 1
            time.sleep(0.0005)
        exhausted = self.cursor >= len(items)
        done = {"t0": t0, "t1": time.time(), "batches": sent, "markers": stamps}
        say({"op": "paced", **done, "exhausted": exhausted, "next_seqs": self.next_seqs()})


def naive_main(endpoints: list[str], warmup: int, total: int, timeout: float) -> None:
    """The naive consumer: SUB sockets, untyped msgspec decode, a dict of sets. Says
    `warm` once `warmup` batches arrived and `done` (with its end time) after `total`."""
    import zmq

    from kvindex.wire import render_hash

    ctx: Any = zmq.Context.instance()
    socks = []
    for endpoint in endpoints:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        socks.append(sock)
    time.sleep(0.5)  # the subscriptions reach the publishers
    say({"op": "ready"})
    naive = _Naive(socks)
    deadline = time.monotonic() + timeout
    naive.receive(warmup, deadline)
    say({"op": "warm"})
    naive.receive(total, deadline)
    t_done = time.time()
    blocks = [sorted(render_hash(h) for h in held) for held in naive.blocks]
    say(
        {
            "op": "done",
            "t_done": t_done,
            "received": naive.received,
            "gaps": naive.gaps,
            "blocks": blocks,
        }
    )
    for sock in socks:
        sock.close(linger=0)


class _Naive:
    def __init__(self, socks: list[Any]) -> None:
        import zmq

        self.socks = socks
        self.poller = zmq.Poller()
        for sock in socks:
            self.poller.register(sock, zmq.POLLIN)
        self.where = {sock: i for i, sock in enumerate(socks)}
        self.blocks: list[set[Any]] = [set() for _ in socks]
        self.next_seq = [0] * len(socks)
        self.received = 0
        self.gaps = 0

    def receive(self, until: int, deadline: float) -> None:
        """Until `until` batches in all have arrived (or the deadline passed)."""
        import zmq

        decode, again = msgspec.msgpack.decode, zmq.Again
        while self.received < until and time.monotonic() < deadline:
            for sock, _ in self.poller.poll(100):
                i = self.where[sock]
                held = self.blocks[i]
                while self.received < until:
                    try:
                        _topic, seq_bytes, payload = sock.recv_multipart(zmq.NOBLOCK)
                    except again:
                        break
                    seq = int.from_bytes(seq_bytes, "big")
                    self.gaps += seq != self.next_seq[i]
                    self.next_seq[i] = seq + 1
                    self.received += 1
                    for event in decode(payload)[1]:
                        kind = event["type"]
                        if kind == "BlockStored":
                            held.update(event["block_hashes"])
                        elif kind == "BlockRemoved":
                            held.difference_update(event["block_hashes"])
                        elif kind == "AllBlocksCleared":
                            held.clear()


def lookups_main(url: str, prompts_file: Path, count: int, interval: float) -> None:
    """`count` lookups, one every `interval` seconds (lookup i asks prompt i % P)."""
    prompts = msgspec.msgpack.decode(prompts_file.read_bytes(), type=list[list[int]])
    bodies = [msgspec.json.encode({"token_ids": p}) for p in prompts]
    conn = connect(url)
    for body in bodies[:3]:  # warm the connection and the handler up
        request(conn, "POST", "/v1/lookup", body)
    say({"op": "ready"})
    sys.stdin.readline()  # go
    latencies: list[float] = []
    answers: list[dict[str, int]] = []
    clock = time.perf_counter
    next_at = clock()
    for i in range(count):
        pause = next_at - clock()
        if pause > 0:
            time.sleep(pause)
        next_at = max(next_at + interval, clock())
        start = clock()
        answer = request(conn, "POST", "/v1/lookup", bodies[i % len(bodies)])
        latencies.append(clock() - start)
        answers.append({row["name"]: row["matched_blocks"] for row in answer["instances"]})
    conn.close()
    say({"op": "done", "latencies": latencies, "answers": answers})


def fresh_main(url: str, count: int, instance: str, timeout: float) -> None:
    """Poll for the marker chain; stamp each marker when an answer first shows it."""
    hashes = [str(MARKER_BASE + j) for j in range(count)]
    conn = connect(url)
    request(conn, "POST", "/v1/lookup/hashes", msgspec.json.encode({"block_hashes": hashes[:1]}))
    say({"op": "ready"})
    seen: list[float | None] = [None] * count
    cycles: list[float] = []
    k = 0
    deadline = time.monotonic() + timeout
    while k < count and time.monotonic() < deadline:
        body = msgspec.json.encode({"block_hashes": hashes[k : k + 64]})
        sent = time.time()
        answer = request(conn, "POST", "/v1/lookup/hashes", body)
        now = time.time()
        cycles.append(now - sent + FRESH_PAUSE)
        rows = [r["matched_blocks"] for r in answer["instances"] if r["name"] == instance]
        visible = rows[0] if rows else 0
        seen[k : k + visible] = [now] * visible
        k += visible
        time.sleep(FRESH_PAUSE)
    conn.close()
    cycle = percentile(sorted(cycles), 0.5) if cycles else 0.0
    say({"op": "done", "seen": seen, "cycle_p50": cycle, "polls": len(cycles)})
