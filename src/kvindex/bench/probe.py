"""One consumer's index of a filled fleet, in a fresh process: its memory and lookups.

`python -m kvindex.bench.probe '{"consumer": "kvindex", "instances": 64, ...}'` prints
one JSON line. A fresh process per (consumer, size) keeps the memory figure honest:
the resident-set delta of building the index, with nothing earlier cases allocated (and
the allocator kept) in the way. The lookup latencies come from the same index.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from kvindex.bench.common import median, percentile, rss_bytes, trim_heap
from kvindex.bench.consumers import Dynamo, Kvindex, Naive
from kvindex.bench.workloads import FillSpec, FillStore, Prompt, fill, prompts

__all__ = ["main", "probe"]

CONSUMERS: dict[str, type[Kvindex] | type[Naive] | type[Dynamo]] = {
    "kvindex": Kvindex,
    "naive": Naive,
    "dynamo": Dynamo,
}


class _Counted:
    """Counts the blocks of the stores passing through (the entries built)."""

    def __init__(self, stores: Iterable[FillStore]) -> None:
        self.stores = stores
        self.blocks = 0

    def __iter__(self) -> Iterator[FillStore]:
        for store in self.stores:
            self.blocks += len(store.hashes)
            yield store


def probe(consumer: str, spec: FillSpec, prompt_count: int, rounds: int) -> dict[str, Any]:
    asked = prompts(spec, prompt_count)  # before the baseline: not part of the index
    c = CONSUMERS[consumer](spec.instances)
    stores = _Counted(fill(spec))
    gc.collect()
    trim_heap()  # free pages the build would otherwise reuse unseen (small fills read 0)
    before = rss_bytes()
    start = time.perf_counter()
    c.build(stores)
    build_seconds = time.perf_counter() - start
    gc.collect()
    delta = rss_bytes() - before
    out: dict[str, Any] = {
        "consumer": consumer,
        "instances": spec.instances,
        "per_instance": spec.per_instance,
        "entries": stores.blocks,
        "build_seconds": build_seconds,
        "build_per_s": stores.blocks / build_seconds if build_seconds else None,
        "rss_delta_bytes": delta,
        "bytes_per_entry": delta / stores.blocks if stores.blocks else None,
    }
    if isinstance(c, Kvindex):
        nodes = c.index.tree_nodes()  # the sharing level: entries per prefix-tree node
        out["tree_nodes"] = nodes
        out["entries_per_node"] = stores.blocks / nodes if nodes else None
    if isinstance(c, Dynamo):
        out["rejected_events"] = c.rejected
    out["lookup"] = _lookups(c, asked, rounds)
    return out


def _lookups(c: Kvindex | Naive | Dynamo, asked: list[Prompt], rounds: int) -> dict[str, Any]:
    """A first, untimed pass records what each prompt matched (the consumers must agree);
    then `rounds` timed passes. Each round gives a p50 and a p99; the figures are the
    medians over rounds, so one disturbed round does not decide them."""
    digest = hashlib.sha256()
    best: list[int] = []
    hit_share: list[float] = []
    for p in asked:
        depths = c.depths(c.query(p.tokens.tolist(), p.hashes))
        digest.update(json.dumps(depths).encode())
        best.append(max(depths, default=0))
        hit_share.append(sum(d > 0 for d in depths) / max(1, len(depths)))
    p50s, p99s = [], []
    for _ in range(max(1, rounds)):
        times = []
        for p in asked:
            tokens = p.tokens.tolist()  # a router's prompt arrives as a list of ints
            start = time.perf_counter()
            c.query(tokens, p.hashes)
            times.append(time.perf_counter() - start)
        times.sort()
        p50s.append(percentile(times, 0.50) * 1e6)
        p99s.append(percentile(times, 0.99) * 1e6)
    return {
        "prompts": len(asked),
        "rounds": len(p50s),
        "p50_us": median(p50s),
        "p99_us": median(p99s),
        "round_p50_us": p50s,
        "round_p99_us": p99s,
        "mean_best_match_blocks": sum(best) / max(1, len(best)),
        "mean_instances_hit": sum(hit_share) / max(1, len(hit_share)),
        "matches_digest": digest.hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    args = json.loads((argv or sys.argv[1:])[0])
    spec = FillSpec(args["instances"], args["per_instance"], args.get("seed", 0))
    result = probe(args["consumer"], spec, args["prompts"], args["rounds"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
