"""One pass over a recorded stream: what every source held, stored, evicted and re-stored.

`Tracker.feed` takes the records in file (delivery) order. Per source (instance, DP rank)
it keeps vLLM's pools (copies per (KV group, medium, hash), as the index does) and
collects time series; for the fleet it keeps which sources hold each block now, so a
re-store can be checked against the rest of the fleet at that very moment.

Re-stores, the what-if accesses and holders are about the GPU medium (events without a
medium are GPU): that is where an evicted block costs a prefill recompute.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field

from kvindex.analysis.content import ContentIds
from kvindex.index.namespaces import salt_digest
from kvindex.recording import BatchRec, NoticeRec, Record
from kvindex.subscriber import SourceKey
from kvindex.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
)
from kvindex.wire.pools import DEFAULT_MEDIUM, PoolCopies, PoolKey, pool_of

__all__ = ["NamespaceTrack", "SourceTrack", "Tracker"]

Namespace = tuple[str | None, str | None]  # (LoRA name, the cache salt's digest)


@dataclass(slots=True)
class NamespaceTrack:
    """What one namespace (LoRA adapter, cache salt) stored, and in how many sessions."""

    stored: int = 0
    sessions: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Series:
    """Per-batch counts of one source, aligned with `t`."""

    t: array[float] = field(default_factory=lambda: array("d"))
    stored: array[int] = field(default_factory=lambda: array("q"))
    removed: array[int] = field(default_factory=lambda: array("q"))
    restored: array[int] = field(default_factory=lambda: array("q"))
    restored_tokens: array[int] = field(default_factory=lambda: array("q"))
    routable: array[int] = field(default_factory=lambda: array("q"))
    routable_tokens: array[int] = field(default_factory=lambda: array("q"))


@dataclass(slots=True)
class _Step:
    """What one batch did to its source."""

    stored: int = 0
    removed: int = 0
    restored: int = 0
    restored_tokens: int = 0
    routable: int = 0
    routable_tokens: int = 0
    media: set[str] = field(default_factory=set)


@dataclass(slots=True)
class SourceTrack:
    key: SourceKey
    pools: dict[PoolKey, dict[BlockHash, int]] = field(default_factory=dict)
    since: dict[tuple[PoolKey, BlockHash], float] = field(default_factory=dict)
    # The content id each GPU entry was held under: a hash can be stored again with other
    # content (an offloaded copy stored by hash only), and the release must undo the hold.
    gpu_held: dict[tuple[PoolKey, BlockHash], int] = field(default_factory=dict)
    known: dict[BlockHash, int] = field(default_factory=dict)  # hash -> content id
    ever: set[int] = field(default_factory=set)  # content ids ever stored on the GPU
    held: Counter[str] = field(default_factory=Counter)  # blocks held per medium
    occupancy: dict[str, tuple[array[float], array[int]]] = field(default_factory=dict)
    series: Series = field(default_factory=Series)
    lifetimes: array[float] = field(default_factory=lambda: array("d"))
    accesses: array[int] = field(default_factory=lambda: array("q"))  # GPU stores, by cid
    restore_flags: bytearray = field(default_factory=bytearray)  # per access: a re-store
    counts: Counter[str] = field(default_factory=Counter)
    last_t: float | None = None


class Tracker:
    """Feeds on recording records; `sources` and `content` hold the results."""

    def __init__(self) -> None:
        self.sources: dict[SourceKey, SourceTrack] = {}
        self.content = ContentIds()
        # GPU holders of each block now, with how many of its entries (groups) each holds
        self.holders: dict[int, Counter[SourceKey]] = {}
        self.shared_now = 0  # blocks held (GPU) on two or more instances now
        self.duplication: tuple[array[float], array[int], array[int]] = (
            array("d"),
            array("q"),
            array("q"),
        )
        self.decoder = BatchDecoder()
        self.namespaces: dict[Namespace, NamespaceTrack] = {}
        self.t0: float | None = None
        self.t1: float | None = None
        self.decode_failures = 0

    def copies(self, key: SourceKey) -> PoolCopies:
        """What the publisher holds now: pool -> hash -> copies (pools::PoolCopies)."""
        src = self.sources.get(key)
        if src is None:
            return {}
        return {pool: dict(held) for pool, held in src.pools.items() if held}

    def _source(self, key: SourceKey) -> SourceTrack:
        src = self.sources.get(key)
        if src is None:
            src = self.sources[key] = SourceTrack(key)
        return src

    # -- records -------------------------------------------------------------------------

    def feed(self, rec: Record) -> None:
        if isinstance(rec, BatchRec):
            self._batch(rec)
        elif isinstance(rec, NoticeRec):
            self._notice(rec)

    def _batch(self, rec: BatchRec) -> None:
        src = self._source(SourceKey(rec.instance, rec.rank))
        try:
            batch = self.decoder.decode(rec.payload)
        except WireError:
            self.decode_failures += 1
            src.counts["decode_failures"] += 1
            return
        t = _when(batch, rec.received)
        self.t0 = t if self.t0 is None else min(self.t0, t)
        self.t1 = t if self.t1 is None else max(self.t1, t)
        src.last_t = t
        src.counts["batches"] += 1
        step = _Step()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(src, event, t, step)
            elif isinstance(event, BlockRemoved):
                self._remove(src, event, t, step)
            elif isinstance(event, AllBlocksCleared):
                src.counts["clears"] += 1
                self._drop_all(src, t, step)
        self._sample(src, t, step)

    def _notice(self, rec: NoticeRec) -> None:
        src = self._source(SourceKey(rec.instance, rec.rank))
        if rec.kind == "Restarted":
            src.counts["restarts"] += 1
            if src.last_t is not None:
                step = _Step()
                self._drop_all(src, src.last_t, step)
                self._sample(src, src.last_t, step)
        elif rec.kind == "Lost":
            first, last = rec.fields.get("first"), rec.fields.get("last")
            if isinstance(first, int) and isinstance(last, int):
                src.counts["lost_batches"] += last - first + 1

    # -- events --------------------------------------------------------------------------

    def _store(self, src: SourceTrack, event: BlockStored, t: float, step: _Step) -> None:
        pool = pool_of(event.group_idx, event.medium)
        copies = src.pools.setdefault(pool, {})
        gpu = pool[1] == DEFAULT_MEDIUM
        ids = self.content.blocks(event, src.known)
        step.media.add(pool[1])
        self._namespace(event)
        for h, cid in zip(event.block_hashes, ids, strict=True):
            node = self.content.nodes[cid]
            node.stores += 1
            node.instances.add(src.key.instance)
            n = copies.get(h, 0)
            if gpu:
                self._access(src, cid, n == 0, node.block_size, step)
            copies[h] = n + 1
            if n == 0:
                src.since[(pool, h)] = t
                src.held[pool[1]] += 1
                if gpu:
                    src.gpu_held[(pool, h)] = cid
                    self._hold(src.key, cid)
        step.stored += len(event.block_hashes)

    def _namespace(self, event: BlockStored) -> None:
        namespace = (event.lora_name, salt_digest(event.cache_salt))
        track = self.namespaces.get(namespace)
        if track is None:
            track = self.namespaces[namespace] = NamespaceTrack()
        track.stored += len(event.block_hashes)
        if event.session_id is not None:
            track.sessions.add(event.session_id)

    def _access(self, src: SourceTrack, cid: int, absent: bool, size: int, step: _Step) -> None:
        restore = absent and cid in src.ever
        src.accesses.append(cid)
        src.restore_flags.append(restore)
        src.ever.add(cid)
        if not restore:
            return
        step.restored += 1
        step.restored_tokens += size
        if self.holders.get(cid):
            step.routable += 1
            step.routable_tokens += size

    def _remove(self, src: SourceTrack, event: BlockRemoved, t: float, step: _Step) -> None:
        pool = pool_of(event.group_idx, event.medium)
        copies = src.pools.get(pool, {})
        step.media.add(pool[1])
        for h in event.block_hashes:
            n = copies.get(h, 0)
            if n == 0:
                src.counts["unknown_removals"] += 1
                continue
            step.removed += 1
            if n > 1:
                copies[h] = n - 1
                continue
            del copies[h]
            self._release(src, pool, h, t)

    def _release(self, src: SourceTrack, pool: PoolKey, h: BlockHash, t: float) -> None:
        since = src.since.pop((pool, h), None)
        if since is not None:
            src.lifetimes.append(max(0.0, t - since))
        src.held[pool[1]] -= 1
        cid = src.gpu_held.pop((pool, h), None)
        if cid is not None:
            self._unhold(src.key, cid)

    def _drop_all(self, src: SourceTrack, t: float, step: _Step) -> None:
        for pool, copies in src.pools.items():
            step.media.add(pool[1])
            for h in copies:
                self._release(src, pool, h, t)
            copies.clear()

    # -- fleet-wide holders ----------------------------------------------------------------

    def _hold(self, key: SourceKey, cid: int) -> None:
        holders = self.holders.setdefault(cid, Counter())
        before = _instances(holders)
        holders[key] += 1
        if before == 1 and _instances(holders) == 2:
            self.shared_now += 1

    def _unhold(self, key: SourceKey, cid: int) -> None:
        holders = self.holders.get(cid)
        if holders is None or key not in holders:
            return
        before = _instances(holders)
        holders[key] -= 1
        if holders[key] <= 0:
            del holders[key]
        if before == 2 and _instances(holders) == 1:
            self.shared_now -= 1
        if not holders:
            del self.holders[cid]

    # -- series ----------------------------------------------------------------------------

    def _sample(self, src: SourceTrack, t: float, step: _Step) -> None:
        s = src.series
        s.t.append(t)
        s.stored.append(step.stored)
        s.removed.append(step.removed)
        s.restored.append(step.restored)
        s.restored_tokens.append(step.restored_tokens)
        s.routable.append(step.routable)
        s.routable_tokens.append(step.routable_tokens)
        for medium in step.media:
            ts, ns = src.occupancy.setdefault(medium, (array("d"), array("q")))
            ts.append(t)
            ns.append(src.held[medium])
        if step.media:  # stores, removals, and clears or restarts that dropped blocks
            dt, held, shared = self.duplication
            dt.append(t)
            held.append(len(self.holders))
            shared.append(self.shared_now)


def _instances(holders: Counter[SourceKey]) -> int:
    if len(holders) < 2:
        return len(holders)
    return len({key.instance for key in holders})


def _when(batch: EventBatch, received: float) -> float:
    """The batch's own time (the engine's clock); the receive time if that is nonsense."""
    ts = batch.ts
    return ts if math.isfinite(ts) and ts > 0 else received
