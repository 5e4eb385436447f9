"""`CompiledIndex`: the fleet index on the C core (`kvindex.index._core`), same answers.

The model is fleet.py's, kept in compact C memory (see _core/core.h). Batches come in two
ways:

- `apply_payload`: the msgpack bytes as the publisher sent them, parsed and applied in C
  with the GIL released (no Python object per event or block). A batch the fast parser
  does not take (an unknown event type, multimodal or lookahead keys, a token id past 32
  bits, a malformed payload...) is decoded by kvindex.wire's Python decoder instead, which
  decides what it means and counts what is malformed, and then applied as ops: nothing is
  lost and nothing changes meaning.
- `apply`: an already decoded `EventBatch` (tests, the simulator, a store's warm load),
  turned into the same ops.

Ops carry what fleet.py computes in Python per stored event (its chain keys, namespace
and tree keys), so both implementations place every block the same way; the differential
tests (tests/test_core.py) hold them to identical state and answers.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvindex.index._core import Core, parse_lookup

if TYPE_CHECKING:
    from kvindex.index._core import EmptyRows
from kvindex.index.base import AnswerSlot, BitPool, IndexBase, Layout, LookupRow, PayloadResult
from kvindex.index.keys import chain_keys_bytes
from kvindex.index.localhash import LocalHashesOff
from kvindex.index.multimodal import MMFeature, MMKey, PromptKeys
from kvindex.index.namespaces import PLAIN, chain_keys
from kvindex.index.reference import Namespace, event_tokens, is_keyed, is_plain
from kvindex.index.reuse import Reuse
from kvindex.index.stats import CacheStats
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import (
    AllBlocksCleared,
    BigramBlockStored,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
)
from kvindex.wire.pools import PoolCopies, PoolKey

__all__ = ["CompiledIndex", "batch_ops", "parse_lookup_body"]


def parse_lookup_body(body: bytes, max_items: int) -> tuple[bytes, str | None, str | None] | None:
    """A `/v1/lookup` body read in C: (token ids as uint32 bytes, lora_name, cache_salt), or
    None when it is not the plain shape (anything from an error to `1.0` or an escaped
    string): the service's own decoder then decides, so every refusal keeps its wording."""
    return parse_lookup(body, max_items)


@dataclass(slots=True)
class _Pub:
    key: SourceKey
    bit: int
    last_seq: int | None = None
    last_ts: float | None = None


