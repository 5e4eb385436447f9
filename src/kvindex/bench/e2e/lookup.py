"""The end-to-end lookup case: `POST /v1/lookup` on `kvindex serve` beside `POST /query` on
Dynamo's standalone indexer, on the same filled fleet, idle and under a 200k/s stream.

For each of the two, in turn (never both at once: on a small machine they would take each
other's cores), a fresh publisher child with one publisher per instance sends the
simulator's steady-state warm-up, then the fill (`workloads.fill`: every instance holding
`lookup_blocks` blocks of shared system prompts, documents and conversations, as vLLM 0.33
publishes them), and the indexer takes it all in. Then a client child times, on one
keep-alive connection:

- `gets` empty GETs (`/healthz`, Dynamo's `/health`): the HTTP floor (idle only);
- `lookups` lookups of 512-block prompts (`workloads.prompts`: half shared documents, half
  conversations), one every `lookup_interval` seconds, on the idle indexer;
- the same while the publisher child sends the steady-state stream at 200k block events/s.

Every answer is checked against the truth: how many blocks of each prompt each instance
holds, from the fill itself. The resident-set growth of the indexer's process over the
fill, divided by its entries, is the memory per (instance, block) entry it paid.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvindex.bench.e2e.dynamo import standalone, worker_id
from kvindex.bench.e2e.probes import (
    counters,
    heap_bytes,
    lookup_metric,
    rss_mib,
    stages_between,
    thread_stages,
    wait_applied,
    wait_live,
)
from kvindex.bench.e2e.procs import Publishers, bench_child, child, publishers, serve
from kvindex.bench.e2e.runs import attempt, summarize_ms
from kvindex.bench.e2e.streams import Filled, SteadyStream, wire_events, write_items
from kvindex.bench.plan import EndToEnd

__all__ = ["LOAD_RATE", "TARGETS", "lookup_case"]

LOAD_RATE = 200_000  # block events/s while the loaded phase runs
# Issue 13: p50 at most half of Dynamo's `/query`, idle and loaded; issue 23: the loaded
# p99 at most 0.8x Dynamo's (the older absolute target on it, 2 ms, stays beside).
TARGETS = {"p50_vs_dynamo": 0.5, "loaded_p99_vs_dynamo": 0.8, "loaded_p99_ms": 2.0}


@dataclass(slots=True)
class Indexer:
    """What the case needs of an indexer under test."""

    api: str  # "kvindex" or "dynamo": which requests the client child sends
    url: str
    keys: list[str]  # each instance's key in the client's answers
    # (each publisher's next seq, vLLM events sent so far) -> when all of it was applied
    wait: Callable[[list[int], int], float]
    rss: Callable[[], float | None]
    extra: Callable[[], dict[str, Any]]  # counters worth keeping, read at the end
    name: str = ""  # the variant measured (STARTS' key), for its logs
    # the allocators' own statistics (kvindex.runtime.heap: core, malloc, pymalloc, total)
    heap: Callable[[], dict[str, float]] = dict


@dataclass(slots=True)
class Files:
    fill: Path
    prompts: Path


def lookup_case(
    fleet: Filled, load: SteadyStream, sizes: EndToEnd, workdir: Path, peer: dict[str, Any]
) -> dict[str, Any]:
    """Both indexers, one after the other, on the same fill, prompts and stream."""
    files = Files(workdir / "fill.msgpack", workdir / "prompts.msgpack")
    write_items(files.fill, fleet.items)
    files.prompts.write_bytes(msgspec.msgpack.encode(fleet.prompts))
    out: dict[str, Any] = {
        "instances": fleet.spec.instances,
        "per_instance": fleet.spec.per_instance,
        "entries": fleet.entries,
        "prompts": len(fleet.prompts),
        "lookups": sizes.lookups,
        "gets": sizes.gets,
        "load_target_per_s": LOAD_RATE,
        "targets": TARGETS,
    }
    out["kvindex"] = attempt(lambda: _measure("kvindex", fleet, load, sizes, files, workdir))
    # The same serve with every lookup answered in Python (no C lookup thread): what the
    # thread saves, measured in the same run.
    out["kvindex_python"] = attempt(
        lambda: _measure("kvindex_python", fleet, load, sizes, files, workdir)
    )
    if peer.get("available"):
        out["dynamo"] = attempt(lambda: _measure("dynamo", fleet, load, sizes, files, workdir))
    else:
        out["dynamo"] = {"skipped": peer.get("reason", "not available")}
    _compare(out)
    return out


def _compare(out: dict[str, Any]) -> None:
    """kvindex's p50 and p99 as ratios to Dynamo's, per phase, and the targets."""
    ours, theirs, python = out["kvindex"], out["dynamo"], out.get("kvindex_python", {})
    for phase in ("idle", "loaded", "floor_idle"):
        if phase in ours and phase in theirs:
            ours[phase]["p50_vs_dynamo"] = ours[phase]["p50_ms"] / theirs[phase]["p50_ms"]
            ours[phase]["p99_vs_dynamo"] = ours[phase]["p99_ms"] / theirs[phase]["p99_ms"]
        if phase in ours and phase in python:
            ours[phase]["p50_vs_python"] = ours[phase]["p50_ms"] / python[phase]["p50_ms"]
            ours[phase]["p99_vs_python"] = ours[phase]["p99_ms"] / python[phase]["p99_ms"]
    if "idle" in ours and "loaded" in ours:
        within = [
            ours[p].get("p50_vs_dynamo", float("inf")) <= TARGETS["p50_vs_dynamo"]
            for p in ("idle", "loaded")
        ]
        ours["meets_target"] = all(within)
        ours["loaded_p99_meets_target"] = ours["loaded"]["p99_ms"] <= TARGETS["loaded_p99_ms"]
        p99 = ours["loaded"].get("p99_vs_dynamo")
        if p99 is not None:
            ours["loaded_p99_meets_ratio_target"] = p99 <= TARGETS["loaded_p99_vs_dynamo"]
    if ours.get("bytes_per_entry") and theirs.get("bytes_per_entry"):
        ours["memory_vs_dynamo"] = ours["bytes_per_entry"] / theirs["bytes_per_entry"]
    if ours.get("heap_bytes_per_entry") and theirs.get("bytes_per_entry"):
        # Dynamo's own allocator says nothing from outside: its resident set is the figure
        ours["heap_vs_dynamo"] = ours["heap_bytes_per_entry"] / theirs["bytes_per_entry"]


@contextmanager
def _kvindex(
    pub: Publishers,
    names: list[str],
    sizes: EndToEnd,
    workdir: Path,
    options: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[Indexer]:
    tag = "lookup-python" if options else "lookup"
    with serve(workdir, names, pub.endpoints, "memory", tag, options=options, env=env) as srv:
        wait_live(srv.url, sizes.timeout)

        def wait(next_seqs: list[int], _events: int) -> float:
            return wait_applied(srv.url, names, next_seqs, sizes.timeout)

        yield Indexer(
            "kvindex",
            srv.url,
            list(names),
            wait,
            lambda: rss_mib(srv.child.proc.pid),
            lambda: {"counters": counters(srv.url)},
            heap=lambda: heap_bytes(srv.url),
        )


@contextmanager
def _dynamo(pub: Publishers, names: list[str], sizes: EndToEnd, workdir: Path) -> Iterator[Indexer]:
    with standalone(workdir, pub.endpoints, "lookup", sizes.timeout) as peer:

        def wait(_next_seqs: list[int], events: int) -> float:
            return peer.wait_applied(events, sizes.timeout)

        yield Indexer(
            "dynamo",
            peer.url,
            [str(worker_id(i)) for i in range(len(names))],
            wait,
            peer.rss_mib,
            lambda: {"events_applied": peer.applied(), "refused_events": peer.refused()},
        )


Start = Callable[[Publishers, list[str], EndToEnd, Path], AbstractContextManager[Indexer]]
STARTS: dict[str, Start] = {
    "kvindex": _kvindex,
    "kvindex_python": functools.partial(_kvindex, options=("--lookup-thread", "off")),
    "dynamo": _dynamo,
}


def _measure(
    api: str, fleet: Filled, load: SteadyStream, sizes: EndToEnd, files: Files, workdir: Path
) -> dict[str, Any]:
    with (
        publishers(workdir, load.path, len(load.names), f"lookup-{api}") as pub,
        STARTS[api](pub, load.names, sizes, workdir) as idx,
    ):
        idx.name = api
        sent = pub.burst(sizes.timeout, count=load.warmup)
        events = load.wire_warmup
        idx.wait(sent["next_seqs"], events)
        rss_before, heap_before = idx.rss(), idx.heap()
        sent = pub.burst(sizes.timeout, file=files.fill)
        events += fleet.wire_events
        filled_at = idx.wait(sent["next_seqs"], events)
        time.sleep(0.5)  # let the allocator settle before reading the resident set
        rss_after, heap_after = idx.rss(), idx.heap()
        idle = _lookups(idx, files, sizes, workdir, "idle")
        loaded = _lookups(idx, files, sizes, workdir, "loaded", pub, load)
        pub.child.send({"op": "stop"})
        paced = pub.child.expect("paced", 60)
        events += wire_events(load.items[load.warmup : load.warmup + paced["batches"]])
        caught_up = idx.wait(paced["next_seqs"], events)
        extra = idx.extra()
    seconds = paced["t1"] - paced["t0"]
    growth = None if rss_before is None or rss_after is None else rss_after - rss_before
    wrong = [_wrong(done["answers"], fleet, idx.keys) for done in (idle, loaded)]
    return {
        "fill_seconds": filled_at - sent["t0"],
        "fill_blocks_per_s": fleet.entries / max(1e-9, filled_at - sent["t0"]),
        "rss_growth_mib": growth,
        "bytes_per_entry": None if growth is None else growth * 2**20 / fleet.entries,
        # The same growth by the allocators' own statistics (what is live, not what the
        # process kept): the heap in use, and the core's C within it.
        "heap_bytes_per_entry": _per_entry(heap_before, heap_after, "total", fleet.entries),
        "core_bytes_per_entry": _per_entry(heap_before, heap_after, "core", fleet.entries),
        "floor_idle": summarize_ms(idle["floor"]),
        "idle": summarize_ms(idle["latencies"], idle.get("in_service_mean_ms")),
        "loaded": summarize_ms(loaded["latencies"], loaded.get("in_service_mean_ms")),
        "thread_stages": {
            phase: done["thread_stages"]
            for phase, done in (("idle", idle), ("loaded", loaded))
            if done.get("thread_stages")
        },
        "load_achieved_per_s": paced["batches"] * load.events_per_batch / seconds,
        "load_seconds": seconds,
        "load_ran_out": paced["exhausted"],
        # How long the indexer took to apply what was sent before the stop (its lag then).
        "catch_up_seconds": None if paced["exhausted"] else max(0.0, caught_up - paced["t1"]),
        "wrong_answers": sum(wrong),
        "exact": sum(wrong) == 0,
        **extra,
    }


def _per_entry(
    before: dict[str, float], after: dict[str, float], key: str, entries: int
) -> float | None:
    if key not in before or key not in after or not entries:
        return None
    return (after[key] - before[key]) / entries


def _lookups(
    idx: Indexer,
    files: Files,
    sizes: EndToEnd,
    workdir: Path,
    tag: str,
    load: Publishers | None = None,
    work: SteadyStream | None = None,
) -> dict[str, Any]:
    """One client child's phase; with `load`, the paced stream starts once the client is
    ready (and runs until the caller stops it). For kvindex, also the mean time serve says
    a lookup took inside (the index walk and the answer, without HTTP and the loop)."""
    gets = 0 if load is not None else sizes.gets  # the floor idle only: the load is for lookups
    args = bench_child(
        "lookups", idx.api, idx.url, str(files.prompts), str(sizes.lookups), str(gets)
    )
    log = workdir / f"lookups-{idx.name or idx.api}-{tag}.log"
    with child([*args, str(sizes.lookup_interval)], log) as c:
        c.expect("ready", 60)
        if load is not None and work is not None:
            load.paced(LOAD_RATE / work.events_per_batch, 3600)
            time.sleep(0.2)  # the indexer's backlog settles at the paced rate
        before = lookup_metric(idx.url) if idx.api == "kvindex" else None
        stages = thread_stages(idx.url) if idx.api == "kvindex" else {}
        c.send({"op": "go"})
        done = c.expect("done", sizes.timeout + sizes.lookups * 0.1)
        if before is not None:
            # where the C lookup thread's answers spent their time (its own clock)
            done["thread_stages"] = stages_between(stages, thread_stages(idx.url))
            after = lookup_metric(idx.url)
            count = after[1] - before[1]
            done["in_service_mean_ms"] = (after[0] - before[0]) / count * 1e3 if count else None
    return done


def _wrong(answers: list[dict[str, int]], fleet: Filled, keys: Sequence[str]) -> int:
    """Answers that differ from the truth (lookup i asks prompt i % P) on any instance."""
    wrong = 0
    for i, answer in enumerate(answers):
        depth = fleet.depth[i % len(fleet.prompts)]
        wrong += [answer.get(key, 0) for key in keys] != depth
    return wrong if answers else 1
