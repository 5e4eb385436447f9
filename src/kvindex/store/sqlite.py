"""`--store sqlite:///PATH`: the embedded, durable default.

The service never waits on SQLite. It hands each applied item to a writer *process*
(over a local ZMQ socket, in groups: see WorkerLink), so the other core does the work and
no lookup waits on the GIL. The writer:

1. appends every batch, as vLLM sent it, to the `log` table and moves that publisher's
   checkpoint, many batches per transaction. That is all `sync` waits for, and all the
   writer does while batches keep coming (about 10 us of its CPU per batch);
2. in the time left, applies the logged batches to its mirror of the service's blocks
   (state.Mirror) and every few seconds writes the runs that changed into `runs` and drops
   the log rows they cover, in one transaction: the compacted snapshot (snapshot.py).

A stop at any point, even `kill -9` mid-batch, leaves a consistent file: snapshot + log
tail + checkpoints. The next start replays both into the index, and the Subscriber asks
each publisher for exactly the batches after its checkpoint (and checks, by the last
batch's checksum, that it is still the same engine).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvindex.index import FleetIndex
from kvindex.store.base import LoadResult
from kvindex.store.rows import BlockRow, events_from_rows
from kvindex.store.snapshot import (
    IndexTarget,
    Stored,
    Target,
    load_runs,
    mirror_rows,
    plan_changes,
    replay,
)
from kvindex.store.sqlite_db import (
    KIND_BATCH,
    KIND_REMOVE,
    KIND_RESTART,
    StoreError,
    connect,
    read_blocks_v1,
    read_checkpoints,
    read_instances,
    read_log,
    read_mirror_runs,
    read_runs,
    schema_version,
    snapshot_log_id,
    write_snapshot,
)
from kvindex.store.state import Mirror
from kvindex.store.worker import WorkerLink, WorkerStore, decode_group
from kvindex.subscriber.messages import Delivery, Item, Lost, Restarted, SourceKey
from kvindex.subscriber.spec import InstanceSpec

__all__ = ["SQLiteStore", "current_rows", "load_database"]

SLICE_SECONDS = 0.02  # mirror work between two looks at the inbox
QUIET_SECONDS = 0.1  # no message for this long: the writer folds the log
PENDING_PAYLOADS = 20_000  # logged payloads kept in memory until folded (then: read back)


@dataclass(frozen=True, slots=True)
class WriterOptions:
    flush_interval: float = 0.05
    compact_interval: float = 2.0
    compact_log_rows: int = 20_000


class SQLiteStore(WorkerStore):
    """The service's side of a SQLite store: load at start, then hand items to the writer.

    The writer is a child process (`python -m kvindex.store.sqlite`) fed over a ZMQ PUSH
    socket on an ipc path, in groups (see WorkerLink): sends never block the event loop.
    """

    def __init__(self, path: str | Path, options: WriterOptions | None = None) -> None:
        self.path = Path(path)
        self.options = options or WriterOptions()
        self._link = WorkerLink("the SQLite writer")
        self._post = self._link.post

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path}"

    def load(self, index: FleetIndex) -> LoadResult:
        db = connect(self.path)
        try:
            return load_database(db, index)
        finally:
            db.close()

    def start(self) -> None:
        base = self._link.open()
        opts = self.options
        self._link.spawn(
            [sys.executable, "-m", "kvindex.store.sqlite", str(self.path), f"{base}/in",
             f"{base}/acks", str(os.getpid()), str(opts.flush_interval),
             str(opts.compact_interval), str(opts.compact_log_rows)]
        )  # fmt: skip

    # -- the hot path: one queued message per item ----------------------------------------

    def record(self, item: Item) -> None:
        source = item.source
        if isinstance(item, Delivery):
            if item.payload is None:
                raise StoreError("the Subscriber must keep payloads for a persistent store")
            payload = item.payload
            self._post(("b", source[0], source[1], item.seq, payload), len(payload))
        elif isinstance(item, Restarted):
            self._post(("r", source[0], source[1]))
        elif isinstance(item, Lost):
            self._post(("l", source[0], source[1], item.count))

    def remove_instance(self, name: str) -> None:
        self._post(("x", name))

    def save_instance(self, spec: InstanceSpec) -> None:
        self._post(("i", spec.name, spec.render()))

    # -- control: sync, compact, close come from WorkerStore ----------------------------

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "writer_alive": self._alive()}


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
        count += _apply_entry(target, entry[1:4], entry[5])
    return count


def _apply_entry(target: Target, head: tuple[str, int, int], payload: Any) -> int:
    """Apply one log entry (instance, rank, kind); 1 if it was a batch."""
    instance, rank, kind = head
    if kind == KIND_BATCH:
        target.apply_payload(SourceKey(instance, rank), payload)
        return 1
    if kind == KIND_RESTART:
        target.restart(SourceKey(instance, rank))
    elif kind == KIND_REMOVE:
        target.remove_instance(instance)
    return 0


# -- the writer process ----------------------------------------------------------------


def writer_main(argv: list[str]) -> None:
    """`python -m kvindex.store.sqlite PATH INBOX ACKS PARENT_PID FLUSH COMPACT ROWS`."""
    path, inbox_ep, acks_ep, parent = argv[0], argv[1], argv[2], int(argv[3])
    options = WriterOptions(float(argv[4]), float(argv[5]), int(argv[6]))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(inbox_ep)
    acks = ctx.socket(zmq.PUSH)
    acks.setsockopt(zmq.LINGER, 1000)
    acks.connect(acks_ep)
    writer = _Writer(path, options)
    gc.freeze()  # what the start loaded lives as long as the process: never scan it again
    try:
        writer.run(inbox, acks, parent)
    finally:
        writer.close()
        inbox.close(linger=0)
        acks.close()


# A logged entry the mirror has not applied yet: log id, instance, rank, kind, payload.
Pending = tuple[int, str, int, int, Any]


class _Writer:
    """Appends to the log first (that is what `sync` waits for), and folds the log into
    the snapshot in the time left: its mirror follows the log a little behind, in slices
    between two commits, and every few seconds what changed in it becomes the new
    snapshot, in one transaction that also drops the log rows it covers."""

    def __init__(self, path: str, options: WriterOptions) -> None:
        self.db = connect(path)
        self.options = options
        self.mirror = Mirror()
        for instance, rank, record in read_mirror_runs(self.db):
            load_runs(self.mirror, SourceKey(instance, rank), [record])
        self.mirror.take()  # the snapshot holds all that
        self.snapshot_id = snapshot_log_id(self.db)
        self.pending: deque[Pending] = deque()
        for i, inst, rank, kind, _seq, payload in read_log(self.db, self.snapshot_id):
            self.pending.append((i, inst, rank, kind, self._kept(payload)))
        self.applied_id = self.snapshot_id  # the log row the mirror is current as of
        self.last_log_id = self.pending[-1][0] if self.pending else self.snapshot_id
        self.last_compact = self.last_message = time.monotonic()

    def run(self, inbox: Any, acks: Any, parent_pid: int) -> None:
        flush = self.options.flush_interval
        while True:
            # Appends come first; the log is folded only once the inbox has been quiet a
            # moment, or when the backlog passes the compaction threshold (so that under a
            # steady stream the snapshot stays as close behind as it always did).
            backlog = len(self.pending) > self.options.compact_log_rows
            quiet_in = self.last_message + QUIET_SECONDS - time.monotonic()
            wait = 0.0 if backlog else max(quiet_in, 0.0) if self.pending else flush
            messages = _drain(inbox, wait)
            stop = False
            if messages:
                self.last_message = time.monotonic()
                stop = self._commit(messages, acks)
            if stop or os.getppid() != parent_pid:
                self.compact()
                return
            if backlog or (not messages and quiet_in <= 0):
                self._fold(SLICE_SECONDS)

    # -- appending: the hot path -------------------------------------------------------

    def _commit(self, messages: list[tuple[Any, ...]], acks: Any) -> bool:
        """Append a group of messages in one transaction, then answer the requests."""
        stop = False
        answers: list[tuple[str, int]] = []
        batch = _Appends(self)
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            for message in messages:
                kind = message[0]
                if kind == "b":
                    batch.add(message)
                elif kind in ("sync", "compact", "stop"):
                    answers.append((kind, message[1]))
                    stop |= kind == "stop"
                else:
                    batch.flush()  # the rare messages are written in order with the batches
                    self._write(message)
            batch.flush()
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        for kind, token in answers:
            if kind == "compact":
                self.compact()
            if token:
                acks.send(str(token).encode())
        return stop

    def _log(self, instance: str, rank: int, kind: int, payload: bytes | None = None) -> None:
        self.last_log_id += 1
        self.db.execute(
            "INSERT INTO log VALUES (?,?,?,?,NULL,NULL)",
            (self.last_log_id, instance, rank, kind),
        )
        self.pending.append((self.last_log_id, instance, rank, kind, self._kept(payload)))

    def _write(self, message: tuple[Any, ...]) -> None:
        db, kind = self.db, message[0]
        if kind == "r":
            _, instance, rank = message
            self._log(instance, rank, KIND_RESTART)
            db.execute(
                "INSERT INTO sources VALUES (?,?,0,NULL,0,1) ON CONFLICT (instance, rank) DO "
                "UPDATE SET next_seq = 0, last_digest = NULL, lost_since_restart = 0,"
                " restarts = restarts + 1",
                (instance, rank),
            )
        elif kind == "l":
            _, instance, rank, count = message
            db.execute(
                "UPDATE sources SET lost_since_restart = lost_since_restart + ?"
                " WHERE instance = ? AND rank = ?",
                (count, instance, rank),
            )
        elif kind == "x":
            _, name = message
            self._log(name, 0, KIND_REMOVE)
            db.execute("DELETE FROM sources WHERE instance = ?", (name,))
            db.execute("DELETE FROM instances WHERE name = ?", (name,))
        elif kind == "i":
            _, name, spec = message
            db.execute("INSERT OR REPLACE INTO instances VALUES (?,?)", (name, spec))

    # -- folding the log into the snapshot ----------------------------------------------

    def _fold(self, budget: float) -> None:
        """Apply logged entries to the mirror for up to `budget` seconds; write a snapshot
        when one is due."""
        deadline = time.monotonic() + budget
        pending, mirror = self.pending, self.mirror
        while pending and time.monotonic() < deadline:
            entries = [pending.popleft() for _ in range(min(64, len(pending)))]
            in_log = self._payloads(entries)
            for log_id, instance, rank, kind, payload in entries:
                if payload is None and kind == KIND_BATCH:
                    payload = in_log[log_id]
                _apply_entry(mirror, (instance, rank, kind), payload)
                self.applied_id = log_id
            # The mirror holds no reference cycles: what it keeps need never be scanned
            # by the cyclic GC again (a fifth of the fold's time otherwise).
            gc.freeze()
        if self._snapshot_due():
            self._write_snapshot()

    def _kept(self, payload: bytes | None) -> bytes | None:
        """A payload to keep in memory until it is folded: not past PENDING_PAYLOADS of
        them (the log holds them all), so a backlog costs the writer no more memory."""
        return payload if len(self.pending) < PENDING_PAYLOADS else None

    def _payloads(self, entries: list[Pending]) -> dict[int, bytes]:
        """Payloads of these entries that were not kept in memory, from the log."""
        if all(e[4] is not None or e[3] != KIND_BATCH for e in entries):
            return {}
        rows = self.db.execute(
            "SELECT id, payload FROM log WHERE id BETWEEN ? AND ?", (entries[0][0], entries[-1][0])
        )
        return dict(rows)

    def _snapshot_due(self) -> bool:
        opts = self.options
        folded = self.applied_id - self.snapshot_id
        if not folded:
            return False
        return (
            folded >= opts.compact_log_rows
            or time.monotonic() - self.last_compact >= opts.compact_interval
        )

    def compact(self) -> None:
        """Fold the whole log into the snapshot now."""
        self._fold(float("inf"))
        self._write_snapshot()

    def _write_snapshot(self) -> None:
        """What changed in the mirror into `runs`, and drop the log rows it covers."""
        changes = self.mirror.take()
        plans = plan_changes(self.mirror, changes, view=True)
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            write_snapshot(db, changes.removed, changes.cleared, plans)
            db.execute(
                "UPDATE meta SET value = ? WHERE key = 'snapshot_log_id'", (str(self.applied_id),)
            )
            db.execute("DELETE FROM log WHERE id <= ?", (self.applied_id,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        for plan in plans.values():
            plan.done()
        self.snapshot_id = self.applied_id
        self.last_compact = time.monotonic()

    def close(self) -> None:
        self.db.close()


class _Appends:
    """Batches of one commit, written with one executemany; each publisher's checkpoint
    is moved once, to where its last batch leaves it."""

    def __init__(self, writer: _Writer) -> None:
        self.writer = writer
        self.rows: list[tuple[int, str, int, int, int, bytes]] = []
        self.checkpoints: dict[tuple[str, int], tuple[int, int]] = {}

    def add(self, message: tuple[Any, ...]) -> None:
        _, instance, rank, seq, payload = message
        writer = self.writer
        writer.last_log_id += 1
        self.rows.append((writer.last_log_id, instance, rank, KIND_BATCH, seq, payload))
        self.checkpoints[(instance, rank)] = (seq + 1, zlib.crc32(payload))
        writer.pending.append(
            (writer.last_log_id, instance, rank, KIND_BATCH, writer._kept(payload))
        )

    def flush(self) -> None:
        if not self.rows:
            return
        db = self.writer.db
        db.executemany("INSERT INTO log VALUES (?,?,?,?,?,?)", self.rows)
        db.executemany(
            "INSERT INTO sources (instance, rank, next_seq, last_digest) VALUES (?,?,?,?) "
            "ON CONFLICT (instance, rank) DO UPDATE SET next_seq = excluded.next_seq,"
            " last_digest = excluded.last_digest",
            [(i, r, n, d) for (i, r), (n, d) in self.checkpoints.items()],
        )
        self.rows, self.checkpoints = [], {}


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
    finally:
        db.close()


def _drain(inbox: zmq.Socket[bytes], wait: float) -> list[tuple[Any, ...]]:
    """Everything queued now (bounded), waiting up to `wait` for the first message."""
    messages: list[tuple[Any, ...]] = []
    if not inbox.poll(int(wait * 1000)):
        return messages
    while len(messages) < 20_000:
        try:
            frame = inbox.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        messages.extend(decode_group(frame))
    return messages


if __name__ == "__main__":
    writer_main(sys.argv[1:])
