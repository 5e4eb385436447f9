"""The drain case: ingest timed with nothing else running (issue 23, item 5).

On a 2-core machine the publishers of an end-to-end case compete with ingest for the
cores, so "2 workers vs 1" says as much about the publishers as about ingest. Here the
publishers send their whole stream first, into the SUB sockets' queues (a high-water mark
above the stream), while ingest is paused (the Fleet is made, its sockets connected, its
threads not started); only then is ingest released, and timed until every batch is
applied; the final state is checked against the simulator's pools.

Each configuration runs with the in-order path in C and with it off (`KVINDEX_C_INGEST=0`,
every batch through the Python state machine: the same-run baseline), with 1 and 2 ingest
workers and as many as the machine has, the C path again with the index split by instance,
a shard per worker (`c-2-sharded`: kvindex.index.sharded, nothing written shared between
workers) and two workers a shard (`c-4-in-2-shards`: serve's default where the cores
outnumber its at most 4 shards), and with 1 worker again while a SQLite store
records every batch as `serve` has it do (`c-1-sqlite`, `python-1-sqlite`: the store's
writer is a process of its own, not counted). Besides the rate, each says:

- `cpu_seconds_per_m_events`: the process's CPU time over the drain per million block
  events (the Fleet is what `serve` runs, here in process: no HTTP traffic);
- `gil_us_per_batch`: the ingest threads' CPU time in Python (holding the GIL), measured
  around every read and apply (IngestCounters.gil_seconds), per batch;
- `apply_locked_us_per_batch`: the C path's time applying under the index's one write lock
  (IngestCounters.apply_locked_seconds), per batch: the other part no two workers do at once;
- `serial_fraction`: those two over the drain's CPU time (`gil_fraction` the first alone):
  the part of ingest that can't run on two cores at once, what Amdahl's law takes
  (docs/performance.md). Taken from the 1-worker C run: no lock waits there.

The machine's load average is recorded beside: on a shared 2-core machine the rates move
with it, the CPU figures much less.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvindex.bench.workloads import IngestWorkload
from kvindex.index import COMPILED
from kvindex.index.sharded import ShardedIndex
from kvindex.runtime import Fleet
from kvindex.subscriber import Checkpoint, InstanceSpec, SourceKey
from kvindex.wire.publisher import Publisher

__all__ = ["amdahl", "drain_case"]

_SETTLE_IDLE = 0.02  # process CPU seconds per 0.25 s below which the queues have settled


def drain_case(w: IngestWorkload, rounds: int = 2, timeout: float = 300.0) -> dict[str, Any]:
    """The drain of `w`'s measured stream, per path and worker count (best of `rounds`)."""
    counts = sorted({1, 2, os.cpu_count() or 1})
    paths = ["c", "python"] if COMPILED else ["python"]
    runs: dict[str, dict[str, Any]] = {}
    for path in paths:
        for workers in counts:
            best: dict[str, Any] | None = None
            for _ in range(rounds):
                run = _drain(w, workers, path == "c", timeout)
                if best is None or run["per_s"] > best["per_s"]:
                    best = run
            assert best is not None
            runs[f"{path}-{workers}"] = best
    for workers in counts if COMPILED else []:  # the index split by instance, a shard each
        if workers > 1:
            sharded = [_drain(w, workers, True, timeout, shards=workers) for _ in range(rounds)]
            runs[f"c-{workers}-sharded"] = max(sharded, key=lambda run: run["per_s"])
    if COMPILED:  # two workers a shard: serve's default where the cores outnumber the shards
        doubled = [_drain(w, 4, True, timeout, shards=2) for _ in range(rounds)]
        runs["c-4-in-2-shards"] = max(doubled, key=lambda run: run["per_s"])
    for path in paths:  # with a persistent store recording
        store_runs = [_drain(w, 1, path == "c", timeout, "sqlite") for _ in range(rounds)]
        runs[f"{path}-1-sqlite"] = max(store_runs, key=lambda run: run["per_s"])
    out: dict[str, Any] = {
        "instances": w.spec.instances,
        "batches": len(w.measured),
        "block_events": w.events,
        "workers": counts,
        "runs": runs,
        "cpus": os.cpu_count(),
    }
    for path in paths:
        one, two = runs.get(f"{path}-1"), runs.get(f"{path}-2")
        if one and two:
            out[f"{path}_two_vs_one"] = two["per_s"] / one["per_s"]
    if "c-1" in runs and "c-2-sharded" in runs:
        out["c_sharded_two_vs_one"] = runs["c-2-sharded"]["per_s"] / runs["c-1"]["per_s"]
    if "c-2-sharded" in runs and "c-4-in-2-shards" in runs:
        four, two = runs["c-4-in-2-shards"]["per_s"], runs["c-2-sharded"]["per_s"]
        out["c_two_workers_a_shard_vs_one"] = four / two
    if "c-1" in runs and "python-1" in runs:
        out["c_vs_python"] = runs["c-1"]["per_s"] / runs["python-1"]["per_s"]
        out["c_vs_python_cpu"] = (
            runs["python-1"]["cpu_seconds_per_m_events"] / runs["c-1"]["cpu_seconds_per_m_events"]
        )
    for path in paths:
        one = runs.get(f"{path}-1")
        if one and one["serial_fraction"] is not None:
            serial, gil = one["serial_fraction"], one["gil_fraction"]
            out[f"{path}_amdahl"] = {
                str(n): {"gil_and_lock": amdahl(serial, n), "gil_only": amdahl(gil, n)}
                for n in (2, 16, 64)
            }
    out["load_average"] = os.getloadavg()
    return out


