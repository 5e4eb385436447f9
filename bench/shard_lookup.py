"""What splitting the index into shards costs a lookup and memory (kvindex.index.sharded):

    python bench/shard_lookup.py [--instances 64] [--blocks 20000] [--shards 1,2,4] [--reps 400]

A fleet of N instances x B blocks (16-token blocks, 64-block chains, a quarter of each
chain under one of 32 shared 512-token system prompts, so shards hold shared prefixes more
than once), built into one index and into 2 and 4 shards (as `serve --index-shards` makes
them: the instances placed as the runtime adds them), each behind a `Fleet` (its sockets
open, its workers not started: nothing else runs). Then `Fleet.lookup_json` of a 512-block
prompt whose first 64 blocks one instance holds -- what `POST /v1/lookup` answers: one
index in C (the compiled answer), shards in Python (every shard's rows, merged) -- p50 and
p99 over the same prompts, the indexes alternated round by round, and the bytes of the
core's structures (`memory()`) per entry. Every answer is checked against one index's.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from kvindex.index.compiled import CompiledIndex
from kvindex.index.sharded import ShardedIndex
from kvindex.runtime import Fleet
from kvindex.subscriber import InstanceSpec, SourceKey
from kvindex.wire import BlockStored
from kvindex.wire.publisher import encode_batch

BS, CHAIN, SHARED = 16, 64, 16


def workload(instances: int, blocks: int) -> tuple[list[tuple[str, bytes]], list[int]]:
    rng = random.Random(1)
    systems = [[rng.randrange(1, 30000) for _ in range(SHARED * BS)] for _ in range(32)]
    out: list[tuple[str, bytes]] = []
    prompt: list[int] = []
    for i in range(instances):
        name = f"v{i}"
        for c in range(blocks // CHAIN):
            own = [rng.randrange(1, 30000) for _ in range((CHAIN - SHARED) * BS)]
            tokens = systems[c % 32] + own
            if i == 0 and c == 0:
                prompt = tokens * 8  # 512 blocks, the first 64 held by v0
            hashes = [rng.getrandbits(63) for _ in range(CHAIN)]
            out.append((name, encode_batch([BlockStored(hashes, None, tokens, BS)])))
    return out, prompt


def fleet_over(index: Any, instances: int, workers: int) -> Fleet:
    specs = [InstanceSpec(f"v{i}", f"tcp://127.0.0.1:{20000 + i}") for i in range(instances)]
    return Fleet(specs, index=index, ingest_workers=workers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--shards", default="1,2,4")
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args()
    payloads, prompt = workload(args.instances, args.blocks)
    fleets: dict[int, Fleet] = {}
    for n in (int(s) for s in args.shards.split(",")):
        index: Any = CompiledIndex() if n == 1 else ShardedIndex(n)
        fleets[n] = fleet_over(index, args.instances, n)
        for seq, (name, payload) in enumerate(payloads):
            index.apply_payload(SourceKey(name), payload, seq)
    expected = fleets[min(fleets)].lookup_json(prompt)[0]
    times: dict[int, list[float]] = {n: [] for n in fleets}
    for _ in range(args.reps):
        for n, fleet in fleets.items():
            start = time.perf_counter()
            answer, _ = fleet.lookup_json(prompt)
            times[n].append(time.perf_counter() - start)
            assert json.loads(answer) == json.loads(expected), n
    out: dict[str, Any] = {"instances": args.instances, "blocks": args.blocks, "runs": {}}
    for n, fleet in fleets.items():
        samples = sorted(times[n])
        memory = sum(fleet.index.memory().values())
        entries = fleet.index.entries()
        out["runs"][str(n)] = {
            "p50_us": statistics.median(samples) * 1e6,
            "p99_us": samples[int(len(samples) * 0.99) - 1] * 1e6,
            "bytes_per_entry": memory / entries,
            "tree_nodes": fleet.index.tree_nodes(),
        }
        fleet.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
