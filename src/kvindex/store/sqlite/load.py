"""Reading a SQLite store back: into the service's index at a warm start (snapshot, then
the log tail), and into a mirror for `kvindex export` and `kvindex stats` (read-only, safe
while a service runs). The writer applies its log with the same `apply_entry`."""

from __future__ import annotations

import contextlib
import gc
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvindex.index import FleetIndex
from kvindex.store.base import LoadResult
from kvindex.store.mirror import Mirror
from kvindex.store.rows import BlockRow, events_from_rows
from kvindex.store.snapshot import IndexTarget, LogTarget, Stored, load_runs, mirror_rows, replay
from kvindex.store.sqlite.fastload import load_in_c
from kvindex.store.sqlite.tables import (
    KIND_BATCH,
    KIND_REMOVE,
    KIND_RESTART,
    connect,
    read_blocks_v1,
    read_checkpoints,
    read_failure,
    read_instances,
    read_log,
    read_mirror_runs,
    read_runs,
    schema_version,
    snapshot_log_id,
)
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import WireError

__all__ = ["apply_entry", "current_rows", "load_database"]


def apply_entry(target: LogTarget, head: tuple[str, int, int], payload: Any) -> int:
    """Apply one log entry (instance, rank, kind) to an index or a mirror; 1 if a batch."""
    instance, rank, kind = head
    if kind == KIND_BATCH:
        target.apply_payload(SourceKey(instance, rank), payload)
        return 1
    if kind == KIND_RESTART:
        target.restart(SourceKey(instance, rank))
    elif kind == KIND_REMOVE:
        target.remove_instance(instance)
    return 0


def load_database(db: Any, index: FleetIndex, path: Path | str | None = None) -> LoadResult:
    """Snapshot, then log tail, into `index`; returns checkpoints and runtime instances.
    With the store's `path`, a compiled index has the snapshot read and applied in C
    without the GIL (see fastload)."""
    started = time.monotonic()
    # Loading creates objects by the million and frees none: the cyclic GC's passes over
    # them would cost a good part of the load for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        blocks = _load_snapshot(db, index, path)
        replayed = _replay_log(db, IndexTarget(index), snapshot_log_id(db))
    finally:
        if was_enabled:
            gc.enable()
    return LoadResult(
        checkpoints=read_checkpoints(db),
        instances=read_instances(db),
        blocks_restored=blocks,
        log_batches_replayed=replayed,
        seconds=time.monotonic() - started,
    )


def _load_snapshot(db: Any, index: FleetIndex, path: Path | str | None) -> int:
    if schema_version(db) == "1":  # only read-only opens see one (see connect)
        return _load_v1(db, index)
    with _records_read():
        if path is not None:
            blocks = load_in_c(path, index)
            if blocks is not None:
                return blocks
        return _load_runs(db, index)


@contextlib.contextmanager
def _records_read() -> Iterator[None]:
    """A record that does not read back (its keys, or its events: a batch of them that does
    not decode) is a damaged store, named as SQLite's own damage is (sqlite3.DatabaseError:
    see tables.read_failure): the index would have holes that the checkpoints never ask
    for again. Both loaders, and `kvindex store check`, say it in the same words."""
    try:
        yield
    except (WireError, msgspec.DecodeError, IndexError, TypeError) as exc:
        raise sqlite3.DatabaseError(
            f"a snapshot record does not load: {type(exc).__name__}: {exc}"
        ) from None


def _load_runs(db: Any, index: FleetIndex) -> int:
    """The snapshot in Python (the reference for fastload's C)."""
    by_source: dict[SourceKey, list[Stored]] = {}
    for instance, rank, stored in read_runs(db):
        key = SourceKey(instance, rank)
        records = by_source.get(key)
        if records is None:
            records = by_source[key] = []
        records.append(stored)
    return sum(replay(index, source, records) for source, records in by_source.items())


def _load_v1(db: Any, target: FleetIndex | Mirror) -> int:
    """A schema 1 snapshot (one row per block), read as earlier versions did."""
    rows = list(read_blocks_v1(db))
    for source, batch in events_from_rows(rows):
        if isinstance(target, FleetIndex):
            target.apply(source, batch)
        else:
            target.apply_batch(source, batch)
    return len(rows)


def _replay_log(db: Any, target: LogTarget, after: int) -> int:
    count = 0
    for entry in read_log(db, after):
        count += apply_entry(target, entry[1:4], entry[5])
    return count


def current_rows(path: str | Path) -> tuple[list[BlockRow], LoadResult]:
    """The store's blocks as of its last committed batch (snapshot + log tail), read-only:
    what `kvindex export` prints while serve runs."""
    db = connect(path, create=False)
    try:
        db.execute("BEGIN")  # one read transaction: snapshot and log agree
        mirror = Mirror()
        with _records_read():
            if schema_version(db) == "1":
                _load_v1(db, mirror)
            else:
                for instance, rank, record in read_mirror_runs(db):
                    load_runs(mirror, SourceKey(instance, rank), [record])
            replayed = _replay_log(db, mirror, snapshot_log_id(db))
            rows = mirror_rows(mirror)
        result = LoadResult(
            checkpoints=read_checkpoints(db),
            instances=read_instances(db),
            blocks_restored=len(rows),
            log_batches_replayed=replayed,
        )
        db.execute("COMMIT")
        return rows, result
    except sqlite3.DatabaseError as exc:
        raise read_failure(path, exc) from None
    finally:
        db.close()
