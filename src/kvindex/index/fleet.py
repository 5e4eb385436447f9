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

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvindex.index.stats import CacheStats, RateWindow
from kvindex.subscriber.messages import Delivery, Item, Restarted, SourceKey
from kvindex.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch

__all__ = ["FleetIndex", "LookupRow"]

DEFAULT_MEDIUM = "GPU"

PoolKey = tuple[int, str]  # (group_idx, medium)
Namespace = tuple[str | None, int]  # (lora_name, block_size)


class _Node:
    """One block of tokens under its parent. Children are keyed by the block's token bytes."""

    __slots__ = ("children", "key", "mask", "parent")

    def __init__(self, parent: _Node | None, key: bytes) -> None:
        self.parent = parent
        self.key = key
        self.children: dict[bytes, _Node] = {}
        self.mask = 0


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as fixed-width bytes, so a block's key is a slice (cheap to hash)."""
    try:
        return array("q", tokens).tobytes()
    except OverflowError:
        raise ValueError("token ids must fit in 64 bits") from None


@dataclass(slots=True)
class _Source:
    key: SourceKey
    bit: int
    pools: dict[PoolKey, dict[BlockHash, int]] = field(default_factory=dict)
    nodes: dict[BlockHash, _Node] = field(default_factory=dict)
    stats: CacheStats = field(default_factory=CacheStats)
    last_seq: int | None = None
    last_ts: float | None = None


