"""The stores' own view of the fleet: which blocks each publisher holds, grouped in *runs*.

A store's worker process keeps this mirror of the service's index, fed the same batches in
the same order, to know what its snapshot must say. It never answers lookups, so it keeps
no prefix tree: per publisher and pool (KV cache group, medium) a hash -> run map (one
entry per block held) and the extra copies of the few blocks held more than once, which is
a dict operation or two per block.

A run is what one BlockStored brought into a pool: the blocks' hashes in chain order, the
chain's parent, their tokens, block size, LoRA name and time, and how the index took the
store (its rank: hash-only, tokens but unplaced because the parent had no place in the
prefix tree, or placed). A block belongs to one run, the first that brought it, unless a
later store ranks higher (as the index re-places a block it held without a place); more
stores of a block only add copies. So a pool's runs partition its blocks, and a snapshot is
the set of runs, each written once and rewritten only when it changes (see snapshot.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, TypeAlias

import msgspec

from kvindex.index.keys import flat_pairs
from kvindex.index.namespaces import chain_keys, lora_key
from kvindex.index.reference import event_tokens, is_keyed, is_plain
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BigramBlockStored,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
)
from kvindex.wire.events import _WireBigramBlockStored
from kvindex.wire.pools import PoolCopies, PoolKey, pool_of
from kvindex.wire.tiers import TIER_GPU, tier_of

__all__ = [
    "HASH_ONLY",
    "PLACED",
    "UNPLACED",
    "Changes",
    "Mirror",
    "Pool",
    "PublisherRuns",
    "Run",
    "RunKeys",
]

HASH_ONLY, UNPLACED, PLACED = 0, 1, 2  # run ranks: a block belongs to its best run
# A store's own token list until its run is saved, then int64 (a fifth of the memory).
Tokens: TypeAlias = "list[int] | array[int]"

# A record's events: its chain first (then copies, and the blocks gone since: snapshot.py).
_decode_events = msgspec.msgpack.Decoder(list[BlockStored | BlockRemoved]).decode
# A bigram run's record: its chain as SGLang sends bigram pages (`token_ids` pairs).
_decode_bigram_events = msgspec.msgpack.Decoder(list[_WireBigramBlockStored | BlockRemoved]).decode


def _record_chain(blob: bytes) -> BlockStored:
    """The chain event a record's events start with."""
    try:
        chain = _decode_events(blob)[0]
    except msgspec.ValidationError:
        wire = _decode_bigram_events(blob)[0]
        assert isinstance(wire, _WireBigramBlockStored)
        return wire.event()
    assert isinstance(chain, BlockStored)
    return chain


class RunKeys(msgspec.Struct, frozen=True, gc=False):
    """What a store said beside its tokens that decides where its blocks go in the prefix
    tree (kvindex.index.namespaces): per-block extra keys (vLLM's salt, LoRA name,
    multimodal and prompt-embeds keys), SGLang's cache salt, per-block lookahead tokens,
    pre-0.14 vLLM's LoRA id, and whether the event was of 0.17-0.19 vLLM (no `group_idx`:
    a bare string in block 0 is read differently). A snapshot writes them back as they
    came, so a restart places every block where the live index had it."""

    extra: list[Any] | None = None
    salt: str | None = None
    lookahead: list[list[int]] | None = None
    lora_id: int | None = None
    legacy: bool = False
    # The KV cache group's kind and window as the event said (0.22+): what a hybrid
    # lookup follows (FleetIndex's group specs).
    spec_kind: str | None = None
    spec_window: int | None = None
    # SGLang's EAGLE bigram pages: the run's tokens are its pages' pairs, flattened (two
    # token ids per unit), and its record's chain is written as SGLang sends them.
    bigram: bool = False

    @property
    def plain(self) -> bool:
        """No keys beside the tokens (the group's spec aside)."""
        return (
            self.extra is None
            and self.salt is None
            and self.lookahead is None
            and (self.lora_id is None)
            and not self.bigram
        )

    def part(self, start: int, stop: int) -> RunKeys:
        """The keys of blocks start..stop-1 (for a run cut into pieces)."""
        if self.plain:
            return self
        extra, lookahead = self.extra, self.lookahead
        return RunKeys(
            None if extra is None else extra[start:stop],
            self.salt,
            None if lookahead is None else lookahead[start:stop],
            self.lora_id,
            self.legacy,
            self.spec_kind,
            self.spec_window,
            self.bigram,
        )


