"""`ShardedIndex`: the fleet index split by instance over compiled shards, one per ingest
worker, so that workers apply batches at the same time without sharing memory.

One compiled index written by two ingest threads is slower than one thread: both take its
write lock in turn, and the index's memory moves between their cores with each batch
(docs/performance.md: a drain of 1 M block events, 2 workers 0.68x one). Here each worker
applies into a shard of its own -- an instance lives wholly in one shard, the one holding
the fewest instances when it is first seen (a hash of the name, as llm-d shards pods, put
six of eight "e0".."e7" in one of two shards) -- so nothing written is shared and two
workers drain 1.9-2.0x one (measured beside it, same run). Each shard is a whole `CompiledIndex`
with its own lock; a batch is applied within one shard, so a lookup never sees half of one.

The shards share one numbering of publishers (`BitPool`): a bit names one publisher in
all of them, so their layouts, bits and tree walks merge as they are. Their digests share
one seed, so the same prefix has the same key in every shard (`walk_tree` merges them).

A lookup walks every shard, each under its own lock, and merges their answers by bit, in
C (`lookup_json`, and the C lookup thread through `answer_core`); a prefix two shards both
hold is kept in each. A SQLite store's warm start loads in C into every shard at once
(`ingest_api`, `register_publisher`). docs/performance.md measures what that costs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvindex.index.base import AnswerSlot, BitPool, Layout, LookupRow, PayloadResult
from kvindex.index.reference import Namespace
from kvindex.index.stats import CacheStats, RateWindow
from kvindex.subscriber.messages import Delivery, Item, Restarted, SourceKey
from kvindex.wire import BlockHash, EventBatch
from kvindex.wire.pools import PoolCopies

if TYPE_CHECKING:
    from kvindex.index.compiled import CompiledIndex

__all__ = ["ShardedIndex"]


class ShardedIndex:
    """`shards` compiled indexes, an instance wholly in one (see the module's doc)."""

    def __init__(
        self,
        shards: int,
        rate_window: float = 60.0,
        shared_tokens: bool = True,
        local_hashes: bool = False,
    ) -> None:
        if shards < 1:
            raise ValueError("an index has one shard at least")
        from kvindex.index import COMPILED

        if not COMPILED:
            raise ValueError("index shards need the compiled core (this is the pure index)")
        from kvindex.index._core import lookup_json_shards
        from kvindex.index.compiled import CompiledIndex

        seed = int.from_bytes(os.urandom(8), "little")
        bits = BitPool()
        self.rates = RateWindow(rate_window)
        self.shards = [
            CompiledIndex(rate_window, seed, shared_tokens, local_hashes, bits)
            for _ in range(shards)
        ]
        for shard in self.shards:
            shard.rates = self.rates  # one window: RateWindow.add takes its own lock
            shard.record_default_keys()  # `_merged` sizes the rows matching nothing
        self.local_hashes = local_hashes
        self._cores = tuple(shard._core for shard in self.shards)
        self._lookup_json_shards = lookup_json_shards
        self._layout: tuple[tuple[int, ...], Layout] | None = None
        self._placed: dict[str, int] = {}  # instance -> its shard, until removed
        self._held = [0] * shards  # instances placed in each shard
        self._placing = threading.Lock()

    def place(self, instance: str) -> int:
        """The shard of an instance: where it was put when first seen (a batch, a load, or
        the runtime adding it), else now, in the shard holding the fewest instances."""
        with self._placing:
            shard = self._placed.get(instance)
            if shard is None:
                held = self._held
                shard = self._placed[instance] = held.index(min(held))
                held[shard] += 1
            return shard

    def unplace(self, instance: str) -> None:
        """Give back the place of an instance this index holds nothing of (an add that
        failed after placing it); one it holds publishers of keeps its place."""
        with self._placing:
            shard = self._placed.get(instance)
            if shard is not None and not self.shards[shard].sources(instance):
                del self._placed[instance]
                self._held[shard] -= 1

    def shard_counts(self) -> list[int]:
        """The instances placed in each shard."""
        with self._placing:
            return list(self._held)

    def shard_of(self, instance: str) -> CompiledIndex:
        """The shard holding the instance (one that does not, for one never seen: a
        question about it places nothing, and gets the answer one index would give)."""
        return self.shards[self._placed.get(instance, 0)]

    def _home(self, instance: str) -> CompiledIndex:
        """The shard a batch of the instance goes to (placing it, if new)."""
        return self.shards[self.place(instance)]

    @property
    def slow_batches(self) -> int:
        return sum(shard.slow_batches for shard in self.shards)

    # -- feeding (a worker applies to its own shard; these are for loads and tests) -------

    def apply(self, source: SourceKey, batch: EventBatch, seq: int | None = None) -> None:
        self._home(source.instance).apply(source, batch, seq)

    def apply_payload(
        self, source: SourceKey, payload: bytes | memoryview, seq: int | None = None
    ) -> PayloadResult:
        return self._home(source.instance).apply_payload(source, payload, seq)

    def handle(self, item: Item) -> None:
        if isinstance(item, Delivery | Restarted):
            self._home(item.source.instance).handle(item)

    # -- a C loader's way in (kvindex.store.sqlite.fastload: a warm start in C) ----------

    def ingest_api(self) -> tuple[object, tuple[object, ...]]:
        """(capsule, the shards' Cores): the loader applies each publisher's batches through
        its shard's Core, as `register_publisher` says."""
        return self.shards[0].ingest_api()[0], self._cores

    def register_publisher(self, source: SourceKey) -> tuple[int, int]:
        """(bit, shard) of `source`, placed and numbered now if new."""
        shard = self.place(source.instance)
        return self.shards[shard].register_publisher(source), shard

    def applied_in_c(
        self,
        source: SourceKey,
        last_seq: int | None,
        ts: float | None,
        counts: tuple[int, int, int],
    ) -> None:
        self.shard_of(source.instance).applied_in_c(source, last_seq, ts, counts)

    def drop_source(self, source: SourceKey) -> None:
        self.shard_of(source.instance).drop_source(source)

    def remove_instance(self, name: str) -> None:
        """Forget the instance, and where it was put (added again, it goes where fewest are)."""
        with self._placing:
            shard = self._placed.pop(name, None)
            if shard is not None:
                self._held[shard] -= 1
        if shard is not None:
            self.shards[shard].remove_instance(name)

    # -- one instance or publisher: its shard's -------------------------------------------

    def source_state(self, source: SourceKey) -> tuple[int | None, float | None]:
        return self.shard_of(source.instance).source_state(source)

    def copies(self, source: SourceKey) -> PoolCopies:
        return self.shard_of(source.instance).copies(source)

    def count(self, source: SourceKey, group: int, medium: str, block_hash: BlockHash) -> int:
        return self.shard_of(source.instance).count(source, group, medium, block_hash)

    def block_hashes(self, instance: str, medium: str | None = None) -> set[BlockHash]:
        return self.shard_of(instance).block_hashes(instance, medium)

    def block_count(self, instance: str) -> int:
        return self.shard_of(instance).block_count(instance)

    def blocks_by_medium(self, instance: str) -> dict[str, int]:
        return self.shard_of(instance).blocks_by_medium(instance)

    def cache_stats(self, instance: str) -> CacheStats:
        return self.shard_of(instance).cache_stats(instance)

    def has_instance(self, name: str) -> bool:
        return self.shard_of(name).has_instance(name)

    # -- the fleet: every shard's ---------------------------------------------------------

    def instances(self) -> list[str]:
        return sorted(name for shard in self.shards for name in shard.instances())

    def sources(self, instance: str | None = None) -> list[SourceKey]:
        if instance is not None:
            return self.shard_of(instance).sources(instance)
        return [key for shard in self.shards for key in shard.sources()]

    def source_bits(self) -> dict[int, SourceKey]:
        return {bit: key for shard in self.shards for bit, key in shard.source_bits().items()}

    def layout(self) -> Layout:
        """The shards' layouts as one, by name (the same object while none changed)."""
        parts = [shard.layout() for shard in self.shards]
        ids = tuple(id(part) for part in parts)
        cached = self._layout
        if cached is not None and cached[0] == ids:
            return cached[1]
        merged = sorted((row for part in parts for row in part), key=lambda row: row[0])
        self._layout = (ids, merged)
        return merged

    def entries(self) -> int:
        return sum(shard.entries() for shard in self.shards)

    def tree_nodes(self) -> int:
        """Nodes of every shard's tree (a prefix two shards hold counts twice)."""
        return sum(shard.tree_nodes() for shard in self.shards)

    def memory(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for shard in self.shards:
            for part, size in shard.memory().items():
                total[part] = total.get(part, 0) + size
        return total

    def walk_tree(self) -> Iterator[tuple[Namespace, int, bytes, int]]:
        """As `CompiledIndex.walk_tree`, over the shards' trees merged: a prefix several
        shards hold is one node, its holders all of theirs (the walk is read whole first)."""
        return _merged_walk([list(shard.walk_keys()) for shard in self.shards])

    # -- lookups: every shard's rows -------------------------------------------------------

    def lookup(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        **keys: Any,
    ) -> list[LookupRow]:
        return self._merged(lambda s: s.lookup(token_ids, lora_name, cache_salt, **keys))

    def lookup_hashes(self, block_hashes: Sequence[BlockHash]) -> list[LookupRow]:
        rows = (row for shard in self.shards for row in shard.lookup_hashes(block_hashes))
        return sorted(rows, key=_name)  # no tree walked: every empty row says size 0

    def lookup_local_hashes(
        self,
        hashes: Sequence[int],
        lora_name: str | None = None,
        block_size: int | None = None,
    ) -> list[LookupRow]:
        return self._merged(lambda s: s.lookup_local_hashes(hashes, lora_name, block_size))

    def lookup_json(
        self,
        token_ids: Sequence[int] | bytes,
        lora_name: str | None,
        cache_salt: str | None,
        slots: list[AnswerSlot],
        statuses: list[bytes],
    ) -> tuple[bytes, bool]:
        """`CompiledIndex.lookup_json` over every shard: each walked under its own lock, the
        answers merged by bit and written as JSON in C (`slots`' bits are the shards'
        common numbering, as `layout` gives them)."""
        answer: tuple[bytes, bool] = self._lookup_json_shards(
            self._cores, token_ids, lora_name, cache_salt, slots, statuses
        )
        return answer

    def answer_core(self) -> object:
        """What a C thread answers lookups with (lookup_api.h's `core`): the shards' Cores
        as a tuple, which the core's lookup API walks one by one and merges."""
        return self._cores

    def sources_gen(self) -> int:
        """The sum of the shards' generations (each only grows: the sum moves when one
        does), what the lookup API checks a tuple of Cores against."""
        return sum(core.sources_gen() for core in self._cores)

    def _merged(self, ask: Callable[[CompiledIndex], list[LookupRow]]) -> list[LookupRow]:
        """Every shard's rows, one per instance by name, as one index gives them: an
        instance matching nothing says the block size of the smallest tree walked in any
        shard (each shard says its own smallest)."""
        rows: list[LookupRow] = []
        keys = []
        for shard in self.shards:
            rows += ask(shard)
            keys.append(shard.last_default_key())
        walked = [key for key in keys if key]
        size = min(walked) & ~BIGRAM_TREE if walked else 0
        rows = [_sized(row, size) for row in rows]
        rows.sort(key=_name)
        return rows


BIGRAM_TREE = 0x80000000  # core.h: a bigram tree's size key (sorts after every plain one)


def _name(row: LookupRow) -> str:
    return row.instance


def _sized(row: LookupRow, size: int) -> LookupRow:
    """A row matching nothing with the merged answer's block size (else as it is)."""
    if row.block_size == size or row.matched_blocks or row.by_group or row.by_tier:
        return row
    return msgspec.structs.replace(row, block_size=size)


_Node = tuple[Namespace, int, bytes, int]  # namespace, depth, tokens, holders


def _merged_walk(walks: list[list[tuple[Namespace, int, int, bytes, int]]]) -> Iterator[_Node]:
    """Depth-first over the union of the shards' trees: a node is its parent and its key
    (the digest of its block, the same in every shard: one seed)."""
    children: dict[int, list[int]] = {}
    nodes: list[list[Any]] = []  # [namespace, depth, tokens, holders]
    found: dict[tuple[int, Namespace, int], int] = {}
    for walk in walks:
        stack: list[tuple[int, int]] = []  # the current path: (merged id, depth)
        for namespace, depth, key, tokens, holders in walk:
            while stack and stack[-1][1] >= depth:
                stack.pop()
            parent = stack[-1][0] if stack else -1
            at = (parent, namespace, key)
            node = found.get(at)
            if node is None:
                node = found[at] = len(nodes)
                nodes.append([namespace, depth, tokens, holders])
                children.setdefault(parent, []).append(node)
            else:
                merged = nodes[node]
                merged[3] |= holders
                merged[2] = merged[2] or tokens
            stack.append((node, depth))
    order = list(reversed(children.get(-1, [])))
    while order:
        node = order.pop()
        namespace, depth, tokens, holders = nodes[node]
        yield namespace, depth, tokens, holders
        order.extend(reversed(children.get(node, [])))
