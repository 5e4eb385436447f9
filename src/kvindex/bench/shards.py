"""What splitting the index into shards costs a lookup and memory (kvindex.index.sharded):
the `shards` section of `make bench` (`python -m kvindex.bench --only shards`), and
bench/shard_lookup.py's.

A fleet of N instances x B blocks (16-token blocks, 64-block chains, a quarter of each
chain under one of 32 shared 512-token system prompts, so shards hold shared prefixes more
than once), built into one index and into 2, 4 and 16 shards (as `serve --index-shards`
makes them: the instances placed as the runtime adds them), each behind a `Fleet` (its
sockets open, its workers not started: nothing else runs). Then `Fleet.lookup_json` of a
512-block prompt whose first 64 blocks one instance holds -- what `POST /v1/lookup`
answers, in C over every shard -- p50 and p99 over the same prompt (each round's, the
median over rounds of 100 calls), the indexes alternated round by round, and the bytes of
the core's structures (`memory()`) per entry.
Every answer is checked against one index's.
"""

from __future__ import annotations

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
from kvindex.wire.publisher import Publisher, encode_batch

__all__ = ["shard_lookup_case"]

BS, CHAIN, SHARED = 16, 64, 16
ROUND = 100  # lookups per index per round


def _workload(instances: int, blocks: int) -> tuple[list[tuple[str, bytes]], list[int]]:
    rng = random.Random(1)
    systems = [[rng.randrange(1, 30000) for _ in range(SHARED * BS)] for _ in range(32)]
    out: list[tuple[str, bytes]] = []
    prompt: list[int] = []
    for i in range(instances):
        name = f"v{i}"
        for c in range(max(1, blocks // CHAIN)):
            own = [rng.randrange(1, 30000) for _ in range((CHAIN - SHARED) * BS)]
            tokens = systems[c % 32] + own
            if i == 0 and c == 0:
                prompt = tokens * 8  # 512 blocks, the first 64 held by v0
            hashes: list[int | bytes] = [rng.getrandbits(63) for _ in range(CHAIN)]
            out.append((name, encode_batch([BlockStored(hashes, None, tokens, BS)])))
    return out, prompt


def _fleet_over(index: Any, endpoints: list[str], workers: int) -> Fleet:
    specs = [InstanceSpec(f"v{i}", endpoint) for i, endpoint in enumerate(endpoints)]
    return Fleet(specs, index=index, ingest_workers=workers)


def shard_lookup_case(
    instances: int, blocks: int, shards: tuple[int, ...] = (1, 2, 4, 16), reps: int = 300
) -> dict[str, Any]:
    """The lookup and memory of one index (1) and of each count of shards, same run."""
    payloads, prompt = _workload(instances, blocks)
    fleets: dict[int, Fleet] = {}
    # Publishers that stay quiet: the fleets' SUB sockets connect once and wait (sockets
    # connecting to nothing retry every 100 ms, and ZMQ's threads doing so for hundreds of
    # them spoiled the p99s).
    pubs = [Publisher("tcp://127.0.0.1:*") for _ in range(instances)]
    try:
        for n in shards:
            index: Any = CompiledIndex() if n == 1 else ShardedIndex(n)
            fleets[n] = _fleet_over(index, [pub.endpoint for pub in pubs], n)
            for seq, (name, payload) in enumerate(payloads):
                index.apply_payload(SourceKey(name), payload, seq)
        expected = json.loads(fleets[min(fleets)].lookup_json(prompt)[0])
        # Rounds of ROUND calls on each index in turn (call by call, four indexes of this
        # size evict each other from the caches: every lookup then walks cold, one index's
        # too); each figure is the median over the rounds of that round's p50 or p99 (the
        # bench's method: a disturbance on a shared machine spoils a round, not the figure).
        rounds: dict[int, list[tuple[float, float]]] = {n: [] for n in fleets}
        for _ in range(max(1, reps // ROUND)):
            for n, fleet in fleets.items():
                samples: list[float] = []
                for _ in range(ROUND):
                    start = time.perf_counter()
                    answer, _ = fleet.lookup_json(prompt)
                    samples.append(time.perf_counter() - start)
                    if json.loads(answer) != expected:
                        raise AssertionError(f"{n} shards answered otherwise than one index")
                samples.sort()
                rounds[n].append((statistics.median(samples), samples[int(len(samples) * 0.99)]))
        runs: dict[str, Any] = {}
        for n, fleet in fleets.items():
            held: Any = fleet.index
            entries = held.entries()
            runs[str(n)] = {
                "p50_us": statistics.median(r[0] for r in rounds[n]) * 1e6,
                "p99_us": statistics.median(r[1] for r in rounds[n]) * 1e6,
                "rounds": len(rounds[n]),
                "bytes_per_entry": sum(held.memory().values()) / max(1, entries),
                "entries": entries,
                "tree_nodes": held.tree_nodes(),
                "exact": True,
            }
    finally:
        for fleet in fleets.values():
            fleet.close()
        for pub in pubs:
            pub.close()
    return {"instances": instances, "blocks": blocks, "prompt_blocks": 512, "runs": runs}
