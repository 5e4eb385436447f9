"""Replaying persisted state into an index, and tracking what changed since a snapshot.

Both sides of a persistent store use this: the service, to come back warm, and the store's
writer, whose own index (a mirror of the service's, fed the same batches in the same
order) says exactly how many copies each block has when it writes a snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvindex.index import FleetIndex
from kvindex.store.rows import BlockRow, events_from_rows, rows_of_store
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
)

DirtyKey = tuple[SourceKey, int, str, BlockHash]


def restore_rows(index: FleetIndex, rows: Iterable[BlockRow]) -> int:
    """Put snapshot rows back into an index; returns the number of rows."""
    count = 0
    for source, batch in events_from_rows(rows):
        index.apply(source, batch)
        count += 1
    return count


@dataclass
class Changes:
    """What changed in a mirror index since its last snapshot."""

    dirty: dict[DirtyKey, BlockRow | None] = field(default_factory=dict)
    cleared: set[SourceKey] = field(default_factory=set)
    removed: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.dirty or self.cleared or self.removed)

    def forget_source(self, source: SourceKey) -> None:
        self.dirty = {k: v for k, v in self.dirty.items() if k[0] != source}
        self.cleared.add(source)

    def forget_instance(self, name: str) -> None:
        self.dirty = {k: v for k, v in self.dirty.items() if k[0].instance != name}
        self.cleared = {s for s in self.cleared if s.instance != name}
        self.removed.add(name)


class Mirror:
    """An index fed raw logged batches, noting which rows a snapshot must rewrite."""

    def __init__(self, index: FleetIndex | None = None) -> None:
        self.index = index or FleetIndex()
        self.changes = Changes()
        self.decode_errors = 0
        self._decoder = BatchDecoder()

    def apply_payload(self, source: SourceKey, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except WireError:
            self.decode_errors += 1  # the service skipped it too; its seq still counted
            return
        self.apply_batch(source, batch)

    def apply_batch(self, source: SourceKey, batch: EventBatch) -> None:
        dirty = self.changes.dirty
        for event in batch.events:
            if isinstance(event, BlockStored):
                for row in rows_of_store(event, batch.ts, source):
                    key = (source, row.group, row.medium, row.block_hash)
                    known = dirty.get(key)
                    # A hash-only copy must not hide the tokens an earlier store gave.
                    if known is None or row.token_ids is not None or known.token_ids is None:
                        dirty[key] = row
            elif isinstance(event, BlockRemoved):
                group, medium = event.group_idx or 0, event.medium or "GPU"
                for h in event.block_hashes:
                    dirty.setdefault((source, group, medium, h), None)
            elif isinstance(event, AllBlocksCleared):
                self.changes.forget_source(source)
        self.index.apply(source, batch)

    def restart(self, source: SourceKey) -> None:
        self.index.drop_source(source)
        self.changes.forget_source(source)

    def remove_instance(self, name: str) -> None:
        self.index.remove_instance(name)
        self.changes.forget_instance(name)

    def take_changes(self) -> Changes:
        changes, self.changes = self.changes, Changes()
        return changes


@dataclass
class Resolved:
    """Changes turned into row operations, with copies read from the mirror."""

    upserts: list[BlockRow] = field(default_factory=list)  # new rows, or new info
    updates: list[tuple[DirtyKey, int]] = field(default_factory=list)  # copies only
    deletes: list[DirtyKey] = field(default_factory=list)


def resolve(changes: Changes, index: FleetIndex) -> Resolved:
    """What a snapshot must write for these changes (after deleting cleared sources)."""
    out = Resolved()
    for key, row in changes.dirty.items():
        source, group, medium, h = key
        copies = index.count(source, group, medium, h)
        if copies == 0:
            out.deletes.append(key)
        elif row is not None:
            row.copies = copies
            out.upserts.append(row)
        else:
            out.updates.append((key, copies))
    return out


def fold(rows: dict[DirtyKey, BlockRow], changes: Changes, index: FleetIndex) -> None:
    """Apply changes to rows held in memory, exactly as a snapshot would in a table."""
    for key in [k for k in rows if k[0].instance in changes.removed or k[0] in changes.cleared]:
        del rows[key]
    resolved = resolve(changes, index)
    for key in resolved.deletes:
        rows.pop(key, None)
    for row in resolved.upserts:
        key = (row.source, row.group, row.medium, row.block_hash)
        held = rows.get(key)
        if held is None:
            rows[key] = row
        else:
            held.copies = row.copies
            if held.token_ids is None and row.token_ids is not None:
                held.token_ids, held.parent_hash = row.token_ids, row.parent_hash
                held.block_size = row.block_size
    for key, copies in resolved.updates:
        if key in rows:
            rows[key].copies = copies


def row_key(row: BlockRow) -> DirtyKey:
    return (row.source, row.group, row.medium, row.block_hash)
