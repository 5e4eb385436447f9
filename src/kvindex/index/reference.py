"""The live state of a fleet: which blocks each publisher holds, and a token-prefix tree.

Two structures, both fed by `apply`:

- Per publisher (instance and DP rank) *pools*, one per (KV cache group, medium), mapping a
  block hash to the tree node it stands for (one entry per block; copies beyond the first
  are counted aside). vLLM announces one BlockStored per copy and one BlockRemoved per
  evicted copy, so a hash is held while it has a copy.
- One prefix tree for the whole fleet, built from the events' own `parent_block_hash`,
  `token_ids` and extra keys (never by recomputing an engine's hash, whose algorithm and
  seed vary by release and deployment). A node is one block of tokens under its parent,
  with its *own keys* if it has any (see `namespaces`); a root per *namespace* (LoRA
  adapter, cache salt, block size), inherited along the parent link. A node's `mask` has
  bit *i* set while publisher *i* holds it in any pool, under any of its hashes.

How a stored hash finds its node (`Placement`):

- A chain whose tokens cover exactly its hashes is placed block by block under its parent
  (the root of its namespace when it starts a prompt, else the node the publisher holds
  the parent hash at, in a tree of the same block size).
- Where the event can't say a hash's position -- a sliding-window group's event that
  skipped blocks (tokens of more blocks than hashes), a partial-block event, a hash-only
  event, a chain whose parent is unknown -- the hash takes the node the publisher holds
  the same hash at in another pool of that block size (the full-attention group's
  placement), else it is held out of the tree (counted, never guessed).
- A partial-block entry (vLLM 0.33's `cache_partial_block`: one hash unit of a larger
  block) hangs inside its group's block, under the block before it or the partial entry
  of the unit before (`_store_partial`); lookups of publishers whose engine hits inside
  blocks (Mamba "align") read them (`_fine_reuse`).
- A GPU group whose blocks are smaller than another group's of the same publisher (vLLM's
  groups of different block sizes) hangs its chains in the larger blocks' tree, unit by
  unit (`_store_units`), so both groups' hashes of one block are one node.
- A hash keeps its namespace across tiers: an unkeyed store on a lower tier (vLLM's CPU
  offload events carry no extra keys, even for salted requests) takes the node the
  publisher already holds that hash at; and when a keyed or GPU copy arrives later at
  another node, the lower tiers' entries move to it.

A node stays held by a publisher while any of its (pool, hash) entries points at it:
two hashes on the same tokens (a LoRA name reused with another adapter path) or one hash
in two pools never clear each other. Publishers with one pool keep this as the mask bit
plus a rarely used count (`refs`); publishers with several pools (hybrid groups, offload
tiers) also keep, per node, which pools hold it (`where`), which their lookups read.

What a lookup answers is what the engine would reuse (`matched_blocks`): GPU blocks from
the first, then the run that lower tiers hold from there; for hybrid models what vLLM's
hybrid coordinator returns (full attention sets the bound, a sliding-window group needs
its window's last blocks). See `lookup`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, TypeVar

import msgspec

from kvindex.index.base import IndexBase, LookupRow, medium_matches
from kvindex.index.keys import (
    BIGRAM,
    block_keys,
    block_size_of,
    chain_keys_bytes,
    flat_pairs,
    key_tokens,
    prompt_keys,
    tree_size,
)
from kvindex.index.localhash import as_unsigned, block_local_hash, namespace_seed
from kvindex.index.multimodal import MMFeature, MMKey, PromptKeys
from kvindex.index.namespaces import PLAIN, ChainKeys, LoraKey, chain_keys, lora_key
from kvindex.index.reuse import GroupSpec, Reuse, engine_reuse, unit_reuse
from kvindex.index.stats import CacheStats
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import (
    AllBlocksCleared,
    BigramBlockStored,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from kvindex.wire.pools import DEFAULT_POOL, PoolCopies, PoolKey, pool_of
from kvindex.wire.tiers import TIER_GPU, TIERS, tier_of

__all__ = [
    "LookupRow",
    "Namespace",
    "ReferenceIndex",
    "block_keys",
    "event_tokens",
    "is_keyed",
    "key_tokens",
    "medium_matches",
]

# (LoRA adapter, cache salt, tree size: the block size, with keys.BIGRAM for the pages of
# an EAGLE bigram cache)
Namespace = tuple[LoraKey, str | None, int]


class _Node(msgspec.Struct, gc=False, eq=False):
    """One block of tokens (and own keys) under its parent.

    `children` is None for a leaf, the child itself when there is one (most nodes: a chain
    costs no dict per block), else a dict of two or more keyed by the children's keys.
    Compared and hashed by identity (`where` and `refs` key by node).

    Not tracked by the cyclic garbage collector: millions of nodes would make every full
    collection walk the whole tree. The parent <-> children cycle is broken by hand when a
    node is pruned, and for the whole tree when the index goes away (`ReferenceIndex.__del__`).
    """

    parent: _Node | None
    key: bytes
    mask: int = 0
    children: dict[bytes, _Node] | _Node | None = None
    # The hash of the block's first placement. A fleet whose engines share a hash seed
    # (PYTHONHASHSEED, as KV-aware routing needs) announces the same hash for the same
    # block, so every publisher's pool can key it by this one object (saves ~48 bytes per
    # extra holder).
    hash: BlockHash | None = None


# A pool's value for a block that has no place in the tree (hash-only, unanchored).
_LOOSE = _Node(None, b"")

Pool = dict[BlockHash, _Node]


@dataclass(slots=True)
class _PoolInfo:
    """What a publisher's pool is: its bit in `where`, KV cache group, medium and tier, and
    the block size of its events (the largest seen: partial-block events are smaller)."""

    index: int
    group: int
    medium: str
    tier: str
    size: int = 0
    # The tree its blocks hang in when another group's blocks are larger (`_store_units`):
    # that group's block size (0: its own size).
    tree: int = 0


@dataclass(slots=True)
class _Source:
    key: SourceKey
    bit: int
    # (group, medium) -> hash -> the block's tree node (or _LOOSE): one entry per block held.
    pools: dict[PoolKey, Pool] = field(default_factory=dict)
    info: dict[PoolKey, _PoolInfo] = field(default_factory=dict)
    # Copies beyond the first, for the few blocks vLLM holds more than once.
    extra: dict[tuple[PoolKey, BlockHash], int] = field(default_factory=dict)
    # Entries of one pool at one node beyond the first (two hashes on the same tokens).
    refs: dict[tuple[_Node, int], int] = field(default_factory=dict)
    # With two pools or more: node -> the pools (bits of _PoolInfo.index) holding it.
    where: dict[_Node, int] | None = None
    # KV cache group -> its spec as the events say (0.22+), for hybrid lookups.
    groups: dict[int, GroupSpec] = field(default_factory=dict)
    stats: CacheStats = field(default_factory=CacheStats)
    # The hash block size its partial-block entries show (0: none seen): its KV cache
    # groups' blocks are whole multiples of it, and vLLM's hybrid lookups may hit there.
    unit: int = 0
    last_seq: int | None = None
    last_ts: float | None = None
    # 1 << bit, made once: every node only this publisher holds shares this int object
    # as its mask (an int past 2**8 is otherwise a 32-byte object per node).
    flag: int = field(init=False)

    def __post_init__(self) -> None:
        self.flag = 1 << self.bit


class ReferenceIndex(IndexBase[_Source]):
    """Exact per-publisher block state and token-prefix lookups for a whole fleet."""

    def __init__(self, rate_window: float = 60.0, local_hashes: bool = False) -> None:
        """`local_hashes`: lookups by Dynamo's local hashes (`lookup_local_hashes`) are
        always answered here (the stored tokens are hashed as the walk goes); the
        argument is the compiled index's, which keeps them only when asked."""
        super().__init__(rate_window)
        self.local_hashes = local_hashes
        self._roots: dict[Namespace, _Node] = {}
        self._root_ns: dict[int, Namespace] = {}  # id(root) -> its namespace
        self._sizes: dict[int, int] = {}  # block size -> roots of that size
        self._all_mask = 0
        self._several = 0  # bits of the publishers with two pools or more (`where`)

    def __del__(self) -> None:
        # The tree's nodes are invisible to the cyclic GC: unlink them so they are freed.
        stack = list(getattr(self, "_roots", {}).values())
        while stack:
            node = stack.pop()
            stack.extend(_kids(node))
            node.parent = node.children = None

    # -- feeding -----------------------------------------------------------------------

    def apply(self, source: SourceKey, batch: EventBatch, seq: int | None = None) -> None:
        """Apply one delivered batch of `source`."""
        src = self._sources.get(source) or self._source(source)
        stats = src.stats
        stored = removed = clears = 0
        # The common case runs inline: removals from a publisher with one pool (vLLM sends
        # one event per evicted block, so per-event overhead is most of the cost). `fast`
        # is that pool while the case holds (same medium and group as the last), else None.
        pools = src.pools
        extra = src.extra
        refs = src.refs
        fast: Pool | None = None
        fast_key: PoolKey = DEFAULT_POOL
        medium: str | None = None
        group: int | None = None
        keep = ~src.flag
        for event in batch.events:
            if isinstance(event, BlockRemoved):
                hashes = event.block_hashes
                removed += len(hashes)
                if fast is None or event.medium != medium or event.group_idx != group:
                    fast_key = pool_of(event.group_idx, event.medium)
                    fast = pools.get(fast_key) if len(pools) == 1 else None
                    if fast is None:
                        self._remove(src, fast_key, hashes)
                        continue
                    medium, group = event.medium, event.group_idx
                for h in hashes:
                    node = fast.pop(h, None)
                    if node is None:
                        continue  # not known to be held (e.g. stored before a loss)
                    if extra and (fast_key, h) in extra:
                        _drop_copy(extra, (fast_key, h))  # one of several copies went
                        fast[h] = node
                    elif node is not _LOOSE:
                        if refs and (node, 0) in refs:
                            _drop_copy(refs, (node, 0))  # another hash still holds it
                            continue
                        mask = node.mask = node.mask & keep
                        if not mask and not node.children:
                            self._prune(node)
            elif isinstance(event, BlockStored):
                self._store(src, event)
                stored += len(event.block_hashes)
                if len(pools) != 1:
                    fast = None
            elif isinstance(event, AllBlocksCleared):
                self._clear(src)
                clears += 1
                fast = None
        stats.stored += stored
        stats.removed += removed
        stats.clears += clears
        stats.batches += 1
        src.last_seq = seq
        src.last_ts = batch.ts
        self.rates.add(stored, removed, clears)

    def drop_source(self, source: SourceKey) -> None:
        """Forget what `source` holds (its engine restarted): its cache is empty now."""
        src = self._sources.get(source)
        if src is not None:
            self._clear(src)
            src.stats.restarts += 1

    def remove_instance(self, name: str) -> None:
        for src in list(self._instance_publishers(name)):
            self._clear(src)
            self._all_mask &= ~src.flag
            self._forget(src)

    def _source(self, key: SourceKey) -> _Source:
        src = self._register(key, _Source)
        self._all_mask |= src.flag
        return src

    def _pool(self, src: _Source, pool_key: PoolKey) -> tuple[Pool, _PoolInfo] | None:
        """The publisher's pool of (group, medium), made if new; None past MAX_POOLS."""
        pool = src.pools.get(pool_key)
        if pool is not None:
            return pool, src.info[pool_key]
        if len(src.pools) >= MAX_POOLS:
            return None
        pool = src.pools[pool_key] = {}
        info = src.info[pool_key] = _PoolInfo(
            len(src.info), pool_key[0], pool_key[1], tier_of(pool_key[1])
        )
        if len(src.pools) == 2:
            # From now on nodes remember which pools hold them (the first pool: index 0).
            (first,) = (p for k, p in src.pools.items() if k != pool_key)
            src.where = {node: 1 for node in first.values() if node is not _LOOSE}
            self._several |= src.flag
        return pool, info

    def _store(self, src: _Source, event: BlockStored) -> None:
        pool_key = pool_of(event.group_idx, event.medium)
        found = self._pool(src, pool_key)
        if found is None:
            return  # a pool past MAX_POOLS: its blocks are not held
        pool, info = found
        hashes = event.block_hashes
        tokens, width, size = event_tokens(event)
        if size > info.size:
            info.size = size
        if event.kv_cache_spec_kind is not None and 0 <= info.group < MAX_GROUPS:
            src.groups[info.group] = GroupSpec(
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window
            )
        keys = PLAIN if is_plain(event) else chain_keys(event)
        src.stats.unrecognised_keys += keys.unrecognised
        if not hashes:
            return
        # An unkeyed store on a lower tier may lack the namespace its GPU copy had (vLLM's
        # offload events carry no extra keys): it keeps the placement it already has.
        keyed = info.tier == TIER_GPU or is_keyed(event, keys)
        tree = self._unit_tree(src, info, size, keys) if src.where is not None else 0
        if size == 0 or len(tokens) != width * len(hashes):
            if tree:  # a group of smaller blocks than another's that skipped some
                self._store_units(src, event, keys, pool, info, pool_key, tree)
                return
            # Skipped blocks (a sliding-window group) or no tokens: the event can't say
            # where each hash goes.
            self._store_elsewhere_placed(src, pool, info, pool_key, hashes, size)
            return
        if (
            info.size > size
            and not info.size & BIGRAM
            and info.size % size == 0
            and len(hashes) == 1
            and size == width
        ):
            # A partial block (`BlockPool.cache_partial_block`): one hash unit of a larger
            # block, placed inside its group's block.
            self._store_partial(src, event, keys, pool, info, pool_key, hashes[0], size)
            return
        if tree:
            self._store_units(src, event, keys, pool, info, pool_key, tree)
            return
        parent = self._anchor(src, event, keys, pool, info, size)
        if parent is None:
            self._store_elsewhere_placed(src, pool, info, pool_key, hashes, size)
            return
        chain = chain_keys_bytes(tokens, width, len(hashes), keys.own)
        self._insert_chain(src, pool, info, pool_key, parent, hashes, chain, keyed, size)
        if len(chain) < len(hashes):  # a token id that can't be keyed ends the chain
            self._store_elsewhere_placed(src, pool, info, pool_key, hashes[len(chain) :], size)

    def _store_partial(
        self,
        src: _Source,
        event: BlockStored,
        keys: ChainKeys,
        pool: Pool,
        info: _PoolInfo,
        pool_key: PoolKey,
        h: BlockHash,
        unit: int,
    ) -> None:
        """A partial-block entry: vLLM's hash at a hash-block boundary inside a block of
        its group (`BlockPool.cache_partial_block`: the tokens of the last hash unit, the
        parent the hash before). It hangs in the tree of its group's block size, under
        the block before it (or the root) for the block's first unit, else under the
        partial entry of the unit before; a partial node's key is `PARTIAL_MARK` and its
        unit's tokens, so a lookup by whole blocks never enters it. Where the parent is
        no node the publisher holds (a hash no event announced), the entry is held
        without a place (never guessed)."""
        size = info.size
        src.unit = unit if not src.unit else min(src.unit, unit)
        parent_hash = event.parent_block_hash
        parent: _Node | None
        if parent_hash is None:
            parent = self._root_of((lora_key(event), keys.salt, size))
        else:
            parent = pool.get(parent_hash)
            if parent is None or parent is _LOOSE or self._size_of(parent) != size:
                parent = self._placed_elsewhere(src, parent_hash, size, pool)
        units = 1
        if parent is not None:
            units += _partial_units(parent)
        chain = chain_keys_bytes(event.token_ids, unit, 1, keys.own)
        if parent is None or units * unit >= size or not chain:
            node = self._placed_elsewhere(src, h, size, pool) if src.where is not None else None
            if node is None:
                node = _LOOSE
                if h not in pool:
                    src.stats.unplaced += 1
            self._put(src, pool, info, pool_key, h, node)
            return
        node = _child(parent, PARTIAL_MARK + chain[0], h)
        self._put(src, pool, info, pool_key, h, node)

    def _unit_tree(self, src: _Source, info: _PoolInfo, size: int, keys: ChainKeys) -> int:
        """The tree a GPU group's blocks hang in when another GPU group of the publisher
        has larger blocks, a multiple of these (vLLM: groups of different block sizes hash
        every `hash_block_size` tokens, a block's hash is the one at its last unit): that
        group's size (the largest), else 0. Plain and namespaced chains only (own keys
        are per block of the event's size: not the larger block's)."""
        if info.tier != TIER_GPU or info.size != size or keys.own is not None or not size:
            return 0
        tree = 0
        for other in src.info.values():
            t = other.size
            if other.tier == TIER_GPU and t > size and t % size == 0 and not t & BIGRAM:
                tree = max(tree, t)
        return tree

    def _store_units(
        self,
        src: _Source,
        event: BlockStored,
        keys: ChainKeys,
        pool: Pool,
        info: _PoolInfo,
        pool_key: PoolKey,
        tree: int,
    ) -> None:
        """A chain of blocks of `unit` tokens (its event's block size) in the tree of the
        publisher's larger blocks (`tree` tokens): unit by unit from its parent, a unit
        inside a larger block is a partial node (as `_store_partial`'s), a unit that ends
        one is that block's node (keyed by the whole block's tokens, so the larger group's
        own block is the same node). Where the event skipped blocks (a sliding window's
        `block_mask`), each hash's unit is the one the publisher holds it at elsewhere, or
        the only one its neighbours leave it (`_unit_positions`); a hash whose unit can't
        be known, or whose larger block began before the event (its tokens unknown) and
        is held nowhere, is held without a place."""
        hashes = event.block_hashes
        tokens = event.token_ids
        unit = info.size
        info.tree = tree
        src.unit = unit if not src.unit else min(src.unit, unit)
        k = tree // unit
        units = len(tokens) // unit
        try:
            data = array("I", tokens).tobytes() if len(tokens) % unit == 0 else None
        except (OverflowError, TypeError):
            data = None
        start = None if data is None else self._units_start(src, event, keys, pool, tree)
        if start is None or data is None:
            self._store_elsewhere_placed(src, pool, info, pool_key, hashes, tree)
            return
        into = _partial_units(start)  # units of its block before the event's first
        anchor = start  # the node the current larger block hangs from
        for _ in range(into):
            assert anchor.parent is not None
            anchor = anchor.parent
        if units == len(hashes):
            positions: list[int | None] = list(range(units))
        else:
            positions = self._unit_positions(src, hashes, start, anchor, into, k, units, tree)
        node: _Node | None = start
        begun = -into  # the event's unit the current larger block begins at
        done = 0  # the event's units walked
        width = unit * 4
        for h, at in zip(hashes, positions, strict=True):
            if at is None or node is None:
                self._store_elsewhere_placed(src, pool, info, pool_key, [h], tree)
                continue
            while done <= at and node is not None:
                into += 1
                if into < k:
                    key = PARTIAL_MARK + data[done * width : (done + 1) * width]
                    node = _child(node, key, h)
                else:
                    last = node
                    if begun >= 0:
                        node = _child(anchor, data[begun * width : (done + 1) * width], h)
                    else:  # the block began before the event: only a held node will do
                        found = self._placed_elsewhere(src, h, tree, None) if done == at else None
                        node = found if found is not None and found.parent is anchor else None
                    if not last.mask and not last.children:
                        self._prune(last)  # skipped units inside the block, held by none
                    anchor = node if node is not None else anchor
                    into = 0
                    begun = done + 1
                done += 1
            if node is None:
                self._store_elsewhere_placed(src, pool, info, pool_key, [h], tree)
                continue
            self._put(src, pool, info, pool_key, h, node)

    def _units_start(
        self, src: _Source, event: BlockStored, keys: ChainKeys, pool: Pool, tree: int
    ) -> _Node | None:
        """The node a chain of units hangs from in the `tree`-token tree: the root, or its
        parent's node (where the publisher holds the parent at that tree size); None when
        the parent has no place there."""
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            return self._root_of((lora_key(event), keys.salt, tree))
        start = pool.get(parent_hash)
        if start is None or start is _LOOSE or self._size_of(start) != tree:
            start = self._placed_elsewhere(src, parent_hash, tree, None)
        return start

    def _unit_positions(
        self,
        src: _Source,
        hashes: list[BlockHash],
        start: _Node,
        anchor: _Node,
        into: int,
        k: int,
        units: int,
        tree: int,
    ) -> list[int | None]:
        """The event's unit each hash is at, in an event that skipped units: a hash the
        publisher holds at a node below `start` is at that node's unit; the others, in
        order, between their neighbours, where only one unit is left (else None)."""
        known: list[int | None] = []
        for h in hashes:
            node = self._placed_elsewhere(src, h, tree, None)
            at = None
            if node is not None:
                d = 0
                cur: _Node | None = node
                last_partial = False
                while (
                    cur is not None and cur is not start and cur is not anchor and d <= units + into
                ):
                    last_partial = _is_partial(cur.key)
                    d += 1 if last_partial else k
                    cur = cur.parent
                if cur is start and start is not anchor:
                    at = d - 1
                elif cur is anchor and not (start is not anchor and last_partial):
                    at = d - into - 1
                if at is not None and not 0 <= at < units:
                    at = None
            known.append(at)
        n = len(hashes)
        low: list[int] = []
        prev = -1
        for at in known:
            prev = at if at is not None else prev + 1
            low.append(prev)
        high = [0] * n
        nxt = units
        for i in range(n - 1, -1, -1):
            at = known[i]
            nxt = at if at is not None else nxt - 1
            high[i] = nxt
        if any(lo > hi for lo, hi in zip(low, high, strict=True)) or any(
            a >= b for a, b in pairwise(low)
        ):
            return [None] * n  # what the publisher holds contradicts the event: no guess
        return [lo if lo == hi else None for lo, hi in zip(low, high, strict=True)]

    def _store_elsewhere_placed(
        self,
        src: _Source,
        pool: Pool,
        info: _PoolInfo,
        pool_key: PoolKey,
        hashes: list[BlockHash],
        size: int,
    ) -> None:
        """Blocks whose position the event can't give: each takes the node the publisher
        holds the same hash at in another pool of this block size, else no place."""
        several = src.where is not None
        for h in hashes:
            node = self._placed_elsewhere(src, h, size, pool) if several else None
            if node is None:
                node = _LOOSE
                if h not in pool:
                    src.stats.unplaced += 1
            self._put(src, pool, info, pool_key, h, node)

    def _insert_chain(
        self,
        src: _Source,
        pool: Pool,
        info: _PoolInfo,
        pool_key: PoolKey,
        node: _Node,
        hashes: list[BlockHash],
        chain: list[bytes],
        keyed: bool,
        size: int,
    ) -> None:
        if src.where is not None:
            self._insert_chain_in_several(src, pool, info, pool_key, node, hashes, chain, keyed)
            return
        # One pool (nearly every publisher): `_child` and `_put` inline, for speed.
        flag = src.flag
        for h, key in zip(hashes, chain, strict=False):  # the chain may end early
            children = node.children
            if children is None:
                child = node.children = _Node(node, key, 0, None, h)
                node = child
            elif isinstance(children, _Node):
                if children.key == key:
                    node = children
                else:
                    child = _Node(node, key, 0, None, h)
                    node.children = {children.key: children, key: child}
                    node = child
            else:
                found = children.get(key)
                if found is None:
                    found = children[key] = _Node(node, key, 0, None, h)
                node = found
            if h in pool:
                self._put(src, pool, info, pool_key, h, node)
                continue
            shared = node.hash
            pool[shared if shared == h else h] = node
            if node.mask & flag:
                refs_key = (node, 0)
                src.refs[refs_key] = src.refs.get(refs_key, 0) + 1  # another hash, same node
            else:
                node.mask |= flag

    def _insert_chain_in_several(
        self,
        src: _Source,
        pool: Pool,
        info: _PoolInfo,
        pool_key: PoolKey,
        node: _Node,
        hashes: list[BlockHash],
        chain: list[bytes],
        keyed: bool,
    ) -> None:
        """A chain of a publisher with several pools: an unkeyed lower-tier block keeps
        the node the publisher holds its hash at; a keyed one takes the others over."""
        size = self._size_of(node)
        for h, key in zip(hashes, chain, strict=False):  # the chain may end early
            if not keyed:
                kept = self._placed_elsewhere(src, h, size, pool)
                if kept is not None:
                    src.stats.namespace_kept += 1
                    self._put(src, pool, info, pool_key, h, kept)
                    node = kept
                    continue
            node = _child(node, key, h)
            self._put(src, pool, info, pool_key, h, node)
            if keyed:
                self._take_over(src, pool, h, node)

    def _put(
        self, src: _Source, pool: Pool, info: _PoolInfo, pool_key: PoolKey, h: BlockHash,
        node: _Node,
    ) -> None:  # fmt: skip
        old = pool.get(h)
        if old is None:
            shared = node.hash
            pool[shared if shared == h else h] = node
            self._hold(src, info.index, node)
            return
        # One more physical copy of a held hash.
        extra_key = (pool_key, h)
        src.extra[extra_key] = src.extra.get(extra_key, 0) + 1
        if old is not node and node is not _LOOSE:
            # Now placed (it had no place), or the same hash announced for other tokens
            # (never from a sane publisher): the hash means this node from now on.
            pool[h] = node
            self._hold(src, info.index, node)
            self._release(src, info.index, old)

    def _take_over(self, src: _Source, placed_in: Pool, h: BlockHash, node: _Node) -> None:
        """A GPU or keyed copy of `h` was placed at `node`: the publisher's other pools of
        the same block size that hold `h` without a place, or on a lower tier at another
        node, take this place (the keyed copy decides the namespace)."""
        size = self._size_of(node)
        for pool_key, pool in src.pools.items():
            if pool is placed_in:
                continue
            old = pool.get(h)
            if old is None or old is node:
                continue
            info = src.info[pool_key]
            if info.size and info.size != size:
                continue
            if old is not _LOOSE and info.tier == TIER_GPU:
                continue  # a GPU group's own placement stands
            if not info.size:
                info.size = size  # a pool of hash-only events learns its block size here
            pool[h] = node
            self._hold(src, info.index, node)
            self._release(src, info.index, old)
            src.stats.namespace_moved += old is not _LOOSE

    def _hold(self, src: _Source, index: int, node: _Node) -> None:
        """One more (pool, hash) entry of `src` points at `node`."""
        if node is _LOOSE:
            return
        where = src.where
        if where is None:
            if node.mask & src.flag:
                key = (node, 0)
                src.refs[key] = src.refs.get(key, 0) + 1
            else:
                node.mask |= src.flag
            return
        bits = where.get(node, 0)
        bit = 1 << index
        if bits & bit:
            key = (node, index)
            src.refs[key] = src.refs.get(key, 0) + 1
        else:
            where[node] = bits | bit
            node.mask |= src.flag

    def _release(self, src: _Source, index: int, node: _Node) -> None:
        """One (pool, hash) entry of `src` no longer points at `node`."""
        if node is _LOOSE:
            return
        refs = src.refs
        if refs and (node, index) in refs:
            _drop_copy(refs, (node, index))
            return
        where = src.where
        if where is not None:
            bits = where.get(node, 0) & ~(1 << index)
            if bits:
                where[node] = bits
                return
            where.pop(node, None)
        mask = node.mask = node.mask & ~src.flag
        if not mask and not node.children:
            self._prune(node)

    def _anchor(
        self,
        src: _Source,
        event: BlockStored,
        keys: ChainKeys,
        pool: Pool,
        info: _PoolInfo,
        size: int,
    ) -> _Node | None:
        """The node the event's first block hangs from (in a tree of `size`, a tree size),
        or None if it can't be placed."""
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            return self._root_of((lora_key(event), keys.salt, size))
        node = pool.get(parent_hash)
        # A partial-block event (smaller than its group's blocks) hangs only from a parent
        # in a tree of its own block size.
        if (
            node is not None
            and node is not _LOOSE
            and (info.size == size or self._size_of(node) == size)
        ):
            return node
        if src.where is None:
            return None  # the parent is unknown to us: the chain can't be placed
        return self._placed_elsewhere(src, parent_hash, size, pool)

    def _root_of(self, namespace: Namespace) -> _Node | None:
        """The root of a namespace, made if new (None past MAX_ROOT_SIZES block sizes)."""
        root = self._roots.get(namespace)
        if root is None:
            if namespace[2] not in self._sizes and len(self._sizes) >= MAX_ROOT_SIZES:
                return None  # a block size past MAX_ROOT_SIZES: held without a place
            root = self._roots[namespace] = _Node(None, b"")
            self._root_ns[id(root)] = namespace
            self._sizes[namespace[2]] = self._sizes.get(namespace[2], 0) + 1
        return root

    def _placed_elsewhere(
        self, src: _Source, h: BlockHash, size: int, skip: Pool | None = None
    ) -> _Node | None:
        """The node the publisher holds `h` at in a pool of `size`-token blocks."""
        for pool_key, pool in src.pools.items():
            if pool is skip:
                continue
            node = pool.get(h)
            if node is None or node is _LOOSE:
                continue
            pool_size = src.info[pool_key].size
            if pool_size == size or self._size_of(node) == size:
                return node
        return None

    def _size_of(self, node: _Node) -> int:
        """The block size of the tree a node is in (walks up to its root: rare paths)."""
        while node.parent is not None:
            node = node.parent
        namespace = self._root_ns.get(id(node))
        return 0 if namespace is None else namespace[2]

    def _prune(self, node: _Node) -> None:
        """Free a node nobody holds and nothing hangs from, then its parents likewise, so
        memory follows what is cached; a root left with nothing goes with its namespace (a
        fleet of many salted tenants would otherwise keep a root per salt)."""
        root = _prune(node)
        if root is not None and not root.children:
            namespace = self._root_ns.pop(id(root), None)
            if namespace is not None:
                del self._roots[namespace]
                left = self._sizes[namespace[2]] - 1
                if left:
                    self._sizes[namespace[2]] = left
                else:
                    del self._sizes[namespace[2]]

    def _remove(self, src: _Source, pool_key: PoolKey, hashes: list[BlockHash]) -> None:
        pool = src.pools.get(pool_key)
        if pool is None:
            return
        index = src.info[pool_key].index
        extra = src.extra
        for h in hashes:
            node = pool.pop(h, None)
            if node is None:
                continue  # not known to be held (e.g. stored before a loss): nothing to drop
            if extra and (pool_key, h) in extra:
                _drop_copy(extra, (pool_key, h))
                pool[h] = node
                continue
            self._release(src, index, node)

    def _clear(self, src: _Source) -> None:
        keep = ~src.flag
        nodes = {id(n): n for pool in src.pools.values() for n in pool.values()}
        nodes.pop(id(_LOOSE), None)
        for node in nodes.values():
            node.mask &= keep
        for node in nodes.values():
            if not node.mask and not node.children:
                self._prune(node)
        src.pools.clear()
        src.info.clear()
        src.extra.clear()
        src.refs.clear()
        src.groups.clear()
        src.unit = 0
        src.where = None
        self._several &= keep

    # -- questions ---------------------------------------------------------------------

    def _pool_keys(self, pub: _Source) -> list[PoolKey]:
        return list(pub.pools)

    def _pool_hashes(self, pub: _Source, index: int) -> Iterable[BlockHash]:
        return list(pub.pools.values())[index]

    def _stats(self, pub: _Source) -> CacheStats:
        return pub.stats

    def copies(self, source: SourceKey) -> PoolCopies:
        """The pools of one publisher: (group, medium) -> hash -> copies (a snapshot)."""
        src = self._sources.get(source)
        if src is None:
            return {}
        extra = src.extra
        return {
            pk: {h: 1 + extra.get((pk, h), 0) for h in pool} if extra else dict.fromkeys(pool, 1)
            for pk, pool in src.pools.items()
        }

    def count(self, source: SourceKey, group: int, medium: str, block_hash: BlockHash) -> int:
        """Copies of one hash in one pool of one publisher (0 if not held)."""
        src = self._sources.get(source)
        pool = None if src is None else src.pools.get((group, medium))
        if pool is None or block_hash not in pool:
            return 0
        assert src is not None
        return 1 + src.extra.get(((group, medium), block_hash), 0)

    def entries(self) -> int:
        """(publisher, pool, hash) entries held: the index's size."""
        return sum(len(p) for src in self._sources.values() for p in src.pools.values())

    def tree_nodes(self) -> int:
        count = 0
        stack = list(self._roots.values())
        while stack:
            kids = _kids(stack.pop())
            count += len(kids)
            stack.extend(kids)
        return count

    # Read-only views of the prefix tree, for analyses such as `kvindex.index.sharing`.

    def walk_tree(self) -> Iterator[tuple[Namespace, int, bytes, int]]:
        """Every node of the prefix tree, depth first with parents before children: its
        namespace (LoRA adapter, cache salt, block size), depth (1 = a prompt's first
        block), the block's tree key (`key_tokens(key, size)` gives its token ids) and the
        bit mask of the publishers holding it (bits as in `source_bits`). Don't change the
        index while walking."""
        for namespace, root in self._roots.items():
            stack = [(child, 1) for child in _kids(root)]
            while stack:
                node, depth = stack.pop()
                if _is_partial(node.key):
                    continue  # a partial-block entry: not a block of this tree's size
                yield namespace, depth, node.key, node.mask
                stack.extend((child, depth + 1) for child in _kids(node))

    def lookup(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        *,
        mm_features: Sequence[MMFeature | Mapping[str, Any]] | None = None,
        extra_keys: Sequence[Sequence[MMKey] | None] | None = None,
    ) -> list[LookupRow]:
        """Per instance, what the engine would reuse of this prompt (see `LookupRow`): the
        chains of the namespace the request names (its LoRA adapter and cache salt). An
        image prompt's blocks are keyed by its multimodal inputs when the lookup gives them
        (`mm_features` or per-block `extra_keys`: see kvindex.index.multimodal); without
        them, its blocks from the first image on match nothing."""
        own = (
            None
            if mm_features is None and extra_keys is None
            else PromptKeys.of(mm_features, extra_keys)
        )
        walks: dict[int, _Walk] = {}
        # Ascending: ties between sizes go to the smaller (bigram trees come last).
        for size in sorted(self._sizes):
            root = self._roots.get((lora_name, cache_salt, size))
            if root is None or not root.children:
                continue
            keys = prompt_keys(token_ids, size)
            if own is not None:
                keys = own.apply(keys, token_ids, size)
            walks[size] = self._walk(root, keys)
        # What an instance matching nothing reports as its block size: the smallest.
        return self._answer_walks(walks, (token_ids, lora_name, cache_salt))

    def lookup_local_hashes(
        self,
        hashes: Sequence[int],
        lora_name: str | None = None,
        block_size: int | None = None,
    ) -> list[LookupRow]:
        """Per instance, what the engine would reuse of the prompt these Dynamo local
        block hashes stand for (kvindex.index.localhash; u64, or i64 as on the wire): in
        each namespace of a LoRA name (or none) and a block size, the stored blocks are
        hashed under the namespace's seed as the walk goes, so the hashes find the
        namespace they were made for. Per block size the namespace whose blocks continue
        the hashes furthest is asked (ties: by LoRA name, then salt), then the rows are a
        token lookup's of the blocks found. `lora_name` / `block_size`: only those."""
        want = [as_unsigned(h) for h in hashes]
        chosen: dict[int, tuple[Namespace | None, list[bytes]]] = {}
        for namespace in sorted(self._roots, key=_namespace_order):
            lora, salt, size = namespace
            if (
                size & BIGRAM
                or isinstance(lora, int)
                or (lora_name is not None and lora != lora_name)
            ):
                continue
            if block_size is not None and size != block_size:
                continue
            keys = _local_path(self._roots[namespace], want, namespace_seed(lora, salt), size)
            best = chosen.setdefault(size, (None, []))
            if keys and len(keys) > len(best[1]):
                chosen[size] = (namespace, keys)
        # Every size asked has a walk (an empty one where nothing matched), so the rows
        # of instances matching nothing say the block size as a token lookup's do.
        walks = {
            size: _Walk({}, []) if ns is None else self._walk(self._roots[ns], keys)
            for size, (ns, keys) in sorted(chosen.items())
        }
        # Local hashes name whole blocks: no prompt, so no hits inside a block.
        return self._answer_walks(walks, None)

    def _answer_walks(self, walks: dict[int, _Walk], prompt: _Prompt | None) -> list[LookupRow]:
        """The rows of a lookup's walks (tree size -> walk, ascending): see `lookup`.
        `prompt` (token ids, LoRA, salt) lets publishers with partial-block entries hit
        inside a block; without it they are answered in whole blocks."""
        default_size = block_size_of(next(iter(walks), 0))
        found: dict[int, Reuse] = {}
        for size, walk in walks.items():
            blocks_of = block_size_of(size)
            for bit, depth in walk.depths.items():
                if bit not in found or depth * blocks_of > found[bit].tokens:
                    found[bit] = Reuse.simple(depth, blocks_of)
        several = self._several & self._all_mask
        if several and walks:
            for bit in _bits(several):
                found[bit] = self._reuse(self._by_bit[bit], walks, prompt)
        return self._rows(found, default_size)

    def _reuse(
        self,
        src: _Source,
        walks: dict[int, _Walk],
        prompt: _Prompt | None,
    ) -> Reuse:
        """What a publisher with several pools would reuse: per pool, which path nodes it
        holds (its `where`), given to the engine's own rules."""
        where = src.where or {}
        held: dict[PoolKey, list[bool]] = {}
        for pool_key, info in src.info.items():
            if not info.size:
                continue
            # No walk of its size (no tree of it here): it holds none of the prompt, and
            # its group limits the hit (whether that tree exists is other publishers' doing).
            walk = walks.get(info.size)
            path = walk.path if walk is not None else []
            bit = 1 << info.index
            held[pool_key] = [bool(where.get(node, 0) & bit) for node in path]
        sizes = {pk: block_size_of(info.size) for pk, info in src.info.items()}
        if src.unit and prompt is not None:
            token_ids, lora_name, cache_salt = prompt
            return self._unit_reuse(src, walks, token_ids, (lora_name, cache_salt), held, sizes)
        return engine_reuse(held, sizes, src.groups)

    def _unit_reuse(
        self,
        src: _Source,
        walks: dict[int, _Walk],
        token_ids: Sequence[int],
        names: tuple[LoraKey, str | None],
        held: dict[PoolKey, list[bool]],
        sizes: dict[PoolKey, int],
    ) -> Reuse:
        """`_reuse` at the hash block size (`reuse.unit_reuse`): per GPU pool, which of
        the prompt's hash boundaries it holds, a whole block's node or a partial node
        inside the next block (`_store_partial`, `_store_units`)."""
        unit = src.unit
        where = src.where or {}
        count = len(token_ids) // unit
        at: dict[int, dict[int, _Node]] = {}  # tree size -> hash index -> node
        for info in src.info.values():
            size = info.tree or info.size
            if not size or size in at or info.tier != TIER_GPU or size % unit:
                continue
            nodes = at[size] = {}
            walk = walks.get(size)
            path = walk.path if walk is not None else []
            k = size // unit
            for j, whole in enumerate(path):
                nodes[(j + 1) * k - 1] = whole
            root = self._roots.get((names[0], names[1], size))
            for j in range(len(path) + 1 if root is not None else 0):
                node = path[j - 1] if j else root
                for m in range(1, k):
                    end = j * size + m * unit
                    if end > len(token_ids):
                        break
                    keys = block_keys(token_ids[end - unit : end], unit, 1)
                    found = _child_at(node, PARTIAL_MARK + keys[0]) if keys and node else None
                    if found is None:
                        break
                    node = nodes[j * k + m - 1] = found
        fine: dict[PoolKey, list[bool]] = {}
        lower: dict[PoolKey, list[bool]] = {}
        for pool_key, info in src.info.items():
            if info.tier != TIER_GPU:
                if pool_key in held:
                    lower[pool_key] = held[pool_key]
                continue
            if not info.size:
                continue
            nodes = at.get(info.tree or info.size, {})
            bit = 1 << info.index
            fine[pool_key] = [
                f in nodes and bool(where.get(nodes[f], 0) & bit) for f in range(count)
            ]
        return unit_reuse(fine, sizes, src.groups, unit, lower)

    def _walk(self, root: _Node, keys: list[bytes]) -> _Walk:
        """Per publisher bit, how many of these blocks from the root it holds in a row;
        and, if a publisher has several pools, every node of the prompt's path (a group
        may hold blocks past one nobody holds: a sliding window's, before its boundary)."""
        alive = self._all_mask
        follow = self._several & alive
        depths: dict[int, int] = {}
        path: list[_Node] = []
        depth = 0
        children = root.children
        for key in keys:
            if children is None:
                break
            if isinstance(children, _Node):
                child = children
                if child.key != key:
                    break
            else:
                found = children.get(key)
                if found is None:
                    break
                child = found
            mask = child.mask
            dropped = alive & ~mask
            if dropped:
                if depth:  # publishers matching nothing are left out: most of a big fleet
                    _record(depths, dropped, depth)
                alive &= mask
                if not alive and not follow:
                    break
            if follow:
                path.append(child)
            depth += 1
            children = child.children
        if alive and depth:
            _record(depths, alive, depth)
        return _Walk(depths, path)

    def lookup_hashes(self, block_hashes: Sequence[BlockHash]) -> list[LookupRow]:
        """Per instance, how many of these hashes, from the first, it would reuse now: the
        run its GPU pools hold, then the run its lower tiers hold from there (the fastest
        tier holding each next block serves it)."""
        found: dict[int, Reuse] = {}
        for src in self._sources.values():
            gpu = [p for pk, p in src.pools.items() if src.info[pk].tier == TIER_GPU]
            lower = sorted(
                (
                    (src.info[pk].tier, p)
                    for pk, p in src.pools.items()
                    if src.info[pk].tier != TIER_GPU
                ),
                key=lambda tier_pool: TIERS.index(tier_pool[0]),
            )
            depth = 0
            for h in block_hashes:
                if not any(h in pool for pool in gpu):
                    break
                depth += 1
            by_tier = {TIER_GPU: depth} if depth else {}
            for h in block_hashes[depth:]:
                tier = next((t for t, pool in lower if h in pool), None)
                if tier is None:
                    break
                by_tier[tier] = by_tier.get(tier, 0) + 1
            total = sum(by_tier.values())
            if total:
                found[src.bit] = Reuse(total, 0, by_tier, {})
        return self._rows(found, 0)


