"""The live state of a fleet: which blocks each publisher holds, and a token-prefix tree.

Two structures, both fed by `apply`:

- Per publisher (instance and DP rank) *pools*, one per (KV cache group, medium), mapping a
  block hash to its number of physical copies. vLLM announces one BlockStored per copy
  and one BlockRemoved per evicted copy, so a hash is held while its count is positive.
- One prefix tree for the whole fleet, built from the events' own `parent_block_hash` and
  `token_ids` (never by recomputing vLLM's hash, whose algorithm and seed vary by release
  and deployment). A node is one block of tokens under its parent, in a namespace (LoRA
  name, block size); its `mask` has bit *i* set while publisher *i* holds the node's block.
  A lookup walks the prompt's blocks from the root and ANDs masks: each publisher's match
  length is the depth where its bit first drops out.

Blocks whose chain can't be anchored (hash-only events, a parent we never saw) still count
in their pool; they just can't be found by tokens.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from kvindex.index.stats import CacheStats, RateWindow
from kvindex.subscriber.messages import Delivery, Item, Restarted, SourceKey
from kvindex.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch

__all__ = ["FleetIndex", "LookupRow", "block_keys", "key_tokens"]

DEFAULT_MEDIUM = "GPU"

PoolKey = tuple[int, str]  # (group_idx, medium)
Namespace = tuple[str | None, int]  # (lora_name, block_size)


class _Node(msgspec.Struct, gc=False):
    """One block of tokens under its parent.

    `children` is None for a leaf, the child itself when there is one (most nodes: a chain
    costs no dict per block), else a dict of two or more keyed by the children's keys.

    Not tracked by the cyclic garbage collector: millions of nodes would make every full
    collection walk the whole tree. The parent <-> children cycle is broken by hand when a
    node is pruned, and for the whole tree when the index goes away (`FleetIndex.__del__`).
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


def block_keys(tokens: Sequence[int], size: int, blocks: int) -> list[bytes]:
    """The tree keys of the first `blocks` blocks of `size` tokens (fewer if a block's
    tokens can't be keyed: a token id past 64 bits ends the list there).

    A block whose token ids all fit in 32 bits (every real vocabulary) is keyed by them as
    native uint32 bytes, so a whole prompt converts in one C call and keys stay small;
    any other block by a marker byte and int64s, a length no uint32 key can have.
    """
    try:
        data = array("I", tokens)
    except OverflowError:
        return _keys_slowly(tokens, size, blocks)
    return _split(memoryview(data).cast("B"), size * 4, blocks)


