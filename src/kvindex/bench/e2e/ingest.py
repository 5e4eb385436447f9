"""The end-to-end ingest cases: the same steady-state stream from N publishers into the
naive subscriber, `kvindex serve` (memory, SQLite, Redis) and Dynamo's standalone indexer.

Each consumer gets a fresh publisher child with the same items and is timed from the first
send of the measured part until it has applied the last batch (and, for a store, until the
store has committed it). The cases run in rounds (naive, memory, SQLite, Dynamo, then again)
and each keeps its best run, so a disturbance of the shared machine in one round does not
decide a ratio. Redis runs once (it is compared with the memory store only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvindex.bench.common import redis_server
from kvindex.bench.e2e.dynamo import standalone
from kvindex.bench.e2e.probes import (
    children_cpu_seconds,
    counters,
    cpu_per_m_events,
    cpu_seconds,
    ingest_stats,
    rss_mib,
    served_blocks,
    wait_applied,
    wait_live,
    wait_persisted,
)
from kvindex.bench.e2e.procs import bench_child, child, publishers, serve
from kvindex.bench.e2e.runs import attempt, best_run, ingest_figures
from kvindex.bench.e2e.streams import SteadyStream
from kvindex.bench.plan import EndToEnd

__all__ = ["TARGETS", "WORKERS", "ingest_cases", "workers_case"]

# Issue 13: serve ingests at least twice as fast as Dynamo's indexer with the memory store,
# 1.5 times as fast with SQLite (until committed); Redis keeps its absolute target.
TARGETS = {"memory_vs_dynamo": 2.0, "sqlite_vs_dynamo": 1.5, "redis_per_s": 300_000}

Case = Callable[[str], dict[str, Any]]

# The ingest-worker counts measured side by side (`serve --ingest-workers N`): 1, and 2,
# the default on these 2-core machines (one per core; the index then in 2 shards, a worker
# each: serve's default, one shard per worker up to 4).
WORKERS = (1, 2)


def ingest_cases(
    work: SteadyStream, sizes: EndToEnd, workdir: Path, peer: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Every ingest case, by its key in the results."""
    cases: dict[str, Case] = {
        "e2e_naive": lambda tag: case_naive(work, sizes, workdir, tag),
        "e2e_ingest_memory": lambda tag: case_serve(work, sizes, workdir, "memory", tag),
        "e2e_ingest_sqlite": lambda tag: case_serve(
            work, sizes, workdir, f"sqlite:///{workdir / tag}.sqlite", tag
        ),
        # The same serve with every batch through Python (KVINDEX_C_INGEST=0), as SQLite
        # ran before the C path kept the payloads for the stores: the same-run baseline of
        # the row above.
        "e2e_ingest_sqlite_python": lambda tag: case_serve(
            work, sizes, workdir, f"sqlite:///{workdir / tag}.sqlite", tag, c_ingest=False
        ),
    }
    out: dict[str, dict[str, Any]] = {}
    if peer.get("available"):
        cases["e2e_ingest_dynamo"] = lambda tag: case_dynamo(work, sizes, workdir, tag)
    else:
        out["e2e_ingest_dynamo"] = {"skipped": peer.get("reason", "not available")}
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in cases}
    for r in range(max(1, sizes.ingest_runs)):
        for key, case in cases.items():
            runs[key].append(attempt(partial(case, f"{key.removeprefix('e2e_')}-{r}")))
    out |= {key: best_run(found) for key, found in runs.items()}
    out["e2e_ingest_redis"] = attempt(lambda: case_redis(work, sizes, workdir))
    _ratios(out)
    return out


