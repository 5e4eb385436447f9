"""The routing bench's policies: where each request goes.

- `round_robin`: the next engine in turn.
- `least_loaded`: the fewest requests running and waiting (ties: the lower index).
- `approximate`: a cache-aware router without events, as SGLang's gateway routes
  (`cache_aware`): per engine, an LRU of the prompt blocks it sent there, bounded by the
  engine's pool; when the loads are unbalanced (the busiest has more than `balance_abs`
  requests more than the idlest and `balance_rel` times as many) the least loaded;
  else the engine whose LRU matches the most of the prompt if that is at least
  `cache_threshold` of it, else the least loaded. (sgl-router's defaults: 0.3, 64, 1.5.)
- `kvindex`: `POST /v1/route` on a `serve` that follows the engines' real events and
  load streams: kvindex's score (prefix by tier, queue, running, KV usage), predictions on.
- `kvindex_longest`: `POST /v1/lookup` (kvindex's longest match), taken among the engines
  whose load is within `load_bound` requests of the least loaded (else the least loaded).
- `oracle`: kvindex's score, computed over the engines' true pools and loads at the
  instant of the decision (`kvindex.runtime.routing.Router` itself, on a lookup answer
  made from the truth): what kvindex's route would choose with a perfect view.

The kvindex policies take the engines' figures only through `serve`; the others read the
engines directly (a router's own counters).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import msgspec

from kvindex.bench.e2e.probes import Client
from kvindex.bench.routing_ab.engines import Job, ModelEngine
from kvindex.runtime.routing import Load, Router, Weights
from kvindex.runtime.views import InstanceMatch, LookupAnswer, RankMatch
from kvindex.subscriber import Status

__all__ = [
    "BASELINES",
    "KVINDEX",
    "Approximate",
    "KvindexLongest",
    "KvindexMixed",
    "KvindexRoute",
    "LeastLoaded",
    "Oracle",
    "Policy",
    "RoundRobin",
]

KVINDEX = ("kvindex", "kvindex_longest", "kvindex_mixed")
BASELINES = ("round_robin", "least_loaded", "approximate", "oracle")


class Policy(Protocol):
    name: str

    def choose(self, job: Job, engines: Sequence[ModelEngine]) -> int: ...


def least_loaded(engines: Sequence[ModelEngine], among: Sequence[int] | None = None) -> int:
    pool = range(len(engines)) if among is None else among
    return min(pool, key=lambda i: (engines[i].load, engines[i].kv_usage, i))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, job: Job, engines: Sequence[ModelEngine]) -> int:
        i = self._next % len(engines)
        self._next += 1
        return i


class LeastLoaded:
    name = "least_loaded"

    def choose(self, job: Job, engines: Sequence[ModelEngine]) -> int:
        return least_loaded(engines)


class Approximate:
    """SGLang's cache-aware policy on a router-side LRU of what went where (module doc)."""

    name = "approximate"

    def __init__(
        self,
        capacity: int,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
    ) -> None:
        self.capacity = capacity  # blocks per engine: its pool, as configured
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.trees: list[OrderedDict[bytes, None]] = []

    def choose(self, job: Job, engines: Sequence[ModelEngine]) -> int:
        while len(self.trees) < len(engines):
            self.trees.append(OrderedDict())
        loads = [e.load for e in engines]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs and high > self.balance_rel * low:
            chosen = least_loaded(engines)
        else:
            matches = [_leading(tree, job.digests) for tree in self.trees]
            best = max(range(len(engines)), key=lambda i: (matches[i], -loads[i], -i))
            whole = max(1, len(job.digests))
            good = matches[best] / whole >= self.cache_threshold
            chosen = best if good and matches[best] else least_loaded(engines)
        self._insert(self.trees[chosen], job.digests)
        return chosen

    def _insert(self, tree: OrderedDict[bytes, None], digests: list[bytes]) -> None:
        for d in digests:
            tree[d] = None
            tree.move_to_end(d)
        while len(tree) > self.capacity:
            tree.popitem(last=False)


def _leading(tree: Mapping[bytes, None], digests: list[bytes]) -> int:
    n = 0
    for d in digests:
        if d not in tree:
            break
        n += 1
    return n


