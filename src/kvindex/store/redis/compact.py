"""Compaction: fold each publisher's log into its snapshot, then trim the log.

Every replica keeps a mirror, but only the one holding the `compactor` lock (a key with an
expiry, renewed while it works) writes: the runs that changed in its mirror since its last
compaction, per publisher, in one MULTI together with the cursor it is current as of. A
WATCH on the snapshot makes the write conditional: if another compactor wrote a later
position meanwhile, this one leaves it be.

Runs are the mirror's own (their ids are its own), so only changes are written only while
the snapshot is still the one the mirror's runs were saved in or loaded from (its writer
and position say so); otherwise, and after a restart of the publisher, the publisher's
snapshot is rewritten whole. The log is then trimmed below the *previous* snapshot's
position, and never of the last minute, so a replica that is loading or reading a little
behind still finds the entries it needs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from kvindex.store.mirror import Mirror, PublisherRuns, Run
from kvindex.store.redis.layout import (
    COMPACTOR,
    LOCK,
    Cursor,
    StreamId,
    log_key,
    record_field,
    render_id,
    run_field,
    snap_key,
    snapshot_id,
)
from kvindex.store.snapshot import SnapshotPlan, plan_source
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
        return time.monotonic() - self.last >= self.interval and self.mirror.changed()

    def holds_lock(self, client: redis.Redis) -> bool:
        ms = int(max(self.interval * 5, 10) * 1000)
        return bool(client.eval(LOCK, 1, COMPACTOR, self.owner, ms))

    def release(self, client: redis.Redis) -> None:
        if client.get(COMPACTOR) == self.owner.encode():
            client.delete(COMPACTOR)

    def compact(self, client: redis.Redis) -> bool:
        """Write the mirror's changes if this replica holds the lock; True if it wrote."""
        self.last = time.monotonic()
        if not self.mirror.changed():
            return False
        if not self.holds_lock(client):
            self.mirror.forget(self.mirror.take())  # another replica writes them
            return False
        changes = self.mirror.take()
        left = changes.dirty.keys() | changes.cleared | changes.touched
        try:
            for source in list(left):
                cursor = self.cursors.get(source)
                src = self.mirror.sources.get(source)
                if cursor is not None and src is not None:  # else removed meanwhile
                    dirty = changes.dirty.get(source, set())
                    cleared = source in changes.cleared
                    if not self._write(client, source, cursor, src, dirty, cleared):
                        self.mirror.snapshot_of[source] = None  # the next write is whole
                left.discard(source)
        except BaseException:
            # Redis went away midway: what was taken for the publishers not written is
            # not lost, their next snapshot is written whole (from the mirror as it is).
            self.mirror.rewrite_whole(left)
            raise
        self.compactions += 1
        return True

    def rewrite(self, client: redis.Redis, sources: Iterable[SourceKey]) -> list[SourceKey]:
        """Write the mirror's whole snapshot of each of `sources` now, lock or not (a
        Redis that lost them: see Worker._refill); each write is still one transaction
        that yields to a newer snapshot. Returns the publishers written."""
        written = []
        for source in sources:
            cursor, src = self.cursors.get(source), self.mirror.sources.get(source)
            if cursor is None or src is None:
                continue
            self.mirror.snapshot_of[source] = None  # whole
            if self._write(client, source, cursor, src, set(), True):
                written.append(source)
        return written

    def _write(
        self,
        client: redis.Redis,
        source: SourceKey,
        cursor: Cursor,
        src: PublisherRuns,
        dirty: set[Run],
        cleared: bool,
    ) -> bool:
        key = snap_key(source)
        with client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)  # type: ignore[no-untyped-call]
                stored = cast(bytes | None, pipe.hget(key, ""))
                before = Cursor.unpack(stored) if stored else None
                if before is not None and before.pos > cursor.pos:
                    self.skipped += 1
                    return False
                current = snapshot_id(stored)
                whole = cleared or current is None or current != self.mirror.snapshot_of.get(source)
                plan = plan_source(
                    self.mirror, src, list(src.runs.values()) if whole else dirty, False
                )
                pipe.multi()
                if whole:
                    pipe.delete(key)
                _write_plan(pipe, key, plan, whole)
                pipe.hset(key, "", cursor.pack(self.owner))
                pipe.execute()
            except redis.WatchError:
                self.skipped += 1
                return False
        plan.done()
        self.mirror.snapshot_of[source] = (self.owner, cursor.pos)
        if before is not None:
            _trim(client, source, before.pos, cursor.pos)
        return True


def _write_plan(pipe: Any, key: str, plan: SnapshotPlan, whole: bool) -> None:
    items = [record_field(record) for record in plan.records]
    for i in range(0, len(items), CHUNK):
        pipe.hset(key, mapping=dict(items[i : i + CHUNK]))
    dels = [] if whole else [run_field(run_id) for run_id in plan.deletes]
    for i in range(0, len(dels), CHUNK):
        pipe.hdel(key, *dels[i : i + CHUNK])


def _trim(client: redis.Redis, source: SourceKey, before: StreamId, now: StreamId) -> None:
    """Drop log entries below the previous snapshot and older than the slack."""
    limit = min(before, (max(0, now[0] - TRIM_SLACK_MS), 0))
    if limit > (0, 0):
        client.xtrim(log_key(source), minid=render_id(limit), approximate=False)