@dataclass(frozen=True, slots=True)
class LookupRow:
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
        self.rates = RateWindow(rate_window)

    # -- feeding -----------------------------------------------------------------------

    def apply(self, source: SourceKey, batch: EventBatch, seq: int | None = None) -> None:
        """Apply one delivered batch of `source`."""
        src = self._source(source)
        stats = src.stats
        stored = removed = clears = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(src, event)
                stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(src, event)
                removed += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear(src)
                clears += 1
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

    def _source(self, key: SourceKey) -> _Source:
        src = self._sources.get(key)
        if src is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._by_bit)
            src = self._sources[key] = self._by_bit[bit] = _Source(key, bit)
            self._all_mask |= 1 << bit
        return src

    def _store(self, src: _Source, event: BlockStored) -> None:
        pool_key = (event.group_idx or 0, event.medium or DEFAULT_MEDIUM)
        pool = src.pools.get(pool_key)
        if pool is None:
            pool = src.pools[pool_key] = {}
        hashes = event.block_hashes
        for h in hashes:
            pool[h] = pool.get(h, 0) + 1
        self._insert_chain(src, event)

    def _insert_chain(self, src: _Source, event: BlockStored) -> None:
        size = event.block_size
        hashes = event.block_hashes
        tokens = event.token_ids
        if size <= 0 or len(tokens) < size * len(hashes):
            return  # hash-only (offloading) or partial (a sliding-window group): no tokens
        if event.extra_keys and not only_lora(event.extra_keys, event.lora_name):
            return  # keyed by multimodal inputs or a cache salt: not findable by tokens alone
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            namespace = (event.lora_name, size)
            node = self._roots.get(namespace)
            if node is None:
                node = self._roots[namespace] = _Node(None, b"")
        else:
            found = src.nodes.get(parent_hash)
            if found is None:
                return  # the parent is unknown to us: the chain can't be placed
            node = found
        try:
            data = _token_bytes(tokens)
        except ValueError:
            return  # a token id past 64 bits (no lookup can ask for it): blocks only
        width = size * 8
        bit = 1 << src.bit
        nodes = src.nodes
        for i, h in enumerate(hashes):
            key = data[i * width : (i + 1) * width]
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key)
            old = nodes.get(h)
            if old is not None and old is not child:
                # The same hash announced for other tokens (never from a sane publisher):
                # the hash now means these tokens; the old node must not stay matched.
                old.mask &= ~bit
                if old is not node:
                    self._prune(old)
            child.mask |= bit
            nodes[h] = child
            node = child

    def _remove(self, src: _Source, event: BlockRemoved) -> None:
        pool_key = (event.group_idx or 0, event.medium or DEFAULT_MEDIUM)
        pool = src.pools.get(pool_key)
        if pool is None:
            return
        for h in event.block_hashes:
            count = pool.get(h)
            if count is None:
                continue  # not known to be held (e.g. stored before a loss): nothing to drop
            if count > 1:
                pool[h] = count - 1
                continue
            del pool[h]
            if not self._held_elsewhere(src, h):
                self._untree(src, h)

    def _held_elsewhere(self, src: _Source, h: BlockHash) -> bool:
        return len(src.pools) > 1 and any(h in pool for pool in src.pools.values())

    def _untree(self, src: _Source, h: BlockHash) -> None:
        node = src.nodes.pop(h, None)
        if node is None:
            return
        node.mask &= ~(1 << src.bit)
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        # Free nodes nobody holds and nothing hangs from, so memory follows what is cached.
        while node.mask == 0 and not node.children and node.parent is not None:
            parent = node.parent
            if parent.children.get(node.key) is node:
                del parent.children[node.key]
            node.parent = None
            node = parent

    def _clear(self, src: _Source) -> None:
        bit = ~(1 << src.bit)
        for node in src.nodes.values():
            node.mask &= bit
        for node in list(src.nodes.values()):
            self._prune(node)
        src.nodes.clear()
        src.pools.clear()

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
        return {} if src is None else {k: dict(v) for k, v in src.pools.items()}

    def count(self, source: SourceKey, group: int, medium: str, block_hash: BlockHash) -> int:
        """Copies of one hash in one pool of one publisher (0 if not held)."""
        src = self._sources.get(source)
        pool = None if src is None else src.pools.get((group, medium))
        return 0 if pool is None else pool.get(block_hash, 0)

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
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    # Read-only views of the prefix tree, for analyses such as `kvindex.index.sharing`.

    def walk_tree(self) -> Iterator[tuple[Namespace, int, bytes, int]]:
        """Every node of the prefix tree, depth first with parents before children: its
        namespace (LoRA name, block size), depth (1 = a prompt's first block), the block's
        tokens (native int64 bytes) and the bit mask of the publishers holding it (bits as in
        `source_bits`). Don't change the index while walking."""
        for namespace, root in self._roots.items():
            stack = [(child, 1) for child in root.children.values()]
            while stack:
                node, depth = stack.pop()
                yield namespace, depth, node.key, node.mask
                stack.extend((child, depth + 1) for child in node.children.values())

    def source_bits(self) -> dict[int, SourceKey]:
        """Bit number (as in the tree's masks) -> the publisher it stands for."""
        return {bit: src.key for bit, src in self._by_bit.items()}

    def _instance_sources(self, instance: str) -> Iterable[_Source]:
        return (s for k, s in self._sources.items() if k.instance == instance)

    def lookup(self, token_ids: Sequence[int], lora_name: str | None = None) -> list[LookupRow]:
        """Per instance, the longest run of cached blocks from the prompt's first token."""
        depth_by_bit: dict[int, int] = {}
        size_by_bit: dict[int, int] = {}
        data = _token_bytes(token_ids) if token_ids else b""
        for (lora, size), root in self._roots.items():
            if lora != lora_name:
                continue
            for bit, depth in self._walk(root, data, size).items():
                if depth >= depth_by_bit.get(bit, -1):
                    depth_by_bit[bit] = depth
                    size_by_bit[bit] = size
        return self._rows(depth_by_bit, size_by_bit)

    def _walk(self, root: _Node, data: bytes, size: int) -> dict[int, int]:
        width = size * 8
        blocks = len(data) // width
        alive = self._all_mask
        depths: dict[int, int] = {}
        node = root
        depth = 0
        children = node.children
        while depth < blocks and alive:
            child = children.get(data[depth * width : (depth + 1) * width])
            if child is None:
                break
            dropped = alive & ~child.mask
            if dropped:
                _record(depths, dropped, depth)
                alive &= child.mask
            depth += 1
            children = child.children
        if alive:
            _record(depths, alive, depth)
        return depths

    def lookup_hashes(self, block_hashes: Sequence[BlockHash]) -> list[LookupRow]:
        """Per instance, how many of these hashes, from the first, it holds now."""
        depth_by_bit: dict[int, int] = {}
        for src in self._sources.values():
            depth = 0
            for h in block_hashes:
                if not any(h in pool for pool in src.pools.values()):
                    break
                depth += 1
            depth_by_bit[src.bit] = depth
        return self._rows(depth_by_bit, {})

    def _rows(self, depth_by_bit: dict[int, int], size_by_bit: dict[int, int]) -> list[LookupRow]:
        per_instance: dict[str, dict[int, tuple[int, int]]] = {}
        for src in self._sources.values():
            depth = depth_by_bit.get(src.bit, 0)
            size = size_by_bit.get(src.bit, 0)
            per_instance.setdefault(src.key.instance, {})[src.key.rank] = (depth, size)
        rows = []
        for name, ranks in sorted(per_instance.items()):
            best_rank = max(ranks, key=lambda r: (ranks[r][0], -r))
            depth, size = ranks[best_rank]
            rows.append(
                LookupRow(
                    instance=name,
                    matched_blocks=depth,
                    matched_tokens=depth * size,
                    block_size=size,
                    best_rank=best_rank,
                    ranks={r: d for r, (d, _) in sorted(ranks.items())},
                )
            )
        return rows


def _record(depths: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        depths[low.bit_length() - 1] = depth
        mask ^= low


def only_lora(extra_keys: list[object], lora_name: str | None) -> bool:
    """Whether the per-block extra keys hold nothing but the LoRA name (the namespace)."""
    return all(
        k is None
        or (lora_name is not None and isinstance(k, list | tuple) and list(k) == [lora_name])
        for k in extra_keys
    )
