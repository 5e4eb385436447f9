"""The end-to-end cases, run in order: ingest (`ingest`), lookups beside Dynamo (`lookup`),
freshness and warm restart (here), a router's requests (`routing`). See the package's
docstring for how each is measured."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvindex.bench.e2e.chat import chat_case
from kvindex.bench.e2e.dynamo import standalone_status
from kvindex.bench.e2e.ingest import ingest_cases, workers_case
from kvindex.bench.e2e.lookup import LOAD_RATE, lookup_case
from kvindex.bench.e2e.probes import (
    BenchError,
    counters,
    free_port,
    instances,
    wait_applied,
    wait_for,
    wait_live,
    wait_persisted,
)
from kvindex.bench.e2e.procs import Publishers, bench_child, child, healthz_ok, publishers, serve
from kvindex.bench.e2e.routing import routing_case
from kvindex.bench.e2e.runs import attempt, summarize_ms
from kvindex.bench.e2e.streams import SteadyStream, filled, steady_state, warm_items, write_items
from kvindex.bench.plan import EndToEnd, Plan
from kvindex.bench.workloads import FillSpec

__all__ = ["TARGETS", "ingest_workers_case", "lookup_run", "run_e2e"]

FRESH_RATE = 100_000  # block events/s while freshness is measured

TARGETS = {
    "fresh_p99_ms": 10.0,
    "warm_seconds": 1.0,  # issue 13: a 1M-block SQLite store to healthz in at most 1 s
    "warm_blocks": 1_000_000,
}


def run_e2e(plan: Plan, workdir: Path, dynamo: bool = True) -> dict[str, Any]:
    """Every end-to-end case of `plan`; one key per case (see the package's docstring).
    Dynamo's standalone indexer is the peer unless `dynamo` is False or it can't run."""
    sizes = plan.e2e
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    peer = standalone_status() if dynamo else {"available": False, "reason": "--no-dynamo"}
    if not peer["available"]:
        print(f"[bench] Dynamo's standalone indexer: skipped ({peer['reason']})", file=sys.stderr)
    results: dict[str, Any] = {"e2e_peer": peer}
    work = steady_state(sizes.ingest_instances, sizes.ingest_events, workdir, "ingest")
    results["e2e_workload"] = {
        "instances": len(work.names),
        "warmup_batches": work.warmup,
        "batches": work.measured,
        "block_events": work.events,
        "wire_events": work.wire_total - work.wire_warmup,  # vLLM events, measured part
        "wire_events_warmup": work.wire_warmup,
        "runs": sizes.ingest_runs,
        "prepare_seconds": time.monotonic() - started,
    }
    results |= ingest_cases(work, sizes, workdir, peer)
    results["e2e_ingest_workers"] = attempt(lambda: workers_case(work, sizes, workdir))
    results["e2e_lookup"] = attempt(lambda: lookup_run(sizes, workdir, peer))
    results["e2e_freshness"] = attempt(lambda: case_fresh(sizes, workdir))
    results["e2e_warm_restart"] = attempt(lambda: case_warm(sizes, workdir))
    results["e2e_routing"] = attempt(lambda: routing_case(sizes, workdir))
    results["e2e_chat_lookup"] = chat_case(sizes, workdir)
    results["e2e_seconds"] = time.monotonic() - started
    return results


def lookup_run(sizes: EndToEnd, workdir: Path, peer: dict[str, Any]) -> dict[str, Any]:
    """The fill and the stream of the lookup case, then the case."""
    started = time.monotonic()
    fleet = filled(FillSpec(sizes.lookup_instances, sizes.lookup_blocks), sizes.prompts)
    # The loaded phase paces this stream at 200k/s while the lookups run; three times
    # their nominal duration leaves room for lookups that take longer than their interval
    # (a stream that runs out anyway is said in the results and the table).
    events = int(3 * LOAD_RATE * sizes.lookups * sizes.lookup_interval)
    load = steady_state(sizes.lookup_instances, max(events, 1_000), workdir, "lookup")
    prepared = time.monotonic() - started
    return {"prepare_seconds": prepared, **lookup_case(fleet, load, sizes, workdir, peer)}


# -- freshness -----------------------------------------------------------------------------


def case_fresh(sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    """On a memory-store serve in steady state: markers under a 100k/s stream."""
    events = int(1.3 * FRESH_RATE * sizes.fresh_seconds)
    work = steady_state(sizes.fresh_instances, events, workdir, "fresh")
    with (
        publishers(workdir, work.path, len(work.names), "fresh") as pub,
        serve(workdir, work.names, pub.endpoints, "memory", "fresh") as srv,
    ):
        wait_live(srv.url, sizes.timeout)
        sent = pub.burst(sizes.timeout, count=work.warmup)
        wait_applied(srv.url, work.names, sent["next_seqs"], sizes.timeout)
        fresh = fresh_phase(srv.url, pub, work, sizes, workdir)
        fresh["counters"] = counters(srv.url)
    return fresh


def fresh_phase(
    url: str, pub: Publishers, work: SteadyStream, sizes: EndToEnd, workdir: Path
) -> dict[str, Any]:
    count = int(sizes.fresh_seconds / sizes.marker_every)
    args = bench_child("fresh", url, str(count), work.names[0], str(sizes.fresh_seconds + 20))
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
    load_seconds = paced["t1"] - paced["t0"]
    return {
        "markers": len(sent_at),
        "markers_seen": len(latencies),
        **summarize_ms(latencies),
        "worst": [(round(t - paced["t0"], 3), round(ms * 1e3, 2)) for t, ms in worst],
        "resolution_ms": seen["cycle_p50"] * 1e3,
        "polls": seen["polls"],
        "load_target_per_s": FRESH_RATE,
        "load_achieved_per_s": paced["batches"] * work.events_per_batch / load_seconds,
        "load_seconds": load_seconds,
        "load_ran_out": paced["exhausted"],
        "p99_target_ms": TARGETS["fresh_p99_ms"],
    }


# -- case 5: warm restart ------------------------------------------------------------------


def case_warm(sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
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
        # Alternated, best of N each: the start on an empty memory store (what any start
        # costs), on the store as serve loads it (the snapshot read in C), and on the store
        # with the snapshot read in Python (KVINDEX_SNAPSHOT_LOAD=python, the loader before).
        python = dict(os.environ, KVINDEX_SNAPSHOT_LOAD="python")
        starts: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": [], "python": []}
        for r in range(max(1, sizes.ingest_runs)):
            starts["cold"].append(
                time_start(workdir, names, pub.endpoints, "memory", None, sizes, f"cold-{r}")
            )
            starts["warm"].append(
                time_start(
                    workdir, names, pub.endpoints, store, sizes.warm_blocks, sizes, f"warm-{r}"
                )
            )
            starts["python"].append(
                time_start(
                    workdir,
                    names,
                    pub.endpoints,
                    store,
                    sizes.warm_blocks,
                    sizes,
                    f"warm-python-{r}",
                    env=python,
                )
            )
    best = {k: min(runs, key=lambda s: float(s["healthz_seconds"])) for k, runs in starts.items()}
    healthz = float(best["warm"]["healthz_seconds"])
    return {
        "blocks": sizes.warm_blocks,
        "build_seconds": built,
        "store_mib": db.stat().st_size / 2**20,
        "cold_healthz_seconds": best["cold"]["healthz_seconds"],
        **best["warm"],
        "healthz_runs_seconds": [s["healthz_seconds"] for s in starts["warm"]],
        "python_healthz_seconds": best["python"]["healthz_seconds"],
        "python_blocks_listed_seconds": best["python"]["blocks_listed_seconds"],
        "python_healthz_runs_seconds": [s["healthz_seconds"] for s in starts["python"]],
        "target_seconds": TARGETS["warm_seconds"],
        "target_blocks": TARGETS["warm_blocks"],
        "meets_target": sizes.warm_blocks >= TARGETS["warm_blocks"]
        and healthz <= TARGETS["warm_seconds"],
    }


def time_start(
    workdir: Path,
    names: Sequence[str],
    endpoints: Sequence[tuple[str, str]],
    store: str,
    blocks: int | None,
    sizes: EndToEnd,
    tag: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Seconds from `kvindex serve`'s start to /healthz ok (and to all `blocks` counted)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    http = f"127.0.0.1:{port}"
    with serve(workdir, names, endpoints, store, tag, http, wait=False, env=env) as srv:
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


def ingest_workers_case(sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    """The ingest-workers case alone (`--only ingest_workers`), on its own stream."""
    work = steady_state(sizes.ingest_instances, sizes.ingest_events, workdir, "ingest")
    return workers_case(work, sizes, workdir)
