"""Blocks as rows (what `kvindex export` prints; what snapshots held before runs) and rows
back into events (to load such a snapshot, see snapshot.py for today's).

A row is one (publisher, KV cache group, medium, block hash) with its number of physical
copies and what is needed to put it back into the prefix tree: its parent hash, its own
tokens, block size and LoRA name. Hashes are kept twice: as an exact binary key (an int
hash may be unsigned 64-bit, beyond SQL integers) and rendered as text for people and SQL.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvindex.subscriber.messages import SourceKey
from kvindex.wire import BlockHash, BlockStored, EventBatch

__all__ = ["BlockRow", "events_from_rows", "hash_key", "key_hash"]


def hash_key(value: BlockHash) -> bytes:
    """An exact, comparable binary key: a kind byte, then the value."""
    if isinstance(value, bytes):
        return b"\x01" + value
    return b"\x00" + value.to_bytes(9, "big", signed=True)


def key_hash(key: bytes) -> BlockHash:
    if key[:1] == b"\x01":
        return bytes(key[1:])
    return int.from_bytes(key[1:], "big", signed=True)


@dataclass(slots=True)
class BlockRow:
    source: SourceKey
    group: int
    medium: str
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: list[int] | None  # None for hash-only blocks (offloading)
    block_size: int
    lora_name: str | None
    copies: int
    stored_at: float


def events_from_rows(rows: Iterable[BlockRow]) -> Iterator[tuple[SourceKey, EventBatch]]:
    """Synthetic batches that rebuild these rows in an index: parents before children,
    extra copies as hash-only stores (they add copies, not tree nodes)."""
    by_source: dict[SourceKey, list[BlockRow]] = {}
    for row in rows:
        by_source.setdefault(row.source, []).append(row)
    for source, source_rows in by_source.items():
        ordered = _parents_first(source_rows)
        for chain in _chains(ordered):
            yield source, EventBatch(chain[0].stored_at, [_chain_event(chain)])
        for row in ordered:
            for _ in range(row.copies - 1):
                yield source, EventBatch(row.stored_at, [_copy_event(row)])


def _chains(ordered: list[BlockRow]) -> Iterator[list[BlockRow]]:
    """Runs of rows where each is the child of the one before, in one pool and namespace:
    one event each, as vLLM itself would have sent them (far cheaper than one per row)."""
    chain: list[BlockRow] = []
    for row in ordered:
        if chain and _continues(chain[-1], row):
            chain.append(row)
            continue
        if chain:
            yield chain
        chain = [row]
    if chain:
        yield chain


def _continues(prev: BlockRow, row: BlockRow) -> bool:
    return (
        row.parent_hash == prev.block_hash
        and row.token_ids is not None
        and prev.token_ids is not None
        and (row.group, row.medium, row.lora_name, row.block_size)
        == (prev.group, prev.medium, prev.lora_name, prev.block_size)
    )


def _chain_event(chain: list[BlockRow]) -> BlockStored:
    first = chain[0]
    tokens = [t for row in chain for t in row.token_ids or ()]
    # The LoRA name in every block's extra keys, as vLLM sends it (none without tokens).
    lora = first.lora_name
    extra = [[lora]] * len(chain) if lora is not None and tokens else None
    return BlockStored(
        [row.block_hash for row in chain],
        first.parent_hash,
        tokens,
        first.block_size,
        medium=first.medium,
        lora_name=lora,
        group_idx=first.group,
        extra_keys=extra,
    )


def _copy_event(row: BlockRow) -> BlockStored:
    return BlockStored([row.block_hash], None, [], 0, medium=row.medium, group_idx=row.group)


def _parents_first(rows: list[BlockRow]) -> list[BlockRow]:
    """Rows in depth-first order from the chains' roots: each block's parent (when held
    with tokens by the same publisher) comes before it, and chains stay contiguous."""
    by_hash: dict[BlockHash, BlockRow] = {}
    for row in rows:
        if row.token_ids is not None:
            by_hash.setdefault(row.block_hash, row)
    children: dict[BlockHash, list[BlockRow]] = {}
    roots: list[BlockRow] = []
    for row in rows:
        parent = row.parent_hash
        if row.token_ids is not None and parent is not None and parent in by_hash:
            children.setdefault(parent, []).append(row)
        else:
            roots.append(row)
    ordered: list[BlockRow] = []
    stack = list(reversed(roots))
    while stack:
        row = stack.pop()
        ordered.append(row)
        if row.token_ids is not None and by_hash.get(row.block_hash) is row:
            stack.extend(reversed(children.get(row.block_hash, ())))
    return ordered
