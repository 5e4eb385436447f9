"""What splitting the index into shards costs a lookup and memory (kvindex.bench.shards):

    python bench/shard_lookup.py [--instances 64] [--blocks 20000] [--shards 1,2,4] [--reps 400]

Prints one JSON object (the `shards` section of `make bench` has the same figures).
"""

from __future__ import annotations

import argparse
import json

from kvindex.bench.shards import shard_lookup_case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--shards", default="1,2,4")
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args()
    shards = tuple(int(s) for s in args.shards.split(","))
    out = shard_lookup_case(args.instances, args.blocks, shards, args.reps)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