def keys_with_spec(keys: RunKeys | None, spec: RunKeys | None) -> RunKeys | None:
    """`keys` (a run's placement keys) with the group spec `spec` says (another pool's)."""
    kind = None if spec is None else spec.spec_kind
    window = None if spec is None else spec.spec_window
    if keys is None or keys.plain:
        legacy = keys.legacy if keys is not None else spec is not None and spec.legacy
        if kind is None and window is None:
            return None if keys is None or not legacy else RunKeys(legacy=True)
        return _spec_only(kind, window, legacy)
    return msgspec.structs.replace(keys, spec_kind=kind, spec_window=window)


# Keys with nothing but a group's spec, made once each (nearly every run of a 0.22+ engine
# has such keys: one shared object, not one per run).
_SPEC_ONLY: dict[tuple[str | None, int | None, bool], RunKeys] = {}


def _spec_only(kind: str | None, window: int | None, legacy: bool) -> RunKeys:
    keys = _SPEC_ONLY.get((kind, window, legacy))
    if keys is None:
        keys = _SPEC_ONLY[(kind, window, legacy)] = RunKeys(
            legacy=legacy, spec_kind=kind, spec_window=window
        )
    return keys


def run_keys(event: BlockStored) -> RunKeys | None:
    """The keys a run of this store must keep (None: a plain store of an engine that names
    no group spec; LoRA by name only is the run's `lora`)."""
    kind, window = event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window
    bigram = isinstance(event, BigramBlockStored)
    if is_plain(event) and event.lora_id is None and not bigram:
        if kind is None and window is None:
            return None
        return _spec_only(kind, window, event.group_idx is None)
    return RunKeys(
        event.extra_keys,
        event.cache_salt,
        event.lookahead_token_ids,
        event.lora_id if event.lora_name is None else None,
        event.group_idx is None,
        kind,
        window,
        bigram,
    )


class Run(msgspec.Struct, gc=False, eq=False):
    """Blocks one BlockStored brought into a pool (some may have left or moved since:
    `PublisherRuns.members` says which still belong to it).

    A msgspec Struct: built in C (a store makes one), compared and hashed by identity, and
    not tracked by the cyclic GC (it holds no reference back to anything that holds it),
    so millions of them cost no collection time.
    """

    id: int
    group: int
    medium: str
    parent: BlockHash | None
    hashes: list[BlockHash]
    size: int
    lora: str | None
    ts: float
    tokens: Tokens | None
    # HASH_ONLY, UNPLACED (tokens, but the index could not place the chain: its parent was
    # not in the prefix tree when it came) or PLACED. A run loaded from a snapshot keeps
    # its tokens encoded in `blob` until it must be rewritten.
    rank: int
    blob: bytes | None = None
    saved: bool = False  # a record of it is in the snapshot
    # The store's keys beside its tokens (placed and unplaced runs only; None: plain). A
    # loaded run has them in `blob` until it must be rewritten.
    keys: RunKeys | None = None

    @property
    def content(self) -> bool:
        return self.rank > HASH_ONLY

    def _unpack(self) -> None:
        """Tokens and keys out of `blob` (the record's events as a msgpack array: the
        chain comes first)."""
        if self.blob is not None:
            chain = _record_chain(self.blob)
            if self.rank:
                self.tokens = array("q", event_tokens(chain)[0])
            self.keys = run_keys(chain)
            self.blob = None

    def event_keys(self) -> RunKeys | None:
        self._unpack()
        return self.keys

    @property
    def width(self) -> int:
        """Token ids per block in `tokens`: `size`, or twice that for bigram pages."""
        keys = self.event_keys()
        return 2 * self.size if keys is not None and keys.bigram else self.size

    def flat_tokens(self) -> list[int] | None:
        """The blocks' tokens, `size` per block (None for hash-only runs)."""
        if self.tokens is None:
            self._unpack()
        tokens = self.tokens
        if tokens is None:
            return None
        n = self.width * len(self.hashes)
        return tokens[:n] if isinstance(tokens, list) else tokens[:n].tolist()

    def compact(self) -> None:
        """Keep the tokens as int64 (a fifth of a list's memory), now that the run lasts.
        A token past 64 bits can't be placed by the index: the run is hash-only then."""
        tokens = self.tokens
        if isinstance(tokens, list):
            try:
                self.tokens = array("q", tokens[: self.width * len(self.hashes)])
            except OverflowError:
                self.tokens, self.rank = None, HASH_ONLY