@dataclass(slots=True)
class _Walk:
    depths: dict[int, int]  # publisher bit -> blocks held in a row from the root
    path: list[_Node]  # the prompt's nodes, while a publisher with several pools is on it


# A lookup's prompt as the reuse rules need it: token ids, LoRA name, cache salt.
_Prompt = tuple[Sequence[int], LoraKey, str | None]


MAX_BLOCK_SIZE = 1 << 31  # a size from 2**31 on can't be a block's: such events have no place
# Limits a real engine never nears (a few KV cache groups and media, one or two block
# sizes), which the compiled core's layout needs (which pools hold a node: 32 bits; a
# lookup walks one tree per size), kept here too so both implementations hold the same:
MAX_POOLS = 32  # (group, medium) pools of one publisher: a store to another is not held
MAX_ROOT_SIZES = 16  # block sizes with a root at once: a chain of another has no place
MAX_GROUPS = 64  # groups (0..63) whose spec (attention kind, window) is kept; others are
# taken as full attention


def is_keyed(event: BlockStored, keys: ChainKeys) -> bool:
    """Whether a store names its namespace or has own keys (else an unkeyed store on a
    lower tier keeps the placement its hash already has: see the module doc)."""
    return lora_key(event) is not None or keys.salt is not None or keys.own is not None


