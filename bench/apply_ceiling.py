"""What two cores can give the compiled core's apply, measured without Python or sockets
(docs/performance.md, "How ingest scales"): the drain case's stream (4 publishers, 1M
block events) parsed and applied by threads, each taking its share of the publishers:

- `one_thread`: 1 thread, one core (the baseline);
- `one_lock`: 2 threads, one core under its one write lock (today's ingest);
- `separate`: 2 threads each to a core of its own (nothing shared: the best any
  partitioning of the write side could do);
- `root_shards`, `root_shards_one_thread`, `root_shards_held`: the write side sharded by
  chain root, 16 shards (a prototype: 16 sub-cores, see bench/apply_ceiling.c), each
  part of a batch under its shard's lock alone, with 2 threads and 1, and with all of a
  batch's shard locks held until it is applied;
- `combining`: 2 threads, one core, a thread's parsed batch applied by whichever thread
  holds the lock (flat combining: the index stays in one core's cache);
- `pipelined`: the same, a thread parsing its next batch while its last one waits.

Builds bench/apply_ceiling.c against the core's sources; the cases alternate round by
round, best of N; every case must leave each publisher holding what the baseline does.

    python bench/apply_ceiling.py [--rounds N] [--events N] [--instances N] [--gpu-blocks N]
                                  [--cases one_lock,separate,...]

Prints one JSON object: per case the best rate, its per-batch wait for the lock(s) and
time applying under them (`held_us`), its ratio to one thread, and the load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kvindex.bench.workloads import IngestSpec, ingest_workload

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "src/kvindex/index/csrc"
CASES = {  # threads, cores (0: combining, -1: pipelined), shards (negative: part by part)
    "one_thread": (1, 1, 0),
    "one_lock": (2, 1, 0),
    "separate": (2, 2, 0),
    "root_shards_one_thread": (1, 1, -16),
    "root_shards": (2, 1, -16),
    "root_shards_held": (2, 1, 16),
    "combining": (2, 0, 0),
    "pipelined": (2, -1, 0),
}


def build(out: Path) -> None:
    sources = [str(CSRC / n) for n in ("core.c", "parse.c", "answer.c")]
    cmd = ["cc", "-O2", "-std=gnu11", "-pthread", f"-I{CSRC}", "-o", str(out)]
    subprocess.run([*cmd, str(ROOT / "bench/apply_ceiling.c"), *sources], check=True)


def dump(path: Path, instances: int, events: int, gpu_blocks: int) -> None:
    w = ingest_workload(IngestSpec(instances, events, gpu_blocks=gpu_blocks))
    with path.open("wb") as f:
        f.write(struct.pack("<IIQ", len(w.warmup), len(w.measured), w.events))
        for instance, _, payload in [*w.warmup, *w.measured]:
            f.write(struct.pack("<II", instance, len(payload)))
            f.write(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument(
        "--gpu-blocks", type=int, default=1024, help="each publisher's pool (the index's size)"
    )
    parser.add_argument("--cases", default=",".join(CASES), help="which cases, comma-separated")
    args = parser.parse_args()
    cases = {name: CASES[name] for name in ["one_thread", *args.cases.split(",")]}
    with tempfile.TemporaryDirectory(prefix="kvindex-ceiling-") as tmp:
        exe, stream = Path(tmp) / "apply_ceiling", Path(tmp) / "stream.bin"
        build(exe)
        dump(stream, args.instances, args.events, args.gpu_blocks)
        best: dict[str, dict[str, Any]] = {}
        loads = []
        for _ in range(args.rounds):
            for case, (threads, cores, shards) in cases.items():
                run = subprocess.run(
                    [str(exe), str(stream), str(threads), str(cores), str(shards)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                got = json.loads(run.stdout)
                if case not in best or got["per_s"] > best[case]["per_s"]:
                    best[case] = got
            loads.append(os.getloadavg())
    one = best["one_thread"]
    for case, got in best.items():
        got["vs_one_thread"] = got["per_s"] / one["per_s"]
        if (got["digest"], got["entries"]) != (one["digest"], one["entries"]):
            raise SystemExit(f"{case}: the publishers hold other blocks than one thread's")
    out = {"cases": best, "load_averages": loads}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
