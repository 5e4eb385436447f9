"""Compaction: fold each publisher's log into its snapshot, then trim the log.

Every replica keeps a mirror, but only the one holding the `compactor` lock (a key with an
expiry, renewed while it works) writes: what changed in its mirror since its last
compaction, per publisher, in one MULTI together with the cursor it is current as of. A
WATCH on the snapshot makes the write conditional: if another compactor wrote a later
position meanwhile, this one keeps its changes for next time. The log is then trimmed
below the *previous* snapshot's position, and never of the last minute, so a replica
that is loading or reading a little behind still finds the entries it needs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from kvindex.store.redis_keys import (
    COMPACTOR,
    LOCK,
    Cursor,
    StreamId,
    log_key,
    render_id,
    row_field,
    row_value,
    snap_key,
)
from kvindex.store.rows import BlockRow
from kvindex.store.state import Changes, DirtyKey, Mirror, resolve
from kvindex.subscriber.messages import SourceKey

TRIM_SLACK_MS = 60_000
CHUNK = 10_000


@dataclass
class Compactor:
    mirror: Mirror
    cursors: dict[SourceKey, Cursor]
    interval: float
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)
    last: float = field(default_factory=time.monotonic)
    compactions: int = 0
    skipped: int = 0

    def due(self) -> bool:
        return bool(self.mirror.changes) and time.monotonic() - self.last >= self.interval

    def holds_lock(self, client: redis.Redis) -> bool:
        ms = int(max(self.interval * 5, 10) * 1000)
        return bool(client.eval(LOCK, 1, COMPACTOR, self.owner, ms))

    def release(self, client: redis.Redis) -> None:
        if client.get(COMPACTOR) == self.owner.encode():
            client.delete(COMPACTOR)

    def compact(self, client: redis.Redis) -> bool:
        """Write the mirror's changes if this replica holds the lock; True if it wrote."""
        self.last = time.monotonic()
        if not self.mirror.changes or not self.holds_lock(client):
            return False
        changes = self.mirror.take_changes()
        by_source = _by_source(changes)
        kept = Changes()
        for source in by_source.keys() | changes.cleared:
            cursor = self.cursors.get(source)
            if cursor is None:
                continue  # removed meanwhile
            dirty = by_source.get(source, {})
            cleared = source in changes.cleared
            if not self._write(client, source, cursor, dirty, cleared):
                kept.dirty.update(dirty)
                if cleared:
                    kept.cleared.add(source)
        _merge_back(self.mirror, kept)
        self.compactions += 1
        return True

    def _write(
        self,
        client: redis.Redis,
        source: SourceKey,
        cursor: Cursor,
        dirty: dict[DirtyKey, BlockRow | None],
        cleared: bool,
    ) -> bool:
        key = snap_key(source)
        index = self.mirror.index
        with client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)  # type: ignore[no-untyped-call]
                stored = cast(bytes | None, pipe.hget(key, ""))
                before = Cursor.unpack(stored) if stored else None
                if before is not None and before.pos > cursor.pos:
                    self.skipped += 1
                    return False
                sets, dels, updates = _plan(index, dirty)
                if not cleared and updates:
                    _refresh(pipe, key, updates, sets)
                pipe.multi()
                if cleared:
                    pipe.delete(key)
                _chunked(pipe, key, sets, dels)
                pipe.hset(key, "", cursor.pack())
                pipe.execute()
            except redis.WatchError:
                self.skipped += 1
                return False
        if before is not None:
            _trim(client, source, before.pos, cursor.pos)
        return True


def _by_source(changes: Changes) -> dict[SourceKey, dict[DirtyKey, BlockRow | None]]:
    out: dict[SourceKey, dict[DirtyKey, BlockRow | None]] = {}
    for k, row in changes.dirty.items():
        out.setdefault(k[0], {})[k] = row
    return out


def _plan(
    index: Any, dirty: dict[DirtyKey, BlockRow | None]
) -> tuple[dict[bytes, bytes], list[bytes], dict[bytes, int]]:
    """Fields to set, to delete, and whose copies changed (rows we don't hold in full)."""
    resolved = resolve(Changes(dirty=dirty), index)
    sets = {row_field(r.group, r.medium, r.block_hash): row_value(r) for r in resolved.upserts}
    dels = [row_field(k[1], k[2], k[3]) for k in resolved.deletes]
    updates = {row_field(k[1], k[2], k[3]): copies for k, copies in resolved.updates}
    return sets, dels, updates


def _refresh(pipe: Any, key: str, updates: dict[bytes, int], sets: dict[bytes, bytes]) -> None:
    """Rows whose copies changed but whose content only the snapshot holds: re-encoded."""
    from kvindex.store.redis_keys import pack, unpack

    names = list(updates)
    for i in range(0, len(names), CHUNK):
        part = names[i : i + CHUNK]
        for name, value in zip(part, pipe.hmget(key, part), strict=True):
            if value is not None:
                fields = unpack(value)
                fields[4] = updates[name]
                sets[name] = pack(fields)


def _chunked(pipe: Any, key: str, sets: dict[bytes, bytes], dels: list[bytes]) -> None:
    items = list(sets.items())
    for i in range(0, len(items), CHUNK):
        pipe.hset(key, mapping=dict(items[i : i + CHUNK]))
    for i in range(0, len(dels), CHUNK):
        pipe.hdel(key, *dels[i : i + CHUNK])


def _trim(client: redis.Redis, source: SourceKey, before: StreamId, now: StreamId) -> None:
    """Drop log entries below the previous snapshot and older than the slack."""
    limit = min(before, (max(0, now[0] - TRIM_SLACK_MS), 0))
    if limit > (0, 0):
        client.xtrim(log_key(source), minid=render_id(limit), approximate=False)


def _merge_back(mirror: Mirror, kept: Changes) -> None:
    """Changes not written stay pending; newer ones noted meanwhile take precedence."""
    changes = mirror.changes
    for k, row in kept.dirty.items():
        changes.dirty.setdefault(k, row)
    changes.cleared |= kept.cleared