class CompiledIndex(IndexBase[_Pub]):
    """Exact per-publisher block state and token-prefix lookups, in C."""

    def __init__(
        self,
        rate_window: float = 60.0,
        seed: int | None = None,
        shared_tokens: bool = True,
        local_hashes: bool = False,
        bits: BitPool | None = None,
    ) -> None:
        """`shared_tokens`: keep the tokens of blocks two publishers or more hold, which
        `walk_tree` (the dashboard's shared prefixes) shows; off saves ingest some work.
        `local_hashes`: keep Dynamo's local block hashes of the tree's blocks, which
        `lookup_local_hashes` (the peers' `/query_by_hash`) asks; ~30 bytes a block more
        and one XXH3 per new block (the pure index hashes the stored tokens as it walks).
        `bits`: the numbering of publishers, shared with other indexes (a ShardedIndex's)."""
        super().__init__(rate_window, bits)
        self._core = Core(seed)
        self._core.keep_tokens(shared_tokens)
        self.local_hashes = local_hashes
        if local_hashes:
            self._core.keep_local_hashes(True)
        self.slow_batches = 0  # payloads the fast parser left to the Python decoder
        # What the core asks for the rows matching nothing; a shard's also records the
        # smallest tree its thread's last lookup walked (`record_default_keys`).
        self._empty_rows_of: EmptyRows = self._empty_for
        self._walked = threading.local()

    def record_default_keys(self) -> None:
        """Have every lookup remember, per thread, the smallest tree size it walked (a
        ShardedIndex's shards: one index has no use for it)."""
        self._empty_rows_of = self._empty_recorded

    def _empty_recorded(self, size: int, layout: Layout, key: int = 0) -> list[LookupRow]:
        self._walked.key = key
        return self._empty_for(size, layout, key)

    def last_default_key(self) -> int:
        """The smallest tree size (as the core keys it; 0: none) this thread's last lookup
        walked (`record_default_keys`): what a ShardedIndex gives the rows matching nothing
        in every shard."""
        key: int = getattr(self._walked, "key", 0)
        return key

    # -- feeding -----------------------------------------------------------------------

    def _pub(self, source: SourceKey) -> _Pub:
        return self._sources.get(source) or self._register(source, _Pub)

    def apply(self, source: SourceKey, batch: EventBatch, seq: int | None = None) -> None:
        """Apply one decoded batch of `source`."""
        pub = self._pub(source)
        ops, stored, removed, clears = batch_ops(batch)
        self._core.apply_ops(pub.bit, ops)
        pub.last_seq, pub.last_ts = seq, batch.ts
        self.rates.add(stored, removed, clears)

    def apply_payload(
        self, source: SourceKey, payload: bytes | memoryview, seq: int | None = None
    ) -> PayloadResult:
        """Parse and apply one batch as the publisher sent it. Raises `WireError` (from
        the Python decoder) for a payload that is not an event batch at all."""
        new = source not in self._sources
        pub = self._pub(source)
        applied, ts, rank, counts = self._core.apply_payload(pub.bit, payload)
        if applied and ts is not None and counts is not None:
            pub.last_seq, pub.last_ts = seq, ts
            self.rates.add(*counts)
            return PayloadResult(ts, rank, fast=True)
        self.slow_batches += 1
        try:
            return super().apply_payload(source, payload, seq)
        except WireError:
            # Not a batch at all: a publisher first heard of here is not one yet (the
            # reference registers it only once a batch decodes; found by fuzz/).
            if new:
                self._core.remove(pub.bit)
                self._forget(pub)
            raise

    # -- the in-order path in C (kvindex.subscriber.inorder) ---------------------------

    def ingest_api(self) -> tuple[object, object]:
        """(capsule, Core): what a C ingest loop applies batches through (ingest_api.h)."""
        return self._core.ingest_api(), self._core

    def publisher_bit(self, source: SourceKey) -> int | None:
        """The core's bit of `source`; None before its first batch (which goes through
        `apply_payload`: a publisher is one once a batch of it decodes)."""
        pub = self._sources.get(source)
        return None if pub is None else pub.bit

    def register_publisher(self, source: SourceKey) -> int:
        """The core's bit of `source`, numbered now if new: what a C loader that applies
        batches through `ingest_api` asks before the first (kvindex.store.sqlite.fastload)."""
        return self._pub(source).bit

    def applied_in_c(
        self,
        source: SourceKey,
        last_seq: int | None,
        ts: float | None,
        counts: tuple[int, int, int],
    ) -> None:
        """The bookkeeping of batches a C loop applied (apply_payload's, in bulk)."""
        pub = self._sources.get(source)
        if pub is None:  # removed meanwhile
            return
        pub.last_seq = last_seq
        if ts is not None:
            pub.last_ts = ts
        self.rates.add(*counts)

    def drop_source(self, source: SourceKey) -> None:
        """Forget what `source` holds (its engine restarted): its cache is empty now."""
        pub = self._sources.get(source)
        if pub is not None:
            self._core.clear(pub.bit, True)

    def remove_instance(self, name: str) -> None:
        for pub in list(self._instance_publishers(name)):
            self._core.remove(pub.bit)
            self._forget(pub)

    # -- questions ---------------------------------------------------------------------

    def _pool_keys(self, pub: _Pub) -> list[PoolKey]:
        keys: list[PoolKey] = self._core.pool_keys(pub.bit)
        return keys

    def _pool_hashes(self, pub: _Pub, index: int) -> Iterable[BlockHash]:
        hashes: list[BlockHash] = self._core.pool_hashes(pub.bit, index)
        return hashes

    def _stats(self, pub: _Pub) -> CacheStats:
        stored, removed, clears, batches, restarts, unplaced, odd, kept, moved = self._core.stats(
            pub.bit
        )
        return CacheStats(
            stored=stored,
            removed=removed,
            clears=clears,
            batches=batches,
            restarts=restarts,
            unplaced=unplaced,
            unrecognised_keys=odd,
            namespace_kept=kept,
            namespace_moved=moved,
        )

    def copies(self, source: SourceKey) -> PoolCopies:
        """The pools of one publisher: (group, medium) -> hash -> copies (a snapshot)."""
        pub = self._sources.get(source)
        if pub is None:
            return {}
        return {(group, medium): held for group, medium, held in self._core.pools(pub.bit)}

    def block_count(self, instance: str) -> int:
        return self._distinct(instance)[0]

    def blocks_by_medium(self, instance: str) -> dict[str, int]:
        return dict(sorted(self._distinct(instance)[1].items()))

    def _distinct(self, instance: str) -> tuple[int, dict[str, int]]:
        """Distinct hashes over the instance's ranks and pools, counted in C without the
        GIL (the base class's union of Python sets held it ~0.5 s for 1M blocks)."""
        return self._core.distinct([pub.bit for pub in self._instance_publishers(instance)])

    def count(self, source: SourceKey, group: int, medium: str, block_hash: BlockHash) -> int:
        """Copies of one hash in one pool of one publisher (0 if not held)."""
        pub = self._sources.get(source)
        return 0 if pub is None else int(self._core.count(pub.bit, group, medium, block_hash))

    def entries(self) -> int:
        """(publisher, pool, hash) entries held: the index's size."""
        return int(self._core.entries())

    def tree_nodes(self) -> int:
        return int(self._core.tree_nodes())

    def memory(self) -> dict[str, int]:
        """Bytes of the core's structures, by part (malloc's own overhead aside)."""
        parts: dict[str, int] = self._core.memory()
        return parts

    def walk_tree(self) -> Iterator[tuple[Namespace, int, bytes, int]]:
        """As `ReferenceIndex.walk_tree`; a node's key is its tokens as uint32 bytes where the
        core kept them (nodes two publishers or more hold: the shared prefixes), else
        empty (the core keys the tree by digests)."""
        for namespace, depth, _key, tokens, holders in self.walk_keys():
            yield namespace, depth, tokens, holders

    def walk_keys(self) -> Iterator[tuple[Namespace, int, int, bytes, int]]:
        """`walk_tree` with each node's key (the digest of its block under its parent: the
        same in every index made with the same seed)."""
        for lora, salt, size, depth, key, tokens, holders in self._core.walk_tree():
            yield (lora, salt, size), depth, key, tokens or b"", holders

    def lookup(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        *,
        mm_features: Sequence[MMFeature | Mapping[str, Any]] | None = None,
        extra_keys: Sequence[Sequence[MMKey] | None] | None = None,
    ) -> list[LookupRow]:
        """As `ReferenceIndex.lookup` (the rows are made in C: a big fleet's answer costs no
        Python work per instance)."""
        if mm_features is None and extra_keys is None:  # the plain path, as short as it was
            return self._core.lookup(
                token_ids,
                lora_name,
                cache_salt,
                self._layout or self._lay_out(),
                self._empty_rows_of,
                LookupRow,
            )
        layout = self._layout or self._lay_out()
        own = self._own_keys(token_ids, PromptKeys.of(mm_features, extra_keys))
        return self._core.lookup(
            token_ids, lora_name, cache_salt, layout, self._empty_rows_of, LookupRow, own
        )

    def _own_keys(
        self, token_ids: Sequence[int] | bytes, keys: PromptKeys | None
    ) -> dict[int, dict[int, bytes]] | None:
        """The lookup's own-keyed blocks as the core takes them: per tree size it walks,
        block index -> the block's whole tree key (None: a plain lookup)."""
        if keys is None:
            return None
        if isinstance(token_ids, bytes):
            token_ids = array("I", token_ids).tolist()
        return {size: keys.tree_keys(token_ids, size) for size in self._core.tree_sizes()}

    def lookup_json(
        self,
        token_ids: Sequence[int] | bytes,
        lora_name: str | None,
        cache_salt: str | None,
        slots: list[AnswerSlot],
        statuses: list[bytes],
        keys: PromptKeys | None = None,
    ) -> tuple[bytes, bool]:
        """The runtime's whole answer to a lookup as JSON, made in C, and whether it is a
        hit: exactly what encoding `Fleet.lookup`'s answer gives
        (`slots`: the followed instances by name; `statuses`: each one's status as JSON).
        `token_ids` may be `parse_lookup_body`'s bytes; `keys`: the prompt's own keys."""
        if keys is None:
            return self._core.lookup_json(token_ids, lora_name, cache_salt, slots, statuses)
        own = self._own_keys(token_ids, keys)
        return self._core.lookup_json(token_ids, lora_name, cache_salt, slots, statuses, own)

    def answer_core(self) -> object:
        """What a C thread answers lookups with (lookup_api.h's `core`): the Core."""
        return self._core

    def sources_gen(self) -> int:
        """Moves whenever a publisher is made or removed (see lookup_api.h)."""
        return self._core.sources_gen()

    def lookup_local_hashes(
        self,
        hashes: Sequence[int],
        lora_name: str | None = None,
        block_size: int | None = None,
    ) -> list[LookupRow]:
        """As `ReferenceIndex.lookup_local_hashes` (LocalHashesOff unless made with
        `local_hashes=True`)."""
        if not self.local_hashes:
            raise LocalHashesOff("the compiled index keeps no local hashes (local_hashes=True)")
        return self._core.lookup_local(
            hashes,
            lora_name,
            block_size,
            self._layout or self._lay_out(),
            self._empty_rows_of,
            LookupRow,
        )

    def lookup_hashes(self, block_hashes: Sequence[BlockHash]) -> list[LookupRow]:
        """As `ReferenceIndex.lookup_hashes`."""
        found = self._core.lookup_hashes(block_hashes)
        return self._rows({bit: Reuse(blocks, 0, by_tier, {}) for bit, blocks, by_tier in found})


