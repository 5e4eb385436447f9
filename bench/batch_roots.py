"""How many shards one batch touches, and how often two batches meet on one: what sharding
the index's write side would cost each batch in locks (docs/performance.md, "How ingest
scales"), for several ways to choose a block's shard:

- by chain root (`root`): a block's shard is its chain's first block's (a stored block
  inherits its parent's root; an unknown parent roots its own chain);
- by depth segment (`segment-D`): the tree cut every D blocks of depth; a block's shard is
  that of its ancestor at the start of its segment (depth D * floor(depth / D)), so a
  chain changes shard every D blocks and the blocks under one popular prefix spread.
  A store also touches its parent's shard (the parent's child count). `segment-1` is
  node-level: every block its own key (with 2^20 "shards", about the exact node sets);
- below a depth (`below-D`, `--tops`): the blocks above depth D in one shard, each
  deeper block in its ancestor's at depth D (the popular prefixes set apart).

    python bench/batch_roots.py [--events N] [--instances N] [--depths 4,8,16,32]
                                [--tops 16,32,48,64]

The bench's steady-state ingest stream (kvindex.bench.workloads: stores and the evictions
they cause). Per measured batch, the distinct shards it touches for S shards (the key
modulo S); `meet`: the share of pairs of batches of two different publishers, drawn at
random, that touch a shard in common (two workers applying them at once would queue);
`hottest`: the share of batches touching the most used shard (1024 and 2^20 shards
stand for striped locks over the nodes). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from typing import Any

from kvindex.bench.workloads import IngestSpec, ingest_workload
from kvindex.wire import BatchDecoder, BlockHash, BlockRemoved, BlockStored

SHARDS = (2, 4, 16, 64, 1024, 1 << 20)
PAIRS = 20_000


TOP = -1  # the shard key of the blocks above `top`'s depth


def keys_per_batch(
    batches: list[tuple[int, bytes]], depth: int | None, top: int | None = None
) -> list[tuple[int, set[BlockHash]]]:
    """Per batch, its publisher and the shard keys it touches (`depth` None: by root; `top`:
    the blocks above that depth in one shard, the rest by their ancestor at that depth)."""
    decoder = BatchDecoder()
    at: dict[BlockHash, tuple[int, BlockHash]] = {}  # hash -> (depth, shard key)
    out: list[tuple[int, set[BlockHash]]] = []
    for instance, payload in batches:
        keys: set[BlockHash] = set()
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored) and event.block_hashes:
                parent = event.parent_block_hash
                d, key = (-1, None) if parent is None else at.get(parent, (-1, parent))
                if parent is not None:
                    keys.add(key if key is not None else parent)
                for h in event.block_hashes:
                    d += 1
                    if depth == 1:  # node-level: every block its own key
                        key = h
                    elif top is not None:
                        key = TOP if d < top else (h if d == top or key == TOP else key)
                    elif key is None or (depth is not None and d % depth == 0):
                        key = h
                    at[h] = (d, key)
                    keys.add(key)
            elif isinstance(event, BlockRemoved):
                keys.update(at.get(h, (0, h))[1] for h in event.block_hashes)
        out.append((instance, keys))
    return out


def measure(touched: list[tuple[int, set[BlockHash]]], rng: random.Random) -> dict[str, Any]:
    counts = sorted(len(k) for _, k in touched)
    shards: dict[str, Any] = {}
    for s in SHARDS:
        sets = [(i, {hash(k) % s for k in keys}) for i, keys in touched]
        hits = [0] * s
        for _, ks in sets:
            for k in ks:
                hits[k] += 1
        meet = 0
        for _ in range(PAIRS):
            (i, a), (j, b) = rng.choice(sets), rng.choice(sets)
            while i == j:
                j, b = rng.choice(sets)
            meet += bool(a & b)
        shards[str(s)] = {
            "locks_per_batch": statistics.mean(len(ks) for _, ks in sets),
            "one_shard_share": sum(len(ks) <= 1 for _, ks in sets) / len(sets),
            "meet": meet / PAIRS,
            "hottest": max(hits) / len(sets),
        }
    return {
        "keys_per_batch": {
            "mean": statistics.mean(counts),
            "median": statistics.median(counts),
            "p90": counts[int(0.9 * len(counts))],
        },
        "shards": shards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--depths", default="4,8,16,32")
    parser.add_argument("--tops", default="16,32,48,64")
    args = parser.parse_args()
    w = ingest_workload(IngestSpec(args.instances, args.events, gpu_blocks=1024))
    batches = [(i, p) for i, _, p in [*w.warmup, *w.measured]]
    rng = random.Random(1)
    out: dict[str, Any] = {"batches": len(w.measured), "block_events": w.events}
    for depth in [None, *(int(d) for d in args.depths.split(","))]:
        touched = keys_per_batch(batches, depth)[len(w.warmup) :]
        out["root" if depth is None else f"segment-{depth}"] = measure(touched, rng)
    for top in (int(d) for d in args.tops.split(",") if d):
        touched = keys_per_batch(batches, None, top)[len(w.warmup) :]
        out[f"below-{top}"] = measure(touched, rng)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
