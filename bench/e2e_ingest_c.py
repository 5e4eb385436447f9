"""What the in-order path in C gives end to end, in the same run: the e2e ingest stream (4
publishers -> `kvindex serve`, memory store) with ordinary batches in C and with every
batch through Python (`KVINDEX_C_INGEST=0`), the SQLite store beside, with the C path (its
batches recorded in bulk, once per read) and without (`sqlite_python`: every batch through
Python, as before the C path served persistent stores), timed until the store has committed
them, and
Dynamo's standalone indexer when it is installed (the `[bench]` extra):

    python bench/e2e_ingest_c.py [--mode smoke|quick|full] [--rounds N]

The cases alternate round by round, so all see the machine in the same state. Prints one
JSON object: per case each round's block events/s, exactness and the consumer process's
CPU seconds per million block events over the burst (and the SQLite writer process's,
until it has committed all), the best rates, their ratios to
Dynamo's and the C path's to the Python path's, and the load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kvindex.bench.e2e.dynamo import standalone_status
from kvindex.bench.e2e.ingest import case_dynamo, case_serve
from kvindex.bench.e2e.streams import steady_state
from kvindex.bench.plan import PLANS


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mode", choices=sorted(PLANS), default="quick")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = PLANS[args.mode].e2e
    runs: dict[str, list[dict[str, Any]]] = {
        "c": [],
        "python": [],
        "sqlite": [],
        "sqlite_python": [],
        "dynamo": [],
    }
    loads = []
    with tempfile.TemporaryDirectory(prefix="kvindex-c-ab-") as tmp:
        workdir = Path(tmp)
        work = steady_state(sizes.ingest_instances, sizes.ingest_events, workdir, "ingest")
        peer = standalone_status()
        for r in range(args.rounds):
            for key, flag in (("c", "1"), ("python", "0")):
                os.environ["KVINDEX_C_INGEST"] = flag  # the serve child inherits it
                runs[key].append(case_serve(work, sizes, workdir, "memory", f"{key}-{r}"))
            for key, flag in (("sqlite", "1"), ("sqlite_python", "0")):
                os.environ["KVINDEX_C_INGEST"] = flag
                store = f"sqlite:///{workdir}/{key}-{r}.sqlite"
                runs[key].append(case_serve(work, sizes, workdir, store, f"{key}-{r}"))
            os.environ["KVINDEX_C_INGEST"] = "1"
            if peer.get("available"):
                runs["dynamo"].append(case_dynamo(work, sizes, workdir, f"dynamo-{r}"))
            loads.append(os.getloadavg())
    keep = (
        "per_s",
        "seconds",
        "send_seconds",
        "exact",
        "serve_cpu_seconds_per_m_events",  # serve's (kvindex)
        "store_worker_cpu_seconds_per_m_events",  # its store's worker process (SQLite)
        "persist_lag_seconds",
        "cpu_seconds_per_m_events",  # the indexer's (Dynamo)
    )
    out: dict[str, Any] = {
        "block_events": work.events,
        "publishers": len(work.names),
        "runs": {k: [{f: run.get(f) for f in keep} for run in v] for k, v in runs.items()},
        "best": {k: max(run["per_s"] for run in v) for k, v in runs.items() if v},
        "load_average": loads,
        "dynamo": peer,
    }
    best = out["best"]
    out["c_vs_python"] = best["c"] / best["python"]
    if "dynamo" in best:
        cases = ("c", "python", "sqlite", "sqlite_python")
        out["vs_dynamo"] = {k: best[k] / best["dynamo"] for k in cases}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
