"""The end-to-end cases: real processes, real sockets, `kvindex serve` as users run it.

The package: `streams` (what is published), `procs` (the bench's side of its children),
`programs` (the child programs), `probes` (HTTP and state probes), `cases` (the cases) and
`table` (their rows in the bench table).

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
