"""`--store sqlite:///PATH`: the embedded, durable default.

The service never waits on SQLite. It hands each applied item to a writer *process*
(writer.py) over its WorkerLink (bounded, supervised: see kvindex.store.link), so the other
core does the work and no lookup waits on the GIL.

A stop at any point, even `kill -9` mid-batch, leaves a consistent file: snapshot + log
tail + checkpoints. The next start replays both into the index, and the Subscriber asks
each publisher for exactly the batches after its checkpoint (and checks, by the last
batch's checksum, that it is still the same engine). One service owns a store at a time
(owner.py).
"""

from __future__ import annotations

import gc
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from kvindex.index import FleetIndex
from kvindex.store.base import LoadResult, SharedStore, StoreError
from kvindex.store.link import WorkerCommand, WorkerLink, WorkerStore
from kvindex.store.protocol import (
    AppliedBatch,
    LostMark,
    RemoveInstance,
    RestartMark,
    SaveInstance,
)
from kvindex.store.rows import BlockRow, events_from_rows
from kvindex.store.snapshot import IndexTarget, Stored, Target, load_runs, mirror_rows, replay
from kvindex.store.sqlite.owner import OwnerLock
from kvindex.store.sqlite.schema import (
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
from kvindex.store.sqlite.writer import WriterOptions, apply_entry
from kvindex.store.state import Mirror
from kvindex.subscriber.messages import Delivery, Item, Lost, Restarted, SourceKey
from kvindex.subscriber.spec import InstanceSpec

__all__ = ["SQLiteStore", "current_rows", "load_database"]


class SQLiteStore(WorkerStore):
    """The service's side of a SQLite store: own it, load it at start, then hand items to
    the writer."""

    def __init__(self, path: str | Path, options: WriterOptions | None = None) -> None:
        self.path = Path(path)
        self.options = options or WriterOptions()
        self._owner = OwnerLock(self.path)
        self._link = WorkerLink("the SQLite writer")
        self._post = self._link.post
        self._base = ""

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path}"

    def load(self, index: FleetIndex) -> LoadResult:
        if self._owner.fd is None:
            self._owner.acquire()
        try:
            db = connect(self.path)
            try:
                return load_database(db, index)
            finally:
                db.close()
        except sqlite3.DatabaseError as exc:
            raise read_failure(self.path, exc) from None

    def start(self) -> None:
        if self._owner.fd is None:
            self._owner.acquire()
        self._base = self._link.open()
        self._link.start(self._command)

    def _command(self, restarted: bool) -> WorkerCommand:
        opts, base, fd = self.options, self._base, self._owner.fd
        assert fd is not None  # the writer inherits the store's lock (see owner.py)
        argv = [
            sys.executable, "-m", "kvindex.store.sqlite", str(self.path), f"{base}/in",
            f"{base}/acks", str(os.getpid()), str(opts.flush_interval),
            str(opts.compact_interval), str(opts.compact_log_rows), str(fd),
        ]  # fmt: skip
        return WorkerCommand(argv, pass_fds=(fd,))

    def close(self, timeout: float = 30.0) -> None:
        super().close(timeout)
        self._owner.release()

    # -- the hot path: one queued message per item ----------------------------------------

    def record(self, item: Item) -> None:
        source = item.source
        if isinstance(item, Delivery):
            if item.payload is None:
                raise StoreError("the Subscriber must keep payloads for a persistent store")
            payload = item.payload
            self._post(AppliedBatch(source[0], source[1], item.seq, payload), len(payload))
        elif isinstance(item, Restarted):
            self._post(RestartMark(source[0], source[1]))
        elif isinstance(item, Lost):
            self._post(LostMark(source[0], source[1], item.first, item.last))

    def remove_instance(self, name: str) -> None:
        self._post(RemoveInstance(name))

    def save_instance(self, spec: InstanceSpec) -> None:
        self._post(SaveInstance(spec.name, spec.render()))

    # -- control: sync, compact, close, health come from WorkerStore -------------------

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "writer_alive": self._link.alive()}

    def shared(self) -> SharedStore | None:
        return None


def load_database(db: Any, index: FleetIndex) -> LoadResult:
    """Snapshot, then log tail, into `index`; returns checkpoints and runtime instances."""
    started = time.monotonic()
    # Loading creates objects by the million and frees none: the cyclic GC's passes over
    # them would cost a good part of the load for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        blocks = _load_snapshot(db, index)
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


def _load_snapshot(db: Any, index: FleetIndex) -> int:
    if schema_version(db) == "1":  # only read-only opens see one (see connect)
        return _load_v1(db, index)
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


def _replay_log(db: Any, target: Target, after: int) -> int:
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
