"""What an engine without KV events holds, as far as the router knows: an approximate tree.

An instance spec may say `events=none` (kvindex.subscriber.spec): the engine publishes no
KV events (vLLM without `--kv-events-config`, another OpenAI-compatible server), so kvindex
can only learn its cache from what `/v1/route` sent there, as the SGLang gateway's
approximate tree does. Per such instance, `ApproximateCaches` keeps the blocks of the
prompts routed there:

- a block is its whole chain from the prompt's first token (model, LoRA adapter, cache
  salt and multimodal keys included, as predictions are namespaced), so two prompts share
  exactly the blocks of their common whole-block prefix;
- an LRU bounded by the engine's pool (`gpu_blocks=` in the spec, else its `/metrics`'
  `num_gpu_blocks`, else a default): routing a prompt there
  touches its blocks, deepest first, so its first blocks are the most recent and a pool
  past its bound drops the deepest blocks of the least recently routed prompts first (as
  vLLM's free queue evicts a request's tail blocks before its head);
- each block expires `ttl=` seconds after it was last routed (the engine's own traffic,
  which kvindex never sees, evicts it sooner or later); an engine whose `/metrics` says it
  sleeps has dropped them all.

A lookup that asks for a score and `/v1/route` count an events=none instance's blocks from
here, and every row from it says `approximate: true`; the index itself stays exact (a
plain `/v1/lookup` and the block lists show only what engines published). Nothing here is
persisted: after a restart an events=none instance starts empty, as a fresh engine would.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = ["ApproxStats", "ApproximateCaches", "chain_keys"]


def chain_keys(namespace: Hashable, data: bytes, block_size: int) -> list[int]:
    """One key per whole block of `data` (uint32 token ids): the block's chain from the
    first token in `namespace`, so equal keys mean equal prefixes (up to a 64-bit hash)."""
    width = 4 * block_size
    key = hash((namespace, block_size))
    keys = []
    for start in range(0, len(data) - width + 1, width):
        key = hash((key, data[start : start + width]))
        keys.append(key)
    return keys


@dataclass(slots=True)
class ApproxStats:
    """One events=none instance's approximate cache: what `/metrics` and the views show."""

    blocks: int = 0  # held now
    capacity: int = 0  # the bound (its pool: `gpu_blocks=`)
    ttl: float = 0.0
    routed: int = 0  # prompts recorded (routed there)
    evicted: int = 0  # blocks dropped at the bound (LRU)
    expired: int = 0  # blocks dropped by age (TTL)


class _Pool:
    def __init__(self, capacity: int, ttl: float) -> None:
        self.blocks: OrderedDict[int, float] = OrderedDict()  # key -> expiry, LRU first
        self.stats = ApproxStats(capacity=capacity, ttl=ttl)

    def expire(self, now: float) -> None:
        # One TTL for the pool and every touch moves a block to the end: the front
        # expires first.
        blocks = self.blocks
        while blocks:
            key, expires = next(iter(blocks.items()))
            if expires > now:
                break
            del blocks[key]
            self.stats.expired += 1


class ApproximateCaches:
    """The approximate caches of the events=none instances (the module doc). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}

    def configure(self, instance: str, capacity: int, ttl: float) -> None:
        """Keep at most `capacity` blocks for `instance`, each `ttl` seconds. A pool kept
        goes on with its blocks: a smaller bound drops the least recent ones (evicted), a
        new TTL applies from each block's next routing."""
        if capacity < 1 or not ttl > 0:
            raise ValueError(f"an approximate cache needs capacity >= 1 and ttl > 0 ({instance})")
        with self._lock:
            pool = self._pools.get(instance)
            if pool is None:
                self._pools[instance] = _Pool(capacity, ttl)
                return
            pool.stats.capacity, pool.stats.ttl = capacity, ttl
            while len(pool.blocks) > capacity:
                pool.blocks.popitem(last=False)
                pool.stats.evicted += 1

    def clear(self, instance: str) -> int:
        """The engine dropped its whole cache (it sleeps): forget its blocks; how many."""
        with self._lock:
            pool = self._pools.get(instance)
            if pool is None:
                return 0
            dropped = len(pool.blocks)
            pool.blocks.clear()
            return dropped

    def forget(self, instance: str) -> None:
        with self._lock:
            self._pools.pop(instance, None)

    def instances(self) -> list[str]:
        with self._lock:
            return sorted(self._pools)

    def record(self, instance: str, namespace: Hashable, data: bytes, block_size: int) -> int:
        """The prompt (uint32 token ids) was routed to `instance`: its whole blocks are
        there now, the most recent. Returns how many (0: not an events=none instance)."""
        keys = chain_keys(namespace, data, block_size)
        with self._lock:
            pool = self._pools.get(instance)
            if pool is None or not keys:
                return 0
            now = self._clock()
            pool.expire(now)
            blocks, expires = pool.blocks, now + pool.stats.ttl
            for key in reversed(keys):  # deepest first: the first blocks end most recent
                blocks[key] = expires
                blocks.move_to_end(key)
            while len(blocks) > pool.stats.capacity:
                blocks.popitem(last=False)
                pool.stats.evicted += 1
            pool.stats.routed += 1
            return len(keys)

    def match(self, instance: str, namespace: Hashable, data: bytes, block_size: int) -> int:
        """How many whole blocks of the prompt, from its first, `instance` is assumed to
        hold (a lookup does not touch them: only routing a prompt there does)."""
        keys = chain_keys(namespace, data, block_size)
        matched = 0
        with self._lock:
            pool = self._pools.get(instance)
            if pool is None:
                return 0
            pool.expire(self._clock())
            held = pool.blocks
            for key in keys:
                if key not in held:
                    break
                matched += 1
        return matched

    def stats(self, instance: str) -> ApproxStats | None:
        """The instance's counters (None: not an events=none instance)."""
        with self._lock:
            pool = self._pools.get(instance)
            if pool is None:
                return None
            pool.expire(self._clock())
            return ApproxStats(
                len(pool.blocks),
                pool.stats.capacity,
                pool.stats.ttl,
                pool.stats.routed,
                pool.stats.evicted,
                pool.stats.expired,
            )
