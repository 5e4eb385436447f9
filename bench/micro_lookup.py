"""Micro-benchmark of the lookup paths and ingest touched by issue 15's last pieces.

    python bench/micro_lookup.py [--local]     (PYTHONPATH=<another tree>/src to compare)

A fleet of 8 publishers x ~20,000 blocks (16-token blocks, 64-block chains under 32 shared
512-token system prompts), then: ingest (apply_payload, best of 3), the compiled index's
`lookup` and `lookup_json` of a 512-block prompt, the pure index's `lookup` (median of
many), and with `--local` the compiled core keeping Dynamo's local hashes (ingest cost,
memory, `lookup_local_hashes`). Prints one JSON object.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from typing import Any

from kvindex.index import ReferenceIndex
from kvindex.index.compiled import CompiledIndex
from kvindex.subscriber import SourceKey
from kvindex.wire import BlockStored
from kvindex.wire.publisher import encode_batch

BS, PUBS, CHAINS, CHAIN = 16, 8, 312, 64
rng = random.Random(1)
systems = [[rng.randrange(1, 30000) for _ in range(32 * BS)] for _ in range(32)]


def fleet_payloads() -> tuple[list[tuple[SourceKey, bytes]], list[int]]:
    out = []
    prompt: list[int] = []
    for p in range(PUBS):
        src = SourceKey(f"v{p}")
        for c in range(CHAINS):
            tokens = systems[c % 32] + [rng.randrange(1, 30000) for _ in range((CHAIN - 32) * BS)]
            if p == 0 and c == 0:
                prompt = tokens * 8  # 512 blocks, the first 64 cached
            hashes = [rng.getrandbits(63) for _ in range(CHAIN)]
            ev = BlockStored(hashes, None, tokens, BS)
            out.append((src, encode_batch([ev], 0.0, None, "maps")))
    return out, prompt[: 512 * BS]


def best(f: Any, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def median_us(f: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    local = "--local" in sys.argv
    payloads, prompt = fleet_payloads()
    blocks = PUBS * CHAINS * CHAIN
    result: dict[str, Any] = {"blocks": blocks}

    def ingest(**kw: Any) -> Any:
        ix = CompiledIndex(seed=1, **kw)
        for seq, (src, data) in enumerate(payloads):
            ix.apply_payload(src, data, seq)
        return ix

    result["ingest_blocks_per_s"] = round(blocks / best(ingest))
    fast = ingest()
    result["memory_bytes_per_block"] = round(sum(fast.memory().values()) / blocks, 1)
    if local:
        result["ingest_local_blocks_per_s"] = round(
            blocks / best(lambda: ingest(local_hashes=True))
        )
        with_local = ingest(local_hashes=True)
        result["memory_local_bytes_per_block"] = round(
            sum(with_local.memory().values()) / blocks, 1
        )
    pure = ReferenceIndex()
    for seq, (src, data) in enumerate(payloads):
        pure.apply_payload(src, data, seq)
    assert fast.lookup(prompt) == pure.lookup(prompt)
    layout = fast.layout()
    slots = [
        (json.dumps(name).encode(), [r for rank, bit in ranks for r in (rank, bit)])
        for name, ranks in layout
    ]
    statuses = [b'"live"'] * len(slots)
    result["compiled_lookup_us"] = round(median_us(lambda: fast.lookup(prompt), 2000), 1)
    result["compiled_lookup_json_us"] = round(
        median_us(lambda: fast.lookup_json(prompt, None, None, slots, statuses), 2000), 1
    )
    result["pure_lookup_us"] = round(median_us(lambda: pure.lookup(prompt), 300), 1)
    if local:
        from kvindex.index.localhash import local_hashes

        hashes = local_hashes(prompt, BS)
        assert with_local.lookup_local_hashes(hashes) == pure.lookup_local_hashes(hashes)
        assert [r.matched_blocks for r in with_local.lookup_local_hashes(hashes)] == [
            r.matched_blocks for r in with_local.lookup(prompt)
        ]
        result["compiled_lookup_local_us"] = round(
            median_us(lambda: with_local.lookup_local_hashes(hashes), 2000), 1
        )
        result["compiled_lookup_with_local_on_us"] = round(
            median_us(lambda: with_local.lookup(prompt), 2000), 1
        )
        result["pure_lookup_local_us"] = round(
            median_us(lambda: pure.lookup_local_hashes(hashes), 300), 1
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