def amdahl(serial: float, cores: int) -> float:
    """The speedup on `cores` of work whose `serial` fraction runs on one at a time."""
    return 1.0 / (serial + (1.0 - serial) / cores)


@contextlib.contextmanager
def _c_ingest(on: bool) -> Iterator[None]:
    old = os.environ.get("KVINDEX_C_INGEST")
    os.environ["KVINDEX_C_INGEST"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["KVINDEX_C_INGEST"]
        else:
            os.environ["KVINDEX_C_INGEST"] = old


def _drain(
    w: IngestWorkload,
    workers: int,
    in_c: bool,
    timeout: float,
    store: str | None = None,
    shards: int = 1,
) -> dict[str, Any]:
    """One drain; `store` "sqlite": a fresh SQLite store records every batch meanwhile;
    `shards` > 1: the index split by instance (kvindex.index.sharded), worker i applying
    into shard i % shards."""
    names = w.names
    per_instance = [0] * len(names)
    warm_next = [0] * len(names)
    for instance, seq, _ in w.warmup:
        warm_next[instance] = max(warm_next[instance], seq + 1)
    for instance, _, _ in w.measured:
        per_instance[instance] += 1
    hwm = max(per_instance) + 1_000
    pubs = [
        Publisher("tcp://127.0.0.1:*", None, hwm=hwm, subscriptions=True, dp_rank=None)
        for _ in names
    ]
    try:
        specs = [
            InstanceSpec(name, pub.endpoint, None) for name, pub in zip(names, pubs, strict=True)
        ]
        resume = {SourceKey(n): Checkpoint(warm_next[i]) for i, n in enumerate(names)}
        index: Any = ShardedIndex(shards) if shards > 1 else None
        with _c_ingest(in_c):
            fleet = Fleet(specs, index=index, ingest_workers=workers, sub_hwm=hwm, resume=resume)
        if store is None:
            return _timed_drain(fleet, w, pubs, per_instance, timeout)
        return _with_sqlite(fleet, w, pubs, per_instance, timeout)
    finally:
        for pub in pubs:
            pub.close()


def _with_sqlite(
    fleet: Fleet, w: IngestWorkload, pubs: list[Publisher], expected: list[int], timeout: float
) -> dict[str, Any]:
    """`_timed_drain` with a SQLite store recording, as `serve` wires one."""
    from kvindex.store.sqlite import SQLiteStore

    with tempfile.TemporaryDirectory(prefix="kvindex-drain-") as tmp:
        store = SQLiteStore(Path(tmp) / "drain.sqlite")
        store.start()
        try:
            fleet.record_into(store.record, store.record_batches)
            fleet.on_read.append(store.flush)
            return _timed_drain(fleet, w, pubs, expected, timeout)
        finally:
            store.close()


def _timed_drain(
    fleet: Fleet, w: IngestWorkload, pubs: list[Publisher], expected: list[int], timeout: float
) -> dict[str, Any]:
    sources = [SourceKey(name) for name in w.names]
    index = fleet.index
    for instance, seq, payload in w.warmup:  # the steady state, applied untimed
        index.apply_payload(sources[instance], payload, seq)
    for pub in pubs:
        pub.wait_for_subscriber()
    for instance, seq, payload in w.measured:
        pubs[instance].put(seq, payload)
    _settle()
    gc.collect()

    stats = [fleet.source_stats(s) for s in sources]
    want = [s.delivered + n for s, n in zip(stats, expected, strict=True)]

    async def drain() -> tuple[float, float]:
        cpu, start = time.process_time(), time.perf_counter()
        await fleet.start()
        deadline = start + timeout
        while any(s.delivered < n for s, n in zip(stats, want, strict=True)):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the drain did not finish within {timeout:g} s")
            await asyncio.sleep(0.002)
        return time.perf_counter() - start, time.process_time() - cpu

    base = fleet.ingest
    try:
        seconds, cpu = asyncio.run(drain())
    finally:
        asyncio.run(fleet.stop())
    ingest = fleet.ingest
    batches = ingest.deliveries - base.deliveries
    gil = ingest.gil_seconds - base.gil_seconds
    locked = ingest.apply_locked_seconds - base.apply_locked_seconds
    held = [index.block_hashes(name) for name in w.names]
    mismatched = sum(len(h ^ t) for h, t in zip(held, w.truth, strict=True))
    stats = [fleet.source_stats(s) for s in sources]
    return {
        "per_s": w.events / seconds,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "cpu_seconds_per_m_events": cpu / w.events * 1e6,
        "batches": batches,
        "batches_in_c": ingest.batches_in_c - base.batches_in_c,
        "gil_seconds": gil,
        "gil_us_per_batch": gil / max(1, batches) * 1e6,
        "apply_locked_us_per_batch": locked / max(1, batches) * 1e6,
        "gil_fraction": min(1.0, gil / cpu) if cpu > 0 else None,
        "serial_fraction": min(1.0, (gil + locked) / cpu) if cpu > 0 else None,
        "lost_batches": sum(s.lost_batches for s in stats),
        "mismatched_blocks": mismatched,
    }


def _settle(limit: float = 30.0) -> None:
    """Wait until ZMQ's I/O threads have moved every queued message into the SUB queues:
    the process's CPU time stops moving."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        cpu = time.process_time()
        time.sleep(0.25)
        if time.process_time() - cpu < _SETTLE_IDLE:
            return
