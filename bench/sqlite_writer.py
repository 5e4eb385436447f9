"""The SQLite writer's own throughput, in process (the code the writer process runs):

    python bench/sqlite_writer.py [--instances N] [--events N] [--rounds N] [--profile]

The bench's steady-state ingest stream (`kvindex.bench.workloads`: N engines at a full
pool, stores and evictions) is handed to `SQLiteWriter` as the service hands it over:

- **append**: groups of one read each, as `AppliedBatch`es one by one (the Python path) or
  as one `AppliedBatches` per publisher (the C path's bulk), each group committed
  (`SQLiteWriter.commit`: log rows and checkpoints, what `sync` waits for); `bulk_autockpt`:
  the same with SQLite checkpointing the WAL itself every 1,000 pages, in the commits (as
  the writer did before it checkpointed in the time left);
- **fold**: then the whole log folded into the snapshot, in two parts: the mirror fed every
  logged batch (`mirror`), then one snapshot of what changed (`snapshot`: the runs that
  changed cut and encoded as records, written, the log rows dropped).

Each on a fresh file (in DIR, default a temporary directory under the current one, so the
disk is the one a store would use), the append forms alternating round by round; best of
N. Prints one JSON object: batches and block events per second of each part, and the
writer's CPU seconds per million block events. `--profile` prints the fold's cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvindex.bench.workloads import IngestSpec, IngestWorkload, ingest_workload
from kvindex.store.protocol import AppliedBatch, AppliedBatches, Group, Message
from kvindex.store.sqlite.writer import SQLiteWriter, WriterOptions

PER_READ = 64  # batches per read of an ingest thread, over all publishers


def groups(w: IngestWorkload, bulk: bool) -> list[Group]:
    """The warm-up and the measured stream, one group per read of PER_READ batches."""
    batches = [*w.warmup, *w.measured]
    seqs: dict[int, int] = defaultdict(int)
    out = []
    for start in range(0, len(batches), PER_READ):
        read: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
        for instance, _seq, payload in batches[start : start + PER_READ]:
            read[instance].append((seqs[instance], payload))
            seqs[instance] += 1
        messages: list[Message] = []
        for instance, got in read.items():
            name = w.names[instance]
            if bulk:
                messages.append(AppliedBatches(name, 0, got[0][0], [p for _, p in got]))
            else:
                messages.extend(AppliedBatch(name, 0, seq, p) for seq, p in got)
        out.append(Group(len(out) + 1, messages))
    return out


def one_round(
    w: IngestWorkload, path: Path, bulk: bool, profile: bool, autocheckpoint: bool = False
) -> dict[str, float]:
    for old in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        old.unlink(missing_ok=True)  # a fresh file: an old one would refuse every batch
    writer = SQLiteWriter(str(path), WriterOptions(compact_interval=1e9, compact_log_rows=10**9))
    if autocheckpoint:  # as before the writer checkpointed in the time left: SQLite's own
        writer.db.execute("PRAGMA wal_autocheckpoint=1000")
    todo = groups(w, bulk)
    batches = len(w.warmup) + len(w.measured)
    try:
        cpu, start = time.process_time(), time.perf_counter()
        for group in todo:
            writer.commit([group])
        append = time.perf_counter() - start, time.process_time() - cpu
        profiler = cProfile.Profile() if profile else None
        cpu, start = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        writer._fold(float("inf"))  # the mirror follows the log (no snapshot is due)
        mirror = time.process_time() - cpu
        writer._write_snapshot()  # then one snapshot of it all
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
        fold = time.perf_counter() - start, time.process_time() - cpu
    finally:
        writer.close()
    events = w.events * batches / len(w.measured)  # warm-up batches are of the same kind
    return {
        "append_batches_per_s": batches / append[0],
        "append_cpu_seconds_per_m_events": append[1] / events * 1e6,
        "fold_batches_per_s": batches / fold[0],
        "fold_cpu_seconds_per_m_events": fold[1] / events * 1e6,
        "fold_mirror_cpu_seconds_per_m_events": mirror / events * 1e6,
        "fold_snapshot_cpu_seconds_per_m_events": (fold[1] - mirror) / events * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("dir", nargs="?", default=None)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--events", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    w = ingest_workload(IngestSpec(args.instances, args.events))
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvindex-writer-", dir="."))
    runs: dict[str, list[dict[str, float]]] = {"one_by_one": [], "bulk": [], "bulk_autockpt": []}
    for r in range(args.rounds):
        for key in runs:
            path = base / f"{key}-{r}.sqlite"
            bulk, auto = key != "one_by_one", key == "bulk_autockpt"
            runs[key].append(one_round(w, path, bulk, args.profile and r == 0, auto))
    best: dict[str, Any] = {}
    for key, rounds in runs.items():
        best[key] = {f: (min if "cpu" in f else max)(run[f] for run in rounds) for f in rounds[0]}
    batches = len(w.warmup) + len(w.measured)
    print(json.dumps({"batches": batches, "block_events_measured": w.events, "best": best,
                      "runs": runs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