def _ratios(out: dict[str, dict[str, Any]]) -> None:
    """Each serve case's rate as a ratio to Dynamo's, measured in the same run."""
    theirs = out.get("e2e_ingest_dynamo", {}).get("per_s")
    for key, target in (
        ("memory", "memory_vs_dynamo"),
        ("sqlite", "sqlite_vs_dynamo"),
        ("sqlite_python", "sqlite_vs_dynamo"),
    ):
        case = out.get(f"e2e_ingest_{key}", {})
        case["target_vs_dynamo"] = TARGETS[target]
        if theirs and "per_s" in case:
            case["vs_dynamo"] = case["per_s"] / theirs
            case["meets_target"] = case["vs_dynamo"] >= TARGETS[target]
    cpu = out.get("e2e_ingest_dynamo", {}).get("cpu_seconds_per_m_events")
    for key in ("memory", "sqlite", "sqlite_python"):
        case = out.get(f"e2e_ingest_{key}", {})
        if cpu and case.get("serve_cpu_seconds_per_m_events"):
            case["cpu_vs_dynamo"] = case["serve_cpu_seconds_per_m_events"] / cpu


def case_naive(work: SteadyStream, sizes: EndToEnd, workdir: Path, tag: str) -> dict[str, Any]:
    """The baseline: a naive subscriber child receives the same stream."""
    with publishers(workdir, work.path, len(work.names), tag) as pub:
        endpoints = json.dumps([p for p, _ in pub.endpoints])
        args = bench_child("naive", endpoints, str(work.warmup), str(len(work.items)))
        with child([*args, str(sizes.timeout)], workdir / f"{tag}.log") as naive:
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


def workers_case(work: SteadyStream, sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    """The memory-store case with each count of `WORKERS` ingest threads, in interleaved
    rounds (best run each), and the rate of the most workers as a ratio to one worker's."""
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in WORKERS}
    for r in range(max(1, sizes.ingest_runs)):
        for n in WORKERS:
            tag = f"ingest_workers{n}-{r}"
            runs[n].append(attempt(partial(case_serve, work, sizes, workdir, "memory", tag, n)))
    best = {str(n): best_run(found) for n, found in runs.items()}
    out: dict[str, Any] = {"workers": best, "instances": len(work.names)}
    one, most = best[str(WORKERS[0])].get("per_s"), best[str(WORKERS[-1])].get("per_s")
    if one and most:
        out["speedup"] = most / one
    return out


def case_serve(
    work: SteadyStream,
    sizes: EndToEnd,
    workdir: Path,
    store: str,
    tag: str,
    workers: int | None = None,
    c_ingest: bool = True,
) -> Any:
    """The stream into `serve --store STORE` (with `workers` ingest threads, else serve's
    default), as fast as it takes it; with `c_ingest` False, every batch through Python
    (KVINDEX_C_INGEST=0; serve's default is the C path, with every store)."""
    kind = store.split(":", 1)[0]
    options = ["--ingest-workers", str(workers)] if workers else []
    env = None if c_ingest else dict(os.environ, KVINDEX_C_INGEST="0")
    with (
        publishers(workdir, work.path, len(work.names), tag) as pub,
        serve(workdir, work.names, pub.endpoints, store, tag, options=options, env=env) as srv,
    ):
        wait_live(srv.url, sizes.timeout)
        warm = pub.burst(sizes.timeout, count=work.warmup)
        wait_applied(srv.url, work.names, warm["next_seqs"], sizes.timeout)
        rss_before = rss_mib(srv.child.proc.pid)
        cpu_before = cpu_seconds(srv.child.proc.pid)
        worker_before = children_cpu_seconds(srv.child.proc.pid)
        ingest_before = ingest_stats(srv.url)
        sent = pub.burst(sizes.timeout)
        applied = wait_applied(srv.url, work.names, sent["next_seqs"], sizes.timeout)
        # serve's CPU over the burst (its HTTP answers to this bench's polls included; the
        # SQLite writer is a process of its own, not counted).
        cpu = cpu_per_m_events(cpu_before, cpu_seconds(srv.child.proc.pid), work.events)
        ingest = _ingest_delta(ingest_before, ingest_stats(srv.url))
        persisted = wait_persisted(store, work.names, sent["next_seqs"], sizes.timeout)
        # The store's worker process (SQLite's writer, Redis's worker) until it holds all.
        worker_cpu = cpu_per_m_events(
            worker_before, children_cpu_seconds(srv.child.proc.pid), work.events
        )
        out = ingest_figures(work, sent["t0"], applied, persisted)
        out |= counters(srv.url)
        out["exact"] = served_blocks(srv.url, work.names) == work.reference
        # Resident memory before the burst and once it is all applied (the burst is
        # queued in ZeroMQ's buffers meanwhile: the growth is mostly that).
        out["serve_rss_mib"] = {"before": rss_before, "after": rss_mib(srv.child.proc.pid)}
        out["replays_served"] = pub.stats()["replays_served"]
        out["send_seconds"] = sent["t1"] - sent["t0"]
        out["serve_cpu_seconds_per_m_events"] = cpu
        out |= ingest
        if kind != "memory":
            out["store_worker_cpu_seconds_per_m_events"] = worker_cpu
    out["ingest_workers"] = workers or "default"
    out["c_ingest"] = c_ingest
    return {"store": kind, "instances": len(work.names), "batches": work.measured, **out}