@dataclass(slots=True)
class Pool:
    """The blocks of one pool: hash -> the run it belongs to (one entry per block held),
    and the copies beyond the first of the few blocks held more than once."""

    blocks: dict[BlockHash, Run] = field(default_factory=dict)
    extra: dict[BlockHash, int] = field(default_factory=dict)

    def copies(self, h: BlockHash) -> int:
        return 1 + self.extra.get(h, 0) if self.extra else 1


@dataclass(slots=True)
class PublisherRuns:
    """One publisher: its pools, its runs (by id) and the runs changed since a snapshot."""

    pools: dict[PoolKey, Pool] = field(default_factory=dict)
    runs: dict[int, Run] = field(default_factory=dict)
    dirty: set[Run] = field(default_factory=set)
    # Hash -> how many runs hang from it (their `parent`). A block gone from its pool is
    # kept in its run's record while some run hangs from it, as the index keeps its node
    # while blocks hang from it (snapshot._cut); `kept_for` says which run keeps it.
    parents: dict[BlockHash, int] = field(default_factory=dict)
    kept_for: dict[BlockHash, Run] = field(default_factory=dict)

    def add(self, run: Run, dirty: bool = True) -> None:
        self.runs[run.id] = run
        if run.parent is not None:
            self.parents[run.parent] = self.parents.get(run.parent, 0) + 1
        if dirty:
            self.dirty.add(run)

    def drop(self, run: Run) -> None:
        del self.runs[run.id]
        self.unhang(run.parent)

    def rehang(self, run: Run, parent: BlockHash | None) -> None:
        """`run` hangs from `parent` now."""
        if parent != run.parent:
            old, run.parent = run.parent, parent
            if parent is not None:
                self.parents[parent] = self.parents.get(parent, 0) + 1
            self.unhang(old)

    def unhang(self, parent: BlockHash | None) -> None:
        """One run less hangs from `parent`: the run keeping it may let it go."""
        if parent is None:
            return
        left = self.parents.get(parent, 0) - 1
        if left > 0:
            self.parents[parent] = left
            return
        self.parents.pop(parent, None)
        keeper = self.kept_for.pop(parent, None)
        if keeper is not None and self.runs.get(keeper.id) is keeper:
            self.dirty.add(keeper)

    def hung_from(self, h: BlockHash) -> bool:
        return h in self.parents

    def pool(self, key: PoolKey) -> Pool:
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = Pool()
        return pool

    def members(self, run: Run) -> list[int]:
        """Positions of `run.hashes` that still belong to it (each hash once)."""
        pool = self.pools.get((run.group, run.medium))
        if pool is None:
            return []
        blocks, hashes = pool.blocks, run.hashes
        live = [i for i, h in enumerate(hashes) if blocks.get(h) is run]
        if len({hashes[i] for i in live}) < len(live):
            # A hash twice in one store: the second was a copy, not a block of the run.
            first: dict[BlockHash, int] = {}
            for i in live:
                first.setdefault(hashes[i], i)
            live = sorted(first.values())
        return live

    def blocks(self) -> int:
        return sum(len(pool.blocks) for pool in self.pools.values())


@dataclass
class Changes:
    """What changed since the last snapshot: runs to rewrite per publisher, publishers
    whose whole state went (restart, AllBlocksCleared) and instances removed."""

    dirty: dict[SourceKey, set[Run]] = field(default_factory=dict)
    cleared: set[SourceKey] = field(default_factory=set)
    removed: set[str] = field(default_factory=set)
    # Publishers fed anything at all (so a shared store's cursor for them moves on, even
    # for batches that changed nothing).
    touched: set[SourceKey] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.dirty or self.cleared or self.removed or self.touched)


