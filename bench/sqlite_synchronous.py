"""What `sqlite:///PATH?synchronous=full` costs the SQLite writer, against the default
NORMAL, in the same run:

    python bench/sqlite_synchronous.py [DIR] [--rounds N]

The writer's own commit (`SQLiteWriter.commit`, the code the writer process runs) of
groups of 64 batches (one 16-block BlockStored each), on files in DIR (default: a fresh
directory under the current one, so the disk measured is the one a store would use, not a
tmpfs). The two modes alternate, round by round, so both see the same disk at the same
time. Prints one JSON object: the median milliseconds per 64-batch transaction of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvindex.store.protocol import AppliedBatch, Group
from kvindex.store.sqlite.writer import SQLiteWriter, WriterOptions
from kvindex.wire import BlockStored
from kvindex.wire.publisher import encode_batch

BS, PER_GROUP = 16, 64


def group(seq0: int) -> Group:
    def payload(seq: int) -> bytes:
        hashes = list(range(seq * BS, seq * BS + BS))
        return encode_batch([BlockStored(hashes, None, [1] * (BS * BS), BS)])

    batches = [AppliedBatch("a", 0, seq, payload(seq)) for seq in range(seq0, seq0 + PER_GROUP)]
    return Group(0, list(batches))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvindex-sync-", dir="."))
    writers = {
        mode: SQLiteWriter(str(base / f"{mode}.sqlite"), WriterOptions(synchronous=mode))
        for mode in ("normal", "full")
    }
    groups = [group(i * PER_GROUP) for i in range(args.rounds)]
    took: dict[str, list[float]] = {mode: [] for mode in writers}
    for g in groups:
        for mode, writer in writers.items():
            start = time.perf_counter()
            writer.commit([g])
            took[mode].append((time.perf_counter() - start) * 1000)
    for writer in writers.values():
        writer.close()
    out = {
        f"{mode}_ms_per_64_batch_commit": round(statistics.median(t), 3)
        for mode, t in took.items()
    }
    out["rounds"] = args.rounds
    out["dir"] = str(base)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