def event_tokens(event: BlockStored) -> tuple[Sequence[int], int, int]:
    """A store's token ids as its tree keys are made of, the ids per block (the key
    width) and the tree size (0: a block size no block can have). An EAGLE bigram page's
    pairs are flattened, in a tree of its own (see keys.tree_size)."""
    size = event.block_size if 0 < event.block_size < MAX_BLOCK_SIZE else 0
    if isinstance(event, BigramBlockStored):
        return flat_pairs(event.token_pairs), 2 * size, tree_size(size, size > 0)
    return event.token_ids, size, size


def is_plain(event: BlockStored) -> bool:
    """No keys beside the tokens. vLLM 0.33 sends `[None, ...]` for a plain request."""
    extra = event.extra_keys
    return (
        (extra is None or not any(extra))
        and event.cache_salt is None
        and event.lookahead_token_ids is None
    )


PARTIAL_MARK = b"\xffP"
"""Starts the key of a partial-block entry (its unit's token key after it): 2 bytes more
than a multiple of 4 (or 3, with int64 tokens), a length no whole block's key has (those
are 4s, 1 + 8s, each + OWN_KEY_BYTES), so a lookup by whole blocks never enters one."""


def _is_partial(key: bytes) -> bool:
    return key[:2] == PARTIAL_MARK and len(key) % 4 in (2, 3)


