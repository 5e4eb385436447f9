"""Reading the Redis store back: the fleet's registry, and each publisher's snapshot + log.

Both the service (its warm start: snapshot records replayed into its index, see
snapshot.py) and the store's worker process (its mirror) load this way. A publisher's
snapshot and cursor come from one HGETALL, so they agree; its log is then read from the
cursor on. A compaction running meanwhile may trim the log, but only
below the *previous* snapshot's position, so a reader is caught out only if two
compactions pass during its read: the log's `max-deleted-entry-id` tells, and the
publisher is read again.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from kvindex.index import FleetIndex
from kvindex.store.base import StoreError
from kvindex.store.mirror import Mirror
from kvindex.store.redis.layout import (
    CTL,
    INSTANCES,
    ZERO,
    Cursor,
    Entry,
    Fields,
    RawEntry,
    SnapshotId,
    StreamId,
    decode_records,
    decode_rows,
    log_key,
    parse_entry,
    parse_id,
    render_id,
    snap_key,
    snapshot_format,
    snapshot_id,
    sources_of,
)
from kvindex.store.rows import events_from_rows
from kvindex.store.snapshot import IndexTarget, LogTarget, MirrorRow, Stored, load_runs, replay
from kvindex.store.snapshot import snapshot_batches as runs_batches
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import EventBatch

CHUNK = 5_000


@dataclass(slots=True)
class Registry:
    """The fleet as registered, and the control-stream entry it is current as of."""

    specs: dict[str, str] = field(default_factory=dict)
    ctl_pos: StreamId = ZERO

    def sources(self) -> Iterator[SourceKey]:
        for spec in self.specs.values():
            yield from sources_of(spec)


def read_registry(client: redis.Redis) -> Registry:
    """The registry and the last control entry, read atomically (MULTI)."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(INSTANCES)
    pipe.xrevrange(CTL, count=1)
    specs, last = pipe.execute()
    pos = parse_id(last[0][0]) if last else ZERO
    return Registry({k.decode(): v.decode() for k, v in specs.items()}, pos)


@dataclass(slots=True)
class StoredPublisher:
    fields: dict[bytes, bytes]  # the snapshot as stored (forwarded as is to a service)
    cursor: Cursor  # the snapshot's position; `advance` moves it over `entries`
    entries: list[Entry]

    @property
    def snapshot(self) -> SnapshotId | None:
        return snapshot_id(self.fields.get(b""))


def read_source(client: redis.Redis, source: SourceKey, attempts: int = 5) -> StoredPublisher:
    """One publisher's snapshot and the log after it (read again if trimmed meanwhile)."""
    for _ in range(attempts):
        snap = cast(Fields, client.hgetall(snap_key(source)))
        cursor = Cursor.unpack(snap[b""]) if b"" in snap else Cursor()
        entries = list(read_log(client, source, cursor.pos))
        if not trimmed_past(client, source, cursor.pos):
            return StoredPublisher(snap, cursor, entries)
    raise StoreError(f"the log of {source!r} kept being compacted while it was read")


def read_log(
    client: redis.Redis, source: SourceKey, after: StreamId, limit: int | None = None
) -> Iterator[Entry]:
    """Log entries after `after`, in order (`limit`: at most that many)."""
    key, start, left = log_key(source), after, limit
    while left is None or left > 0:
        count = CHUNK if left is None else min(CHUNK, left)
        chunk = cast(
            list[RawEntry], client.xrange(key, min=f"({render_id(start)}", max="+", count=count)
        )
        for entry_id, fields in chunk:
            yield parse_entry(entry_id, fields)
        if len(chunk) < count:
            return
        start = parse_id(chunk[-1][0])
        if left is not None:
            left -= len(chunk)


def trimmed_past(client: redis.Redis, source: SourceKey, pos: StreamId) -> bool:
    """Whether entries after `pos` were trimmed away (so reading from `pos` misses some)."""
    try:
        info: dict[str, Any] = client.xinfo_stream(log_key(source))
    except redis.ResponseError:
        return False  # no log at all: nothing was trimmed either
    deleted = info.get("max-deleted-entry-id")
    return deleted is not None and parse_id(deleted) > pos