def _ingest_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """serve's own ingest counters over the burst (/v1/stats): the batches it applied, how
    many of them the C path took, and its ingest threads' time holding the GIL per batch
    (IngestCounters.gil_seconds: each read and apply's thread CPU time less the C loop's
    time without the GIL)."""
    batches = after["batches"] - before["batches"]
    in_c = after["batches_in_c"] - before["batches_in_c"]
    gil = after["gil_seconds"] - before["gil_seconds"]
    return {
        "serve_batches": batches,
        "serve_batches_in_c": in_c,
        "serve_gil_seconds": gil,
        "serve_gil_us_per_batch": gil / max(1, batches) * 1e6,
        "serve_workers": int(after["workers"]),
        "serve_index_shards": int(after["index_shards"]),
    }


def case_redis(work: SteadyStream, sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    with redis_server(workdir) as url:
        if url is None:
            return {"skipped": "redis-server is not installed"}
        result: dict[str, Any] = case_serve(work, sizes, workdir, url, "ingest_redis")
        return result


def case_dynamo(work: SteadyStream, sizes: EndToEnd, workdir: Path, tag: str) -> dict[str, Any]:
    """The stream into Dynamo's standalone indexer: applied when its applied-events counter
    reaches the events sent; what it holds then (its `/dump`) compared with the truth."""
    with (
        publishers(workdir, work.path, len(work.names), tag) as pub,
        standalone(workdir, pub.endpoints, tag, sizes.timeout) as peer,
    ):
        pub.burst(sizes.timeout, count=work.warmup)
        peer.wait_applied(work.wire_warmup, sizes.timeout)
        rss_before = peer.rss_mib()
        cpu_before = cpu_seconds(peer.pid)
        sent = pub.burst(sizes.timeout)
        applied = peer.wait_applied(work.wire_total, sizes.timeout)
        cpu = cpu_per_m_events(cpu_before, cpu_seconds(peer.pid), work.events)
        out = ingest_figures(work, sent["t0"], applied, None)
        held = peer.held()
        off = sum(
            len(have ^ work.reference[name]) for name, have in zip(work.names, held, strict=True)
        )
        out |= {
            "exact": off == 0,
            "blocks_off": off,  # by its /dump: hashes held that should not be, and missing
            "events_applied": peer.applied(),
            "refused_events": peer.refused(),
            "dynamo_rss_mib": {"before": rss_before, "after": peer.rss_mib()},
            "cpu_seconds_per_m_events": cpu,
            "replays_served": pub.stats()["replays_served"],
            "send_seconds": sent["t1"] - sent["t0"],
        }
    return {"consumer": "dynamo", "instances": len(work.names), "batches": work.measured, **out}