# -- kvindex's score on the truth -----------------------------------------------------------


class _TrueLoads:
    """The engines' loads now, as their load streams tell serve (a `LoadSource`)."""

    def __init__(self, engines: Sequence[ModelEngine]) -> None:
        self.by_name = {e.name: e for e in engines}

    def load(self, instance: str) -> Mapping[int, Load] | None:
        e = self.by_name.get(instance)
        if e is None:
            return None
        return {0: engine_load(e)}


def engine_load(e: ModelEngine) -> Load:
    return Load(
        waiting=float(len(e.waiting)),
        running=float(e.running),
        kv_usage=e.used_blocks * e.model.block_size / (e.model.gpu_blocks * e.model.block_size),
        at=time.monotonic(),
        block_size=e.model.block_size,
        waiting_tokens=float(e.waiting_tokens),
    )


class Oracle:
    """kvindex's score over the engines' true pools and loads (module doc)."""

    name = "oracle"

    def __init__(self, engines: Sequence[ModelEngine], weights: Weights | None = None) -> None:
        # Router.score reads the fleet only for a block size no row gives: every row does.
        self.router = Router(cast(Any, None), weights, loads=[_TrueLoads(engines)])

    def scores(self, job: Job, engines: Sequence[ModelEngine]) -> dict[str, float]:
        rows = []
        for e in engines:
            m = e.matched(job.digests)
            bs = e.model.block_size
            rows.append(
                InstanceMatch(
                    e.name,
                    Status.LIVE,
                    m,
                    m * bs,
                    bs,
                    0,
                    [RankMatch(0, m)],
                    {"gpu": m} if m else {},
                )
            )
        tokens = job.prompt.tolist()
        answer = self.router.score(LookupAnswer(None, rows), tokens, (None, None, None, None))
        return {row.name: row.score or 0.0 for row in answer.instances}

    def choose(self, job: Job, engines: Sequence[ModelEngine]) -> int:
        scores = self.scores(job, engines)
        top = max(scores.values())
        return next(i for i, e in enumerate(engines) if scores[e.name] == top)


# -- kvindex, over HTTP ------------------------------------------------------------------------


class KvindexRoute:
    """`POST /v1/route {"token_ids"}` on serve."""

    name = "kvindex"

    def __init__(self, url: str) -> None:
        self.client = Client(url)

    def choose(self, job: Job, engines: Sequence[ModelEngine]) -> int:
        body = msgspec.json.encode({"token_ids": job.prompt.tolist()})
        answer = msgspec.json.decode(
            self.client.send(self.client.prepare("POST", "/v1/route", body))
        )
        return _index(engines, str(answer["best"]))

    def close(self) -> None:
        self.client.close()


class KvindexMixed(KvindexRoute):
    """`POST /v1/route` on a fleet where some engines publish no KV events (`events=none`
    instances: serve knows of them only what it routed there)."""

    name = "kvindex_mixed"


class KvindexLongest:
    """`POST /v1/lookup {"token_ids"}`: the longest match within a load bound."""

    name = "kvindex_longest"

    def __init__(self, url: str, load_bound: int = 8) -> None:
        self.client = Client(url)
        self.load_bound = load_bound

    def choose(self, job: Job, engines: Sequence[ModelEngine]) -> int:
        body = msgspec.json.encode({"token_ids": job.prompt.tolist()})
        answer = msgspec.json.decode(
            self.client.send(self.client.prepare("POST", "/v1/lookup", body))
        )
        matched = {row["name"]: int(row["matched_blocks"]) for row in answer["instances"]}
        low = min(e.load for e in engines)
        fair = [i for i, e in enumerate(engines) if e.load <= low + self.load_bound]
        best = max(fair, key=lambda i: (matched.get(engines[i].name, 0), -engines[i].load, -i))
        return best if matched.get(engines[best].name, 0) else least_loaded(engines, fair)

    def close(self) -> None:
        self.client.close()


def _index(engines: Sequence[ModelEngine], name: str) -> int:
    for i, e in enumerate(engines):
        if e.name == name:
            return i
    raise KeyError(f"serve chose {name!r}, not an engine of the bench")