def batch_ops(batch: EventBatch) -> tuple[list[tuple[Any, ...]], int, int, int]:
    """A decoded batch as the core's ops (see module.c's op_from_tuple), and its stored,
    removed and cleared counts. The keys are fleet.py's, computed the same way."""
    ops: list[tuple[Any, ...]] = []
    stored = removed = clears = 0
    for event in batch.events:
        if isinstance(event, BlockRemoved):
            removed += len(event.block_hashes)
            ops.append(("R", event.block_hashes, event.medium, event.group_idx))
        elif isinstance(event, BlockStored):
            stored += len(event.block_hashes)
            ops.append(_stored_op(event))
        elif isinstance(event, AllBlocksCleared):
            clears += 1
            ops.append(("C",))
    return ops, stored, removed, clears


def _stored_op(event: BlockStored) -> tuple[Any, ...]:
    keys = PLAIN if is_plain(event) else chain_keys(event)
    tokens, width, size = event_tokens(event)
    hashes = event.block_hashes
    positioned = size > 0 and len(tokens) == width * len(hashes) and hashes
    chain = chain_keys_bytes(tokens, width, len(hashes), keys.own) if positioned else []
    # The tokens go along for shared nodes, and for a chain of a group whose blocks are
    # smaller than another's (fleet._store_units reads them unit by unit, skipped or not).
    try:
        token_bytes: bytes | None = (
            array("I", tokens).tobytes() if size > 0 and hashes and tokens else None
        )
    except (OverflowError, TypeError):
        token_bytes = None
    return (
        "S",
        hashes,
        event.parent_block_hash,
        chain,
        len(tokens),
        token_bytes,
        event.block_size,
        event.lora_name,
        event.lora_id,
        keys.salt,
        is_keyed(event, keys),
        event.medium,
        event.group_idx,
        event.kv_cache_spec_kind,
        event.kv_cache_spec_sliding_window,
        keys.unrecognised,
        isinstance(event, BigramBlockStored),
        keys.own is not None,
    )
