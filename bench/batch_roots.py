"""How many chain roots one batch touches: what sharding the index's write side by chain
root would cost each batch in locks (docs/performance.md, "How ingest scales").

    python bench/batch_roots.py [--events N] [--instances N]

The bench's steady-state ingest stream (kvindex.bench.workloads: stores and the
evictions they cause). A block's root is the first block of its chain (a stored block
inherits its parent's root; an unknown parent roots its own chain). Per measured batch,
the distinct roots its stores and removals touch, and for S shards (root modulo S) the
shards, i.e. the shard locks an apply would take. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvindex.bench.workloads import IngestSpec, ingest_workload
from kvindex.wire import BatchDecoder, BlockHash, BlockRemoved, BlockStored

SHARDS = (2, 4, 16, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--instances", type=int, default=4)
    args = parser.parse_args()
    w = ingest_workload(IngestSpec(args.instances, args.events, gpu_blocks=1024))
    decoder = BatchDecoder()
    root: dict[BlockHash, BlockHash] = {}
    touched: list[set[BlockHash]] = []
    stored_roots: list[int] = []
    for _, _, payload in [*w.warmup, *w.measured]:
        roots: set[BlockHash] = set()
        stores: set[BlockHash] = set()
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored) and event.block_hashes:
                parent = event.parent_block_hash
                first = event.block_hashes[0] if parent is None else root.get(parent, parent)
                for h in event.block_hashes:
                    root[h] = first
                roots.add(first)
                stores.add(first)
            elif isinstance(event, BlockRemoved):
                roots.update(root.get(h, h) for h in event.block_hashes)
        touched.append(roots)
        stored_roots.append(len(stores))
    measured = touched[len(w.warmup) :]
    counts = sorted(len(r) for r in measured)
    out = {
        "batches": len(measured),
        "block_events": w.events,
        "roots_per_batch": {
            "mean": statistics.mean(counts),
            "median": statistics.median(counts),
            "p90": counts[int(0.9 * len(counts))],
        },
        "stored_roots_per_batch": statistics.mean(stored_roots[len(w.warmup) :]),
        "shards": {
            str(s): {
                "locks_per_batch": statistics.mean(
                    len({hash(r) % s for r in roots}) for roots in measured
                ),
                "one_shard_share": sum(len({hash(r) % s for r in roots}) <= 1 for roots in measured)
                / len(measured),
            }
            for s in SHARDS
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
