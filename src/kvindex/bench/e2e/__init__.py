"""The end-to-end cases: real processes, real sockets, `kvindex serve` as users run it,
beside NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`) as the peer.

The package: `streams` (what is published), `procs` (the bench's side of its children),
`programs` (the child programs), `probes` (HTTP and state probes), `runs` (runs into
figures), `dynamo` (the peer), the cases (`ingest`, `lookup`, `routing`, and `cases`:
freshness, warm restart and the order they all run in) and `table` (their rows in the bench table).

Every process the cases start is a child of the bench: publishers (vLLM-compatible
`Publisher`s, one per instance, all in one child process so they never share serve's
GIL), `kvindex serve` itself, Dynamo's indexer, and the clients (a
naive subscriber, HTTP lookup and freshness clients). Children talk to the bench in JSON
lines (commands on stdin, answers on stdout) and are always stopped in a `finally`
(SIGTERM, then SIGKILL). Each indexer gets its own fresh publisher child with the same
items; the two indexers never run at once.

The streams are the bench's steady-state workload (`workloads.ingest_workload`: the
simulator with no restarts or resets): its warm-up, which fills every instance's pool, is
sent first and untimed; the measured part follows. The simulator's `reference()` at the
end is the truth every ingest case is checked against.

Cases and how each is measured (times are wall clock, `time.time()`, compared across
processes of one machine):

1. ingest (`ingest`), 4 publishers, 1M block events: the publisher child sends the
   measured part at once (high-water marks unbounded, so ZeroMQ queues instead of
   dropping; gaps and replays are reported if any happen anyway). Rate = block events /
   (the poll that first shows everything applied - the first send), polled every 20 ms.
   `serve --store memory`: every instance's `last_seq` in `GET /v1/instances` at its final
   seq; `--store sqlite:///...` / `redis://...` (a throwaway `redis-server`, skipped when
   none is installed): applied *and* persisted (the SQLite `sources` checkpoints, Redis's
   `cp:...` hashes hold each final next seq); Dynamo: its applied-events counter at the
   number of events published. Baseline beside: a naive subscriber child (SUB sockets,
   `consumers.Naive`) stamping its own end. Rounds of naive, memory, SQLite, SQLite with
   every batch in Python (`KVINDEX_C_INGEST=0`: serve's default is the C path with every
   store), Dynamo, best of N each; Redis once. serve's rates are ratios to Dynamo's; its
   CPU seconds per M block events to Dynamo's indexer's; its own counters (`/v1/stats`)
   give the batches the C path took and the GIL time per batch over the burst.
2. lookups (`lookup`): a fill of 64 instances x 20k blocks published as vLLM does, then
   `POST /v1/lookup` (serve) or `POST /query` (Dynamo) of 512-block prompts from a client
   child (`probes.Client`, one keep-alive connection, one lookup every 5 ms), idle and
   while the steady-state stream is paced at 200k block events/s; empty GETs before each
   phase (the HTTP floor); every answer checked against the fill's truth; the process's
   RSS growth over the fill per entry. Latency = the client's round trip.
3. freshness at 100k block events/s (serve): beside the paced stream, the publisher sends a
   marker batch every 10 ms (one new block chaining onto the previous marker, on the first
   instance) and stamps each send. A client child polls `POST /v1/lookup/hashes` with the
   markers not seen yet (a chain, so the answer's `matched_blocks` counts the visible
   ones) with a 1 ms pause between polls, and stamps each marker with the arrival time of
   the first answer that shows it. Latency = that stamp - the send stamp: an upper bound,
   late by up to one poll cycle (round trip + pause; its median is reported as the
   resolution). The polls cost serve a few percent of its loop.
4. warm restart: serve builds a SQLite store by ingesting N blocks (chains of 32, never
   removed) from a publisher, persists it and stops (SIGTERM). `kvindex serve` on that
   store is then timed from process start until `/healthz` answers ok (serve loads the
   store before it binds its port, so an answer means loaded) and until `/v1/instances`
   counts all N blocks. Baselines, same run, starts alternated, best of N each: the same
   start with the snapshot read in Python (`KVINDEX_SNAPSHOT_LOAD=python`), and with an
   empty memory store (interpreter, imports, sockets: what any start costs).
5. a router's requests (`routing`): on a filled 8-instance fleet with `model=` and a
   word-level tokenizer, `POST /v1/lookup` by token ids (the plain path), with a model, by
   prompt text, and `POST /v1/route`, interleaved on one connection: each beside its
   baseline in the same run; tokenization alone in the bench process (word-level and a
   byte-level BPE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvindex.bench.e2e.table import table_rows
from kvindex.bench.plan import Plan

__all__ = ["run_e2e", "table_rows"]


def run_e2e(plan: Plan, workdir: Path, dynamo: bool = True) -> dict[str, Any]:
    """Every end-to-end case of `plan` (`plan.e2e`'s sizes); one key per case. Dynamo's
    standalone indexer is the peer unless `dynamo` is False (or it can't run here)."""
    # Imported here: the child programs import this package and need none of the cases.
    from kvindex.bench.e2e.cases import run_e2e as run

    return run(plan, workdir, dynamo)
