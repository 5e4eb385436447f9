"""The drain case (`kvindex.bench.drain`) with a persistent store recording, in the same run
as without one:

    python bench/drain_store.py [--events N] [--rounds N]

The publishers' stream is queued while ingest is paused, then drained by one ingest worker
and timed; with `sqlite` a real SQLite store (its writer process) records every batch as
`serve` has it record (`Fleet.record_into`, flushed after each read). `make bench`'s drain
section has the same runs at its own size (`c-1-sqlite`, `python-1-sqlite`). Each store with the
C path and with every batch in Python (`KVINDEX_C_INGEST=0`), interleaved, best of N.
Prints one JSON object per case: block events/s, the process's CPU seconds per million
block events (the writer's own process not counted) and the GIL held per batch
(`IngestCounters.gil_seconds`), with the final state's mismatches (0: exact).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import kvindex.bench.drain as drain
from kvindex.bench.workloads import IngestSpec, ingest_workload

KEEP = (
    "per_s",
    "cpu_seconds_per_m_events",
    "gil_us_per_batch",
    "batches_in_c",
    "mismatched_blocks",
    "lost_batches",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    w = ingest_workload(IngestSpec(4, args.events))
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for store in (None, "sqlite"):
            for in_c in (True, False):
                run = drain._drain(w, 1, in_c, 300.0, store)
                key = f"{store or 'memory'}-{'c' if in_c else 'python'}"
                if key not in best or run["per_s"] > best[key]["per_s"]:
                    best[key] = {k: run[k] for k in KEEP}
    out = {"block_events": w.events, "batches": len(w.measured), "best": best}
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
