"""What both index implementations share: publishers and their bits, and answers' shape.

`kvindex.index.reference.ReferenceIndex` (pure Python, the reference) and
`kvindex.index.compiled.CompiledIndex` (the C core) keep a fleet's state differently; both
number publishers with bits the same way, answer `lookup` with the same rows, and count
the same stats, through this base.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

import msgspec

from kvindex.index.reuse import Reuse
from kvindex.index.stats import CacheStats, RateWindow
from kvindex.subscriber.messages import Delivery, Item, Restarted, SourceKey
from kvindex.wire import BatchDecoder, BlockHash, EventBatch
from kvindex.wire.pools import DEFAULT_POOL
from kvindex.wire.tiers import tier_of

__all__ = [
    "AnswerSlot",
    "BitPool",
    "IndexBase",
    "LookupRow",
    "PayloadResult",
    "Publisher",
    "medium_matches",
]


# A followed instance as a compiled lookup answer shows it (CompiledIndex.lookup_json): its
# name as JSON, and its DP ranks by rank as a flat [rank, bit, rank, bit, ...] (bit -1: the
# index holds nothing of that rank yet).
AnswerSlot = tuple[bytes, list[int]]


class PayloadResult(msgspec.Struct, frozen=True, gc=False):
    """What `apply_payload` applied: the batch's time and DP rank, and the events that
    were malformed or of an unknown type (skipped and counted, by the Python decoder).
    `fast`: the compiled parser took the batch (no Python object per event)."""

    ts: float
    dp_rank: int | None
    malformed_events: int = 0
    unknown_events: int = 0
    fast: bool = False


class LookupRow(msgspec.Struct, frozen=True, gc=False):
    """What one instance (its best DP rank) would reuse of a prompt.

    `matched_blocks` counts whole blocks from the first token: GPU blocks, then the run
    lower tiers hold from there. `by_tier` splits them by tier (`gpu`, `cpu`, `disk`,
    `external`); `by_group` is each KV cache group's own GPU hit (hybrid models).

    Rows, and the dicts in them, may be shared between answers (an instance matching
    nothing gets the same row each time): treat them as read-only.
    """

    instance: str
    matched_blocks: int
    matched_tokens: int
    block_size: int
    best_rank: int
    ranks: dict[int, int]  # DP rank -> matched blocks
    by_tier: dict[str, int] = {}
    by_group: dict[int, int] = {}


def medium_matches(medium: str, wanted: str) -> bool:
    """Whether a pool's medium is the one asked for, by raw name or by tier name."""
    return medium == wanted or tier_of(medium) == wanted.lower()


class Publisher(Protocol):
    key: SourceKey
    bit: int
    last_seq: int | None
    last_ts: float | None


P = TypeVar("P", bound=Publisher)

Layout = list[tuple[str, list[tuple[int, int]]]]  # instance -> [(DP rank, bit)]


