"""The end-to-end cases themselves (see the package's docstring for how each is measured)."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvindex.bench.common import percentile, redis_server
from kvindex.bench.e2e.probes import (
    BenchError,
    counters,
    free_port,
    instances,
    lookup_metric,
    rss_mib,
    served_blocks,
    wait_applied,
    wait_for,
    wait_live,
    wait_persisted,
)
from kvindex.bench.e2e.procs import (
    Publishers,
    Serve,
    bench_child,
    child,
    healthz_ok,
    publishers,
    serve,
)
from kvindex.bench.e2e.streams import (
    PROMPT_BLOCKS,
    Staged,
    Workload,
    staged_prompts,
    steady_state,
    warm_items,
    write_items,
)
from kvindex.bench.plan import EndToEnd, Plan

__all__ = ["TARGETS", "run_e2e"]

LOAD_RATE = 200_000  # block events/s while lookups run (case 3)
FRESH_RATE = 100_000  # block events/s while freshness is measured (case 4)

TARGETS = {
    "ingest_memory_per_s": 800_000,
    "ingest_sqlite_per_s": 500_000,
    "ingest_redis_per_s": 300_000,
    "lookup_p99_ms": 2.0,
    "fresh_p99_ms": 10.0,
    "warm_seconds": 3.0,
    "warm_blocks": 1_000_000,
}

# -- cases 1 and 2: ingest -------------------------------------------------------------------


def case_naive(work: Workload, sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
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


def case_ingest(work: Workload, sizes: EndToEnd, workdir: Path, store: str, kind: str) -> Any:
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


def case_redis(work: Workload, sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
    with redis_server(workdir) as url:
        if url is None:
            return {"skipped": "redis-server is not installed"}
        result: dict[str, Any] = case_ingest(work, sizes, workdir, url, "redis")
        return result


# -- cases 3 and 4: lookups and freshness while ingesting ------------------------------------


def case_lookup_and_fresh(work: Workload, sizes: EndToEnd, workdir: Path) -> tuple[Any, Any]:
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
    sizes: EndToEnd,
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
    sizes: EndToEnd,
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
    srv: Serve, pub: Publishers, work: Workload, sizes: EndToEnd, workdir: Path
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
    sizes: EndToEnd,
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


def run_e2e(plan: Plan, workdir: Path) -> dict[str, Any]:
    """Every end-to-end case of `plan`; one key per case (see the package's docstring)."""
    sizes = plan.e2e
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