# -- a snapshot into an index, a mirror, or batches ------------------------------------------


def snapshot_batches(source: SourceKey, fields: dict[bytes, bytes]) -> Iterator[EventBatch]:
    """The batches that rebuild a snapshot (either format), parents first."""
    if snapshot_format(fields) == 1:
        for _, batch in events_from_rows(decode_rows(source, fields)):
            yield batch
        return
    yield from runs_batches([_stored(r) for r in decode_records(fields)])


def snapshot_into_index(index: FleetIndex, source: SourceKey, fields: dict[bytes, bytes]) -> int:
    """Load a snapshot into `index`; returns the blocks it holds."""
    if snapshot_format(fields) == 1:
        rows = decode_rows(source, fields)
        for row_source, batch in events_from_rows(rows):
            index.apply(row_source, batch)
        return len(rows)
    return replay(index, source, [_stored(r) for r in decode_records(fields)])


def snapshot_into_mirror(mirror: Mirror, source: SourceKey, state: StoredPublisher) -> int:
    """Load a snapshot into a mirror, and note which snapshot its saved runs are."""
    fields = state.fields
    if snapshot_format(fields) == 2:
        blocks = load_runs(mirror, source, decode_records(fields))
        mirror.snapshot_of[source] = state.snapshot
        return blocks
    rows = decode_rows(source, fields)
    for row_source, batch in events_from_rows(rows):
        mirror.apply_batch(row_source, batch)
    mirror.snapshot_of[source] = None  # blocks, not runs: the next compaction rewrites it
    return len(rows)


def _stored(row: MirrorRow) -> Stored:
    _id, rank, _group, _medium, _size, _lora, ts, keys, events, n = row
    return rank, keys, events, n, ts


def continues(cursor: Cursor, entry: Entry) -> bool:
    """Whether `entry` is the next one after `cursor`. One log never skips or repeats a
    seq (APPEND logs a batch only at the log's next seq, a lost range only from there),
    so an entry that does not continue was logged after a failover lost entries: over a
    snapshot some replica wrote back (Worker._refill) from further on or further back.
    A restart continues anything."""
    return entry.kind == "r" or entry.seq == cursor.next_seq


def covered(cursor: Cursor, entry: Entry) -> bool:
    """Whether `cursor` stands past all of `entry` already: a batch (or lost range) the
    failover lost and a replica logged again, after the snapshot that holds it was
    written back. Applied again it would count its blocks twice."""
    if entry.kind == "b":
        return entry.seq < cursor.next_seq
    return entry.kind == "l" and entry.last < cursor.next_seq


def advance(target: LogTarget, source: SourceKey, cursor: Cursor, entry: Entry) -> None:
    """Apply one log entry to a mirror (or an index) and move the cursor over it."""
    if entry.kind == "b":
        target.apply_payload(source, entry.payload)
        cursor.next_seq, cursor.digest = entry.seq + 1, zlib.crc32(entry.payload)
        cursor.last_seq = entry.seq
    elif entry.kind == "r":
        target.restart(source)
        cursor.next_seq, cursor.digest, cursor.lost = 0, None, 0
    elif entry.kind == "l":
        cursor.lost += entry.last - entry.seq + 1
        cursor.next_seq, cursor.digest = entry.last + 1, None
    cursor.pos = entry.id


def load_source(
    index: FleetIndex, client: redis.Redis, source: SourceKey
) -> tuple[Cursor, int, int]:
    """Snapshot + log of one publisher into `index`: (cursor, blocks, log batches)."""
    state = read_source(client, source)
    blocks = snapshot_into_index(index, source, state.fields)
    cursor = state.cursor
    batches = advance_tail(IndexTarget(index), source, cursor, state.entries)
    return cursor, blocks, batches


def advance_tail(target: LogTarget, source: SourceKey, cursor: Cursor, entries: list[Entry]) -> int:
    """A snapshot's log tail into `target`, past the entries logged again over the snapshot
    (`covered`); returns the batches applied."""
    batches = 0
    for entry in entries:
        if not covered(cursor, entry):
            advance(target, source, cursor, entry)
            batches += entry.kind == "b"
    return batches