class Mirror:
    """The publishers' blocks as runs, fed raw batches; notes which runs changed."""

    def __init__(self) -> None:
        self.sources: dict[SourceKey, PublisherRuns] = {}
        self.cleared: set[SourceKey] = set()
        self.removed: set[str] = set()
        self.touched: set[SourceKey] = set()
        self.next_id = 1
        self.decode_errors = 0
        # Which snapshot each publisher's saved runs are in (a shared store's: its writer
        # and position); a compaction may write only the changes while it is still there.
        self.snapshot_of: dict[SourceKey, object] = {}
        self._decoder = BatchDecoder()

    # -- feeding -----------------------------------------------------------------------

    def apply_payload(self, source: SourceKey, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except WireError:
            self.decode_errors += 1  # the service skipped it too; its seq still counted
            self.touched.add(source)
            return
        self.apply_batch(source, batch)

    def apply_batch(self, source: SourceKey, batch: EventBatch) -> None:
        self.touched.add(source)
        src = self.source(source)
        dirty = src.dirty
        # Removals come one event per evicted block, so per-event work is most of the
        # cost: consecutive removals from one pool reuse it (`pool`, while `medium` and
        # `group` match).
        pool: Pool | None = None
        medium: str | None = None
        group: int | None = None
        blocks: dict[BlockHash, Run] = {}
        for event in batch.events:
            if isinstance(event, BlockRemoved):
                if pool is None or event.medium != medium or event.group_idx != group:
                    medium, group = event.medium, event.group_idx
                    pool = src.pools.get(pool_of(group, medium))
                    if pool is None:
                        continue
                    blocks = pool.blocks
                if pool.extra or len(src.pools) > 1:
                    self._remove(src, pool, event.block_hashes)
                    continue
                for h in event.block_hashes:
                    run = blocks.pop(h, None)
                    if run is not None:  # else not known to be held: nothing to drop
                        dirty.add(run)
            elif isinstance(event, BlockStored):
                if event.block_hashes:
                    self._store(src, event, batch.ts)
                pool = None  # it may have created the pool a removal looked for
            elif isinstance(event, AllBlocksCleared):
                src, pool = self._clear(source), None
                dirty = src.dirty

    def restart(self, source: SourceKey) -> None:
        self.touched.add(source)
        self._clear(source)

    def remove_instance(self, name: str) -> None:
        for key in [k for k in self.sources if k.instance == name]:
            del self.sources[key]
            self.snapshot_of.pop(key, None)
        self.cleared = {s for s in self.cleared if s.instance != name}
        self.touched = {s for s in self.touched if s.instance != name}
        self.removed.add(name)

    def copies(self, key: SourceKey) -> PoolCopies:
        """What the publisher holds now: pool -> hash -> copies (pools::PoolCopies)."""
        src = self.sources.get(key)
        if src is None:
            return {}
        return {
            pool_key: {h: pool.copies(h) for h in pool.blocks}
            for pool_key, pool in src.pools.items()
            if pool.blocks
        }

    def source(self, key: SourceKey) -> PublisherRuns:
        src = self.sources.get(key)
        if src is None:
            src = self.sources[key] = PublisherRuns()
        return src

    def new_run_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _store(self, src: PublisherRuns, event: BlockStored, ts: float) -> None:
        hashes = event.block_hashes
        pool_key = pool_of(event.group_idx, event.medium)
        pool = src.pool(pool_key)
        blocks = pool.blocks
        run = self._new_run(src, pool_key, event, ts, _rank(src, pool, event))
        if blocks.keys().isdisjoint(hashes):
            # The common case, a chain of new blocks: in bulk (unless a hash repeats).
            before = len(blocks)
            blocks.update(zip(hashes, repeat(run)))
            if len(blocks) - before == len(hashes):
                if len(src.pools) > 1 and run.rank != UNPLACED:
                    self._across_pools(src, pool_key, run, event)
                return
            for h in dict.fromkeys(hashes):
                del blocks[h]  # undone: the one-by-one way below counts the copies
        extra, dirty = pool.extra, src.dirty
        joined = False
        for h in hashes:
            had = blocks.get(h)
            if had is not None:
                extra[h] = extra.get(h, 0) + 1
                dirty.add(had)  # one more copy
                # The block moves only to a better run, as the index re-places a block
                # only when a store places what it held unplaced.
                if run.rank <= had.rank:
                    continue
            blocks[h] = run
            joined = True
        if not joined:  # only more copies: no run of its own
            src.drop(run)
            dirty.discard(run)
            return
        if len(src.pools) > 1 and run.rank != UNPLACED:
            self._across_pools(src, pool_key, run, event)

    def _new_run(
        self, src: PublisherRuns, pool: PoolKey, event: BlockStored, ts: float, rank: int
    ) -> Run:
        # The event's own lists are kept (no copy): most runs are gone before a snapshot.
        self.next_id += 1
        run = Run(
            self.next_id - 1, pool[0], pool[1], event.parent_block_hash, event.block_hashes,
            event.block_size, event.lora_name, ts, _tokens(event) if rank else None, rank,
            keys=run_keys(event),
        )  # fmt: skip
        src.add(run)
        return run

    def _remove(self, src: PublisherRuns, pool: Pool, hashes: list[BlockHash]) -> None:
        """Removals when the pool holds blocks more than once, or is one of several."""
        blocks, extra, dirty = pool.blocks, pool.extra, src.dirty
        for h in hashes:
            if extra and h in extra:  # one of several copies goes
                n = extra[h]
                if n > 1:
                    extra[h] = n - 1
                else:
                    del extra[h]
                dirty.add(blocks[h])
                continue
            run = blocks.pop(h, None)
            if run is None:
                continue  # not known to be held: nothing to drop (as the index does)
            dirty.add(run)

    def _across_pools(
        self, src: PublisherRuns, pool_key: PoolKey, run: Run, event: BlockStored
    ) -> None:
        """A placed chain of a publisher with several pools: a GPU or keyed one takes the
        other pools' copies of its blocks over, an unkeyed lower-tier one keeps the places
        its blocks have elsewhere (FleetIndex._insert_chain_in_several)."""
        if run.rank == HASH_ONLY:
            if run.size:
                self._keep_places(src, pool_key, run)
        elif _keyed(pool_key, event):
            self._take_over(src, pool_key, run)
        else:
            self._keep_places(src, pool_key, run)

    def _take_over(self, src: PublisherRuns, pool_key: PoolKey, run: Run) -> None:
        """A GPU or keyed chain was placed: the publisher's other pools that hold one of
        its blocks without a place, or on a lower tier in another namespace, now hold it
        at this place (as FleetIndex._take_over does), kept past this chain's own copies."""
        for key, other in src.pools.items():
            if key == pool_key:
                continue
            gpu = tier_of(key[1]) == TIER_GPU
            moved, spec = [], None
            for i, h in enumerate(run.hashes):
                held = other.blocks.get(h)
                if held is None or held is run or (held.size and held.size != run.size):
                    continue
                if held.rank == PLACED and (gpu or _same_namespace(held, run)):
                    continue  # a GPU group's own place stands; the same namespace: same node
                moved.append(i)
                spec = held
                src.dirty.add(held)
            if spec is not None:
                self._place_like(src, key, run, moved, spec)

    def _keep_places(self, src: PublisherRuns, pool_key: PoolKey, run: Run) -> None:
        """A chain the index places where the publisher holds its blocks elsewhere: an
        unkeyed lower-tier chain (vLLM's offload events carry no keys) keeps the keyed
        places its blocks have, and goes on from there; a store that can't say where its
        blocks go (no tokens, a window group's skipped blocks) takes any place they have
        (FleetIndex._store_elsewhere_placed). Such blocks move to a run that has those
        places; the rest of a chain is cut after them, and so hangs from them when
        loaded."""
        pool = src.pools[pool_key]
        placed = run.rank == PLACED
        found: dict[int, tuple[Run, list[int]]] = {}
        for h in run.hashes:
            if pool.blocks.get(h) is not run:
                continue
            for key, other in src.pools.items():
                held = other.blocks.get(h) if key != pool_key else None
                if held is None or held.rank != PLACED or held.size != run.size:
                    continue
                if placed and held.lora is None and _plain(held.event_keys()):
                    break  # placed plain, where this chain puts it too
                found.setdefault(held.id, (held, []))[1].append(held.hashes.index(h))
                break
        for like, positions in found.values():
            self._place_like(src, pool_key, like, positions, run)

    def _place_like(
        self, src: PublisherRuns, pool: PoolKey, like: Run, positions: list[int], own: Run
    ) -> None:
        """A run of `pool` holding blocks `positions` of `like` at the places they have
        there. It is `like`'s chain up to the last of them, the blocks of it this pool does
        not hold stored and removed again when loaded (snapshot.py): they hang where
        `like`'s do even once `like`'s blocks are gone. Its group spec is `own`'s (a run
        of `pool`)."""
        last = max(positions) + 1
        flat, size, width = like.flat_tokens(), like.size, like.width
        keys = keys_with_spec(like.event_keys(), own.event_keys())
        self.next_id += 1
        run = Run(
            self.next_id - 1, pool[0], pool[1], like.parent, like.hashes[:last], size,
            like.lora, like.ts, None if flat is None else flat[: last * width], like.rank,
            keys=None if keys is None else keys.part(0, last),
        )  # fmt: skip
        blocks = src.pools[pool].blocks
        for i in positions:
            blocks[like.hashes[i]] = run
        src.add(run)

    def _clear(self, source: SourceKey) -> PublisherRuns:
        src = self.sources[source] = PublisherRuns()
        self.cleared.add(source)
        return src

    # -- snapshots ---------------------------------------------------------------------

    def changed(self) -> bool:
        return bool(self.touched or self.cleared or self.removed)

    def take(self) -> Changes:
        """What changed since the last take (and forget it)."""
        changes = Changes(cleared=self.cleared, removed=self.removed, touched=self.touched)
        self.cleared, self.removed, self.touched = set(), set(), set()
        for key, src in self.sources.items():
            if src.dirty:
                changes.dirty[key] = src.dirty
                src.dirty = set()
        return changes

    def drop(self, source: SourceKey) -> None:
        """Forget one publisher and its changes (it is about to be loaded again)."""
        self.sources.pop(source, None)
        self.cleared.discard(source)
        self.touched.discard(source)
        self.snapshot_of.pop(source, None)

    def rewrite_whole(self, sources: Iterable[SourceKey]) -> None:
        """Publishers whose changes were taken but not written (a failure midway): the
        next snapshot of each is written whole."""
        for source in sources:
            if source in self.sources:
                self.touched.add(source)
                self.snapshot_of[source] = None

    def forget(self, changes: Changes) -> None:
        """Changes no snapshot will be written from (another replica writes them): drop the
        runs they emptied, and have each publisher's next snapshot written whole."""
        for source, runs in changes.dirty.items():
            src = self.sources.get(source)
            if src is not None:
                for run in runs:
                    if src.runs.get(run.id) is not run or src.members(run):
                        continue
                    if not any(src.hung_from(h) for h in run.hashes):
                        src.drop(run)
            self.snapshot_of[source] = None
        for source in changes.cleared:
            self.snapshot_of[source] = None


def _tokens(event: BlockStored) -> list[int]:
    """A store's tokens as its run keeps them (a bigram page's pairs flattened)."""
    if isinstance(event, BigramBlockStored):
        return flat_pairs(event.token_pairs)
    return event.token_ids


def _keyed(pool_key: PoolKey, event: BlockStored) -> bool:
    """A store whose place decides its blocks' namespace on every tier (FleetIndex's
    `keyed`): a GPU store, or one naming a LoRA adapter, a salt or own keys."""
    if tier_of(pool_key[1]) == TIER_GPU or lora_key(event) is not None:
        return True
    return not is_plain(event) and is_keyed(event, chain_keys(event))


def _same_namespace(a: Run, b: Run) -> bool:
    """Whether two placed runs are surely in one namespace (then one hash is one node)."""
    return a.lora == b.lora and _plain(a.event_keys()) and _plain(b.event_keys())


def _plain(keys: RunKeys | None) -> bool:
    return keys is None or keys.plain


def _rank(src: PublisherRuns, pool: Pool, event: BlockStored) -> int:
    """How the index takes a store: hash-only, unplaced or placed in the prefix tree (as
    FleetIndex._anchor decides; token ids past 64 bits are found out when the run is
    first saved)."""
    tokens, width, size = event_tokens(event)
    if size <= 0 or len(tokens) != width * len(event.block_hashes):
        # No tokens, a partial block, or a window group's skipped blocks (their tokens
        # are in the event, their hashes not): the index places each block where the
        # publisher holds its hash elsewhere, which a restart finds again by hash.
        return HASH_ONLY
    n = len(event.block_hashes)
    extra, lookahead = event.extra_keys, event.lookahead_token_ids
    if (extra is not None and len(extra) != n) or (lookahead is not None and len(lookahead) != n):
        # Keys not one per block: the index gives every block an own key made of its
        # position in this event, which a run cut into pieces can't keep. Such blocks are
        # never found by a lookup; saved by hash, they still count.
        return HASH_ONLY
    parent = event.parent_block_hash
    if parent is None:
        return PLACED
    held = pool.blocks.get(parent)
    if held is not None and held.rank == PLACED:
        return PLACED
    others = (p.blocks.get(parent) for p in src.pools.values() if p is not pool)
    return PLACED if any(r is not None and r.rank == PLACED for r in others) else UNPLACED