class BitPool:
    """The numbers publishers go by (their bits in the tree's holder sets): the last one
    freed first, else the next. An index has its own; the shards of a `ShardedIndex`
    share one, so a bit names one publisher across all of them (their layouts and walks
    merge as they are)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._free: list[int] = []

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._next - 1

    def give_back(self, bit: int) -> None:
        with self._lock:
            self._free.append(bit)


class IndexBase(Generic[P]):
    """Publishers by key and by bit; the answer's layout; rates; `handle`.

    Ingest threads add publishers while HTTP requests read: publishers are numbered under a
    lock, and every walk over them is over a snapshot (`list(...)` of a dict is one step
    under the GIL)."""

    def __init__(self, rate_window: float = 60.0, bits: BitPool | None = None) -> None:
        self._publishers_lock = threading.Lock()
        self._sources: dict[SourceKey, P] = {}
        self._by_bit: dict[int, P] = {}
        self._bits = bits if bits is not None else BitPool()
        self._layout: Layout | None = None
        # The rows of instances matching nothing, per size, for one layout (by identity).
        self._empty_rows: tuple[Layout | None, dict[int, list[LookupRow]]] = (None, {})
        self._decoder = BatchDecoder()
        self.rates = RateWindow(rate_window)

    # -- what each implementation provides ----------------------------------------------

    def apply(self, source: SourceKey, batch: EventBatch, seq: int | None = None) -> None:
        raise NotImplementedError

    def apply_payload(
        self, source: SourceKey, payload: bytes | memoryview, seq: int | None = None
    ) -> PayloadResult:
        """Decode and apply one batch as the publisher sent it. Raises `WireError` for a
        payload that is not an event batch at all."""
        batch = self._decoder.decode(payload)
        self.apply(source, batch, seq)
        return PayloadResult(
            batch.ts, batch.data_parallel_rank, batch.malformed_events, batch.unknown_events
        )

    def drop_source(self, source: SourceKey) -> None:
        raise NotImplementedError

    def remove_instance(self, name: str) -> None:
        raise NotImplementedError

    def _pool_keys(self, pub: P) -> list[tuple[int, str]]:
        """The publisher's pools, (KV cache group, medium), in the order they came."""
        raise NotImplementedError

    def _pool_hashes(self, pub: P, index: int) -> Iterable[BlockHash]:
        """The hashes one pool of the publisher holds (its index in `_pool_keys`)."""
        raise NotImplementedError

    def _stats(self, pub: P) -> CacheStats:
        raise NotImplementedError

    def _hashes(self, pub: P, medium: str | None) -> Iterator[BlockHash]:
        for index, (_, pool_medium) in enumerate(self._pool_keys(pub)):
            if medium is None or medium_matches(pool_medium, medium):
                yield from self._pool_hashes(pub, index)

    def _only_pool(self, pub: P) -> tuple[int, str]:
        """(group, medium) of a publisher with one pool (or the GPU's if it has none)."""
        return next(iter(self._pool_keys(pub)), DEFAULT_POOL)

    # -- publishers -----------------------------------------------------------------------

    def handle(self, item: Item) -> None:
        """Feed one item of a `Subscriber`: apply deliveries, drop state on restarts."""
        if isinstance(item, Delivery):
            self.apply(item.source, item.batch, item.seq)
        elif isinstance(item, Restarted):
            self.drop_source(item.source)

    def _register(self, source: SourceKey, make: Callable[[SourceKey, int], P]) -> P:
        """The publisher of `source`, numbered now if new (the next free bit)."""
        with self._publishers_lock:
            pub = self._sources.get(source)
            if pub is None:
                bit = self._bits.take()
                pub = make(source, bit)
                self._by_bit[bit] = pub
                self._sources[source] = pub
                self._layout = None
            return pub

    def _forget(self, pub: P) -> None:
        with self._publishers_lock:
            del self._sources[pub.key], self._by_bit[pub.bit]
            self._bits.give_back(pub.bit)
            self._layout = None

    def _publishers(self) -> list[tuple[SourceKey, P]]:
        """Every publisher, a snapshot taken under the publishers' lock: one step, never a
        view of a half-made registration or removal (the dict and the bits agree)."""
        with self._publishers_lock:
            return list(self._sources.items())

    def _instance_publishers(self, instance: str) -> list[P]:
        return [p for k, p in self._publishers() if k.instance == instance]

    def instances(self) -> list[str]:
        return sorted({key.instance for key, _ in self._publishers()})

    def sources(self, instance: str | None = None) -> list[SourceKey]:
        return [k for k, _ in self._publishers() if instance is None or k.instance == instance]

    def has_instance(self, name: str) -> bool:
        return any(k.instance == name for k, _ in self._publishers())

    def source_bits(self) -> dict[int, SourceKey]:
        """Bit number (as in the tree's masks) -> the publisher it stands for."""
        return {pub.bit: key for key, pub in self._publishers()}

    def source_state(self, source: SourceKey) -> tuple[int | None, float | None]:
        pub = self._sources.get(source)
        return (None, None) if pub is None else (pub.last_seq, pub.last_ts)

    # -- held blocks ----------------------------------------------------------------------

    def block_hashes(self, instance: str, medium: str | None = None) -> set[BlockHash]:
        """Every distinct hash the instance holds now (all ranks, groups; one medium or
        tier, or all)."""
        out: set[BlockHash] = set()
        for pub in self._instance_publishers(instance):
            out.update(self._hashes(pub, medium))
        return out

    def block_count(self, instance: str) -> int:
        return len(self.block_hashes(instance))

    def blocks_by_medium(self, instance: str) -> dict[str, int]:
        """Distinct hashes held per medium (union over ranks and groups)."""
        per_medium: dict[str, set[BlockHash]] = {}
        for pub in self._instance_publishers(instance):
            for index, (_, medium) in enumerate(self._pool_keys(pub)):
                per_medium.setdefault(medium, set()).update(self._pool_hashes(pub, index))
        return {medium: len(hashes) for medium, hashes in sorted(per_medium.items())}

    def cache_stats(self, instance: str) -> CacheStats:
        total = CacheStats()
        for pub in self._instance_publishers(instance):
            total.merge(self._stats(pub))
        total.active = self.block_count(instance)
        return total

    # -- answers --------------------------------------------------------------------------

    def _rows(self, found: dict[int, Reuse], default_size: int = 0) -> list[LookupRow]:
        """One row per instance, by name; a publisher missing from `found` matched nothing
        (its row is shared between answers: rows are immutable)."""
        layout = self._layout or self._lay_out()
        empty = self._empty_for(default_size, layout)
        rows = []
        for (name, ranks), nothing in zip(layout, empty, strict=True):
            if len(ranks) == 1:
                rank, bit = ranks[0]
                reuse = found.get(bit)
                if reuse is None or not (reuse.blocks or any(reuse.by_group.values())):
                    rows.append(nothing)
                    continue
                rows.append(self._row(name, rank, {rank: reuse.blocks}, reuse, bit))
                continue
            per_rank = {rank: (found[bit].blocks if bit in found else 0) for rank, bit in ranks}
            best_rank, best_bit = max(ranks, key=lambda rb: (per_rank[rb[0]], -rb[0]))
            reuse = found.get(best_bit)
            if reuse is None or not (reuse.blocks or any(reuse.by_group.values())):
                rows.append(nothing)
                continue
            rows.append(self._row(name, best_rank, per_rank, reuse, best_bit))
        return rows

    def _row(
        self, name: str, rank: int, ranks: dict[int, int], reuse: Reuse, bit: int
    ) -> LookupRow:
        by_tier, by_group = reuse.by_tier, reuse.by_group
        if not reuse.detailed:  # a publisher with one pool: all of it comes from that pool
            group, medium = self._only_pool(self._by_bit[bit])
            by_tier = {tier_of(medium): reuse.blocks}
            by_group = {group: reuse.blocks}
        size = reuse.size
        return LookupRow(
            name, reuse.blocks, reuse.blocks * size, size, rank, ranks, by_tier, by_group
        )

    def layout(self) -> Layout:
        """Instances by name, each with its (DP rank, bit) pairs by rank (the object stays
        the same until the set of publishers changes: callers may cache what they derive
        from it by identity)."""
        return self._layout or self._lay_out()

    def _lay_out(self) -> Layout:
        """Instances by name, each with its (DP rank, bit) pairs by rank: what a lookup
        answer is shaped like, kept until the set of publishers changes. Made and kept
        under the publishers' lock: one made from before a publisher joined must not be
        kept after the join dropped the old one (the new row would be missing)."""
        with self._publishers_lock:
            by_name: dict[str, list[tuple[int, int]]] = {}
            for key, pub in self._sources.items():
                by_name.setdefault(key.instance, []).append((key.rank, pub.bit))
            layout = [(name, sorted(ranks)) for name, ranks in sorted(by_name.items())]
            self._layout = layout
        return layout

    def _empty_for(self, size: int, layout: Layout, key: int = 0) -> list[LookupRow]:
        """The shared rows of instances matching nothing, for `layout`: the one the answer
        is shaped by, which a publisher joining or leaving on another thread may have
        replaced as `self._layout` meanwhile (issue 27 point 5). `key`: the tree size
        `size` comes from, as the compiled core keys it (what a ShardedIndex reads)."""
        shaped_by, by_size = self._empty_rows
        if shaped_by is not layout:
            by_size = {}
            self._empty_rows = (layout, by_size)
        rows = by_size.get(size)
        if rows is None:
            rows = [
                LookupRow(name, 0, 0, size, ranks[0][0], {rank: 0 for rank, _ in ranks})
                for name, ranks in layout
            ]
            by_size[size] = rows
        return rows