def _partial_units(node: _Node) -> int:
    """How many partial units a node ends: 0 for a whole block or a root."""
    units = 0
    while node.parent is not None and _is_partial(node.key):
        units += 1
        node = node.parent
    return units


def _child_at(node: _Node, key: bytes) -> _Node | None:
    children = node.children
    if children is None:
        return None
    if isinstance(children, _Node):
        return children if children.key == key else None
    return children.get(key)


def _child(node: _Node, key: bytes, h: BlockHash) -> _Node:
    """The child of `node` with this key, made if there is none."""
    children = node.children
    if children is None:
        child = node.children = _Node(node, key, 0, None, h)
    elif isinstance(children, _Node):
        if children.key == key:
            return children
        child = _Node(node, key, 0, None, h)
        node.children = {children.key: children, key: child}
    else:
        found = children.get(key)
        if found is not None:
            return found
        child = children[key] = _Node(node, key, 0, None, h)
    return child


def _namespace_order(namespace: Namespace) -> tuple[int, str, str]:
    lora, salt, size = namespace
    return size, str(lora or ""), salt or ""


def _local_path(root: _Node, hashes: list[int], seed: int, size: int) -> list[bytes]:
    """The tree keys of the blocks under `root` whose tokens continue these local hashes
    from the first (a block with own keys or a token past 32 bits never does: Dynamo hashes
    token ids as u32 alone). Among siblings of equal hash, the first by key."""
    width = 4 * size
    keys: list[bytes] = []
    node = root
    for h in hashes:
        found = [
            kid
            for kid in _kids(node)
            if len(kid.key) == width and block_local_hash(kid.key, seed) == h
        ]
        if not found:
            break
        node = min(found, key=lambda kid: kid.key) if len(found) > 1 else found[0]
        keys.append(node.key)
    return keys


def _record(depths: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        depths[low.bit_length() - 1] = depth
        mask ^= low


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _prune(node: _Node) -> _Node | None:
    """Free a node nobody holds and nothing hangs from, then its parents likewise; the
    node the climb ended at if it has no parent (a root, or one already unlinked)."""
    while True:
        parent = node.parent
        if parent is None:
            return node
        siblings = parent.children
        if siblings is node:
            parent.children = None
        elif isinstance(siblings, dict) and siblings.get(node.key) is node:
            del siblings[node.key]
            if len(siblings) == 1:
                parent.children = next(iter(siblings.values()))
        node.parent = None
        if parent.mask or parent.children:
            return None
        node = parent


def _kids(node: _Node) -> list[_Node]:
    children = node.children
    if children is None:
        return []
    if isinstance(children, _Node):
        return [children]
    return list(children.values())


_K = TypeVar("_K")


def _drop_copy(counts: dict[_K, int], key: _K) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