def _split(data: memoryview, width: int, blocks: int) -> list[bytes]:
    """The first `blocks` runs of `width` bytes of `data` (fewer if it is shorter)."""
    splitter = _SPLITTERS.get(width)
    if splitter is None:
        splitter = _SPLITTERS[width] = struct.Struct(f"{width}s")
    blocks = min(blocks, len(data) // width)
    # iter_unpack cuts in C: about twice as fast as slicing in a comprehension.
    return [key for (key,) in splitter.iter_unpack(data[: blocks * width])]


_SPLITTERS: dict[int, struct.Struct] = {}


def _keys_slowly(tokens: Sequence[int], size: int, blocks: int) -> list[bytes]:
    keys = []
    for i in range(blocks):
        block = tokens[i * size : (i + 1) * size]
        try:
            keys.append(array("I", block).tobytes())
        except OverflowError:
            try:
                keys.append(b"\x00" + array("q", block).tobytes())
            except OverflowError:
                break  # no lookup can ask for a token id past 64 bits
    return keys


def key_tokens(key: bytes) -> list[int]:
    """The token ids a tree key stands for (the inverse of `block_keys`)."""
    if len(key) % 4 == 1:
        return array("q", key[1:]).tolist()
    return array("I", key).tolist()


@dataclass(slots=True)
class _Source:
    key: SourceKey
    bit: int
    # (group, medium) -> hash -> the block's tree node (or _LOOSE): one entry per block held.
    pools: dict[PoolKey, Pool] = field(default_factory=dict)
    # Copies beyond the first, for the few blocks vLLM holds more than once.
    extra: dict[tuple[PoolKey, BlockHash], int] = field(default_factory=dict)
    stats: CacheStats = field(default_factory=CacheStats)
    last_seq: int | None = None
    last_ts: float | None = None
    # 1 << bit, made once: every node only this publisher holds shares this int object
    # as its mask (an int past 2**8 is otherwise a 32-byte object per node).
    flag: int = field(init=False)

    def __post_init__(self) -> None:
        self.flag = 1 << self.bit


class LookupRow(msgspec.Struct, frozen=True, gc=False):
    """The longest cached prefix of a prompt on one instance (its best DP rank)."""

    instance: str
    matched_blocks: int
    matched_tokens: int
    block_size: int
    best_rank: int
    ranks: dict[int, int]  # DP rank -> matched blocks


class FleetIndex:
    """Exact per-publisher block state and token-prefix lookups for a whole fleet."""

    def __init__(self, rate_window: float = 60.0) -> None:
        self._sources: dict[SourceKey, _Source] = {}
        self._by_bit: dict[int, _Source] = {}
        self._free_bits: list[int] = []
        self._roots: dict[Namespace, _Node] = {}
        self._all_mask = 0
        self._layout: list[tuple[str, list[tuple[int, int]]]] | None = None
        self._empty_rows: dict[int, list[LookupRow]] = {}
        self.rates = RateWindow(rate_window)

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
        fast: Pool | None = None
        fast_key: PoolKey = (0, DEFAULT_MEDIUM)
        medium: str | None = None
        group: int | None = None
        keep = ~(1 << src.bit)
        for event in batch.events:
            if isinstance(event, BlockRemoved):
                hashes = event.block_hashes
                removed += len(hashes)
                if fast is None or event.medium != medium or event.group_idx != group:
                    fast_key = (event.group_idx or 0, event.medium or DEFAULT_MEDIUM)
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
                        mask = node.mask = node.mask & keep
                        if not mask and not node.children:
                            _prune(node)
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

    def handle(self, item: Item) -> None:
        """Feed one item of a `Subscriber`: apply deliveries, drop state on restarts."""
        if isinstance(item, Delivery):
            self.apply(item.source, item.batch, item.seq)
        elif isinstance(item, Restarted):
            self.drop_source(item.source)

    def drop_source(self, source: SourceKey) -> None:
        """Forget what `source` holds (its engine restarted): its cache is empty now."""
        src = self._sources.get(source)
        if src is not None:
            self._clear(src)
            src.stats.restarts += 1

    def remove_instance(self, name: str) -> None:
        for key in [k for k in self._sources if k.instance == name]:
            src = self._sources.pop(key)
            self._clear(src)
            del self._by_bit[src.bit]
            self._all_mask &= ~(1 << src.bit)
            self._free_bits.append(src.bit)
        self._layout = None

    def _source(self, key: SourceKey) -> _Source:
        bit = self._free_bits.pop() if self._free_bits else len(self._by_bit)
        src = self._sources[key] = self._by_bit[bit] = _Source(key, bit)
        self._all_mask |= 1 << bit
        self._layout = None
        return src

    def _store(self, src: _Source, event: BlockStored) -> None:
        pool_key = (event.group_idx or 0, event.medium or DEFAULT_MEDIUM)
        pool = src.pools.get(pool_key)
        if pool is None:
            pool = src.pools[pool_key] = {}
        hashes = event.block_hashes
        parent = self._anchor(src, event, pool)
        if parent is None:
            self._store_loose(src, pool_key, pool, hashes)
            return
        tokens = event.token_ids
        if len(hashes) == 1 and len(tokens) == event.block_size:
            # One block (a decode step's new block, the commonest store): no splitting.
            try:
                keys = [array("I", tokens).tobytes()]
            except OverflowError:
                keys = _keys_slowly(tokens, event.block_size, 1)
        else:
            keys = block_keys(tokens, event.block_size, len(hashes))
        self._insert_chain(src, pool_key, pool, parent, hashes, keys)
        if len(keys) < len(hashes):
            self._store_loose(src, pool_key, pool, hashes[len(keys) :])

    def _store_loose(
        self, src: _Source, pool_key: PoolKey, pool: Pool, hashes: list[BlockHash]
    ) -> None:
        """Blocks held without a place in the tree (hash-only, unanchored, unkeyable)."""
        for h in hashes:
            if h in pool:
                self._again(src, pool_key, pool, h, pool[h], pool[h])
            else:
                pool[h] = _LOOSE

    def _insert_chain(
        self,
        src: _Source,
        pool_key: PoolKey,
        pool: Pool,
        node: _Node,
        hashes: list[BlockHash],
        keys: list[bytes],
    ) -> None:
        bit = src.flag
        for h, key in zip(hashes, keys, strict=False):  # keys may end early
            children = node.children
            if children is None:
                child = node.children = _Node(node, key, bit, None, h)
            elif isinstance(children, _Node):
                if children.key == key:
                    child = children
                    child.mask |= bit
                else:
                    child = _Node(node, key, bit, None, h)
                    node.children = {children.key: children, key: child}
            else:
                found = children.get(key)
                if found is None:
                    child = children[key] = _Node(node, key, bit, None, h)
                else:
                    child = found
                    child.mask |= bit
            old = pool.get(h)
            if old is None:
                shared = child.hash
                pool[shared if shared == h else h] = child
            else:
                self._again(src, pool_key, pool, h, old, child)
            node = child

    def _again(
        self, src: _Source, pool_key: PoolKey, pool: Pool, h: BlockHash, old: _Node, new: _Node
    ) -> None:
        """A hash stored while already held in the pool: one more physical copy."""
        extra_key = (pool_key, h)
        src.extra[extra_key] = src.extra.get(extra_key, 0) + 1
        if old is new or new is _LOOSE:
            return
        pool[h] = new
        if old is not _LOOSE and not _kept_elsewhere(src, pool, h, old):
            # The same hash announced for other tokens (never from a sane publisher): the
            # hash now means these tokens; the old node must not stay matched.
            old.mask &= ~(1 << src.bit)
            if not old.mask and not old.children:
                _prune(old)

    def _anchor(self, src: _Source, event: BlockStored, pool: Pool) -> _Node | None:
        """The node the event's first block hangs from, or None if it can't be placed."""
        size = event.block_size
        if size <= 0 or len(event.token_ids) < size * len(event.block_hashes):
            return None  # hash-only (offloading) or partial (a sliding-window group)
        extra = event.extra_keys
        if extra and any(extra) and not only_lora(extra, event.lora_name):
            return None  # keyed by multimodal inputs or a cache salt: not findable by tokens
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            namespace = (event.lora_name, size)
            root = self._roots.get(namespace)
            if root is None:
                root = self._roots[namespace] = _Node(None, b"")
            return root
        node = pool.get(parent_hash)
        if node is None or node is _LOOSE:
            node = _placed_elsewhere(src, parent_hash)
        return node  # None: the parent is unknown to us, the chain can't be placed

    def _remove(self, src: _Source, pool_key: PoolKey, hashes: list[BlockHash]) -> None:
        pool = src.pools.get(pool_key)
        if pool is None:
            return
        extra = src.extra
        several = len(src.pools) > 1
        keep = ~(1 << src.bit)
        for h in hashes:
            node = pool.pop(h, None)
            if node is None:
                continue  # not known to be held (e.g. stored before a loss): nothing to drop
            if extra and (pool_key, h) in extra:
                _drop_copy(extra, (pool_key, h))
                pool[h] = node
                continue
            if node is _LOOSE or (several and _kept_elsewhere(src, pool, h, node)):
                continue
            mask = node.mask & keep
            node.mask = mask
            if not mask and not node.children:
                _prune(node)

    def _clear(self, src: _Source) -> None:
        keep = ~(1 << src.bit)
        nodes = [n for pool in src.pools.values() for n in pool.values() if n is not _LOOSE]
        for node in nodes:
            node.mask &= keep
        for node in nodes:
            if not node.mask and not node.children:
                _prune(node)
        src.pools.clear()
        src.extra.clear()

    # -- questions ---------------------------------------------------------------------

    def instances(self) -> list[str]:
        return sorted({key.instance for key in self._sources})

    def sources(self, instance: str | None = None) -> list[SourceKey]:
        return [k for k in self._sources if instance is None or k.instance == instance]

    def has_instance(self, name: str) -> bool:
        return any(k.instance == name for k in self._sources)

    def block_hashes(self, instance: str, medium: str | None = None) -> set[BlockHash]:
        """Every distinct hash the instance holds now (all ranks, groups; one medium or all)."""
        out: set[BlockHash] = set()
        for src in self._instance_sources(instance):
            for (_, pool_medium), pool in src.pools.items():
                if medium is None or pool_medium == medium:
                    out.update(pool)
        return out

    def copies(self, source: SourceKey) -> dict[PoolKey, dict[BlockHash, int]]:
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

    def blocks_by_medium(self, instance: str) -> dict[str, int]:
        """Distinct hashes held per medium (union over ranks and groups)."""
        per_medium: dict[str, set[BlockHash]] = {}
        for src in self._instance_sources(instance):
            for (_, medium), pool in src.pools.items():
                per_medium.setdefault(medium, set()).update(pool)
        return {medium: len(hashes) for medium, hashes in sorted(per_medium.items())}

    def block_count(self, instance: str) -> int:
        return len(self.block_hashes(instance))

    def cache_stats(self, instance: str) -> CacheStats:
        total = CacheStats()
        for src in self._instance_sources(instance):
            total.merge(src.stats)
        total.active = self.block_count(instance)
        return total

    def source_state(self, source: SourceKey) -> tuple[int | None, float | None]:
        src = self._sources.get(source)
        return (None, None) if src is None else (src.last_seq, src.last_ts)

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
        namespace (LoRA name, block size), depth (1 = a prompt's first block), the block's
        tree key (`key_tokens` gives its token ids) and the bit mask of the publishers
        holding it (bits as in `source_bits`). Don't change the index while walking."""
        for namespace, root in self._roots.items():
            stack = [(child, 1) for child in _kids(root)]
            while stack:
                node, depth = stack.pop()
                yield namespace, depth, node.key, node.mask
                stack.extend((child, depth + 1) for child in _kids(node))

    def source_bits(self) -> dict[int, SourceKey]:
        """Bit number (as in the tree's masks) -> the publisher it stands for."""
        return {bit: src.key for bit, src in self._by_bit.items()}

    def _instance_sources(self, instance: str) -> Iterable[_Source]:
        return (s for k, s in self._sources.items() if k.instance == instance)

    def lookup(self, token_ids: Sequence[int], lora_name: str | None = None) -> list[LookupRow]:
        """Per instance, the longest run of cached blocks from the prompt's first token."""
        depth_by_bit: dict[int, int] = {}
        size_by_bit: dict[int, int] = {}
        keys_by_size: dict[int, list[bytes]] = {}
        default_size = 0  # what an instance matching nothing reports as its block size
        for (lora, size), root in self._roots.items():
            if lora != lora_name or not root.children:
                continue
            default_size = size
            keys = keys_by_size.get(size)
            if keys is None:
                keys = keys_by_size[size] = block_keys(token_ids, size, len(token_ids) // size)
            for bit, depth in self._walk(root, keys).items():
                if depth >= depth_by_bit.get(bit, -1):
                    depth_by_bit[bit] = depth
                    size_by_bit[bit] = size
        return self._rows(depth_by_bit, size_by_bit, default_size)

    def _walk(self, root: _Node, keys: list[bytes]) -> dict[int, int]:
        """Per publisher bit, how many of these blocks from the root it holds in a row."""
        alive = self._all_mask
        depths: dict[int, int] = {}
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
                if not alive:
                    break
            depth += 1
            children = child.children
        if alive and depth:
            _record(depths, alive, depth)
        return depths

    def lookup_hashes(self, block_hashes: Sequence[BlockHash]) -> list[LookupRow]:
        """Per instance, how many of these hashes, from the first, it holds now."""
        depth_by_bit: dict[int, int] = {}
        for src in self._sources.values():
            pools = list(src.pools.values())
            depth = 0
            for h in block_hashes:
                if not any(h in pool for pool in pools):
                    break
                depth += 1
            depth_by_bit[src.bit] = depth
        return self._rows(depth_by_bit, {})

    def _rows(
        self, depth_by_bit: dict[int, int], size_by_bit: dict[int, int], default_size: int = 0
    ) -> list[LookupRow]:
        """One row per instance, by name; a publisher missing from `depth_by_bit` matched
        nothing (its row is shared between answers: rows are immutable)."""
        layout = self._layout or self._lay_out()
        empty = self._empty_rows.get(default_size) or self._make_empty_rows(default_size)
        rows = []
        for (name, ranks), nothing in zip(layout, empty, strict=True):
            if len(ranks) == 1:
                rank, bit = ranks[0]
                depth = depth_by_bit.get(bit)
                if not depth:
                    rows.append(nothing)
                    continue
                size = size_by_bit.get(bit, default_size)
                rows.append(LookupRow(name, depth, depth * size, size, rank, {rank: depth}))
                continue
            per_rank = {rank: depth_by_bit.get(bit, 0) for rank, bit in ranks}
            best_rank, best_bit = max(ranks, key=lambda rb: (per_rank[rb[0]], -rb[0]))
            depth = per_rank[best_rank]
            size = size_by_bit.get(best_bit, default_size)
            rows.append(LookupRow(name, depth, depth * size, size, best_rank, per_rank))
        return rows

    def _lay_out(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """Instances by name, each with its (DP rank, bit) pairs by rank: what a lookup
        answer is shaped like, kept until the set of publishers changes."""
        by_name: dict[str, list[tuple[int, int]]] = {}
        for key, src in self._sources.items():
            by_name.setdefault(key.instance, []).append((key.rank, src.bit))
        self._layout = [(name, sorted(ranks)) for name, ranks in sorted(by_name.items())]
        self._empty_rows = {}
        return self._layout

    def _make_empty_rows(self, size: int) -> list[LookupRow]:
        layout = self._layout or self._lay_out()
        rows = [
            LookupRow(name, 0, 0, size, ranks[0][0], {rank: 0 for rank, _ in ranks})
            for name, ranks in layout
        ]
        self._empty_rows[size] = rows
        return rows


def _record(depths: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        depths[low.bit_length() - 1] = depth
        mask ^= low


def _prune(node: _Node) -> None:
    """Free a node nobody holds and nothing hangs from, then its parents likewise, so
    memory follows what is cached. Roots stay."""
    while True:
        parent = node.parent
        if parent is None:
            return  # a root, or already unlinked
        siblings = parent.children
        if siblings is node:
            parent.children = None
        elif isinstance(siblings, dict) and siblings.get(node.key) is node:
            del siblings[node.key]
            if len(siblings) == 1:
                parent.children = next(iter(siblings.values()))
        node.parent = None
        if parent.mask or parent.children:
            return
        node = parent


def _kids(node: _Node) -> list[_Node]:
    children = node.children
    if children is None:
        return []
    if isinstance(children, _Node):
        return [children]
    return list(children.values())


def _kept_elsewhere(src: _Source, pool: Pool, h: BlockHash, node: _Node) -> bool:
    """Whether another of the publisher's pools still places `h` at `node` (then the
    node keeps the publisher's bit). A pool holding `h` without a place takes it over."""
    for other in src.pools.values():
        if other is pool:
            continue
        held = other.get(h)
        if held is _LOOSE:
            other[h] = node
            return True
        if held is node:
            return True
    return False


def _placed_elsewhere(src: _Source, h: BlockHash) -> _Node | None:
    for pool in src.pools.values():
        node = pool.get(h)
        if node is not None and node is not _LOOSE:
            return node
    return None


def _drop_copy(extra: dict[tuple[PoolKey, BlockHash], int], key: tuple[PoolKey, BlockHash]) -> None:
    left = extra[key] - 1
    if left:
        extra[key] = left
    else:
        del extra[key]


def only_lora(extra_keys: list[object], lora_name: str | None) -> bool:
    """Whether the per-block extra keys hold nothing but the LoRA name (the namespace)."""
    return all(
        k is None
        or (lora_name is not None and isinstance(k, list | tuple) and list(k) == [lora_name])
        for k in extra_keys
    )
