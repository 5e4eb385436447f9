"""`--store sqlite:///PATH`: the embedded, durable default.

The service never waits on SQLite. It hands each applied item to a writer *process*
(through a multiprocessing queue, so the other core does the work and no lookup waits on
the GIL), which:

1. appends every batch, as vLLM sent it, to the `log` table and moves that publisher's
   checkpoint, in one transaction per ~50 ms of traffic (group commit);
2. applies the same batches to its own index (a mirror of the service's), and every few
   seconds writes what changed into the `blocks` table and drops the log rows it covers,
   in one transaction: the compacted snapshot.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvindex.index import FleetIndex
from kvindex.store.base import LoadResult
from kvindex.store.rows import BlockRow, hash_key
from kvindex.store.sqlite_db import (
    KIND_BATCH,
    KIND_REMOVE,
    KIND_RESTART,
    UPSERT_BLOCK,
    StoreError,
    block_row_values,
    connect,
    read_blocks,
    read_checkpoints,
    read_instances,
    read_log,
    snapshot_log_id,
)
from kvindex.store.state import DirtyKey, Mirror, fold, resolve, restore_rows, row_key
from kvindex.store.worker import WorkerLink, WorkerStore
from kvindex.subscriber.messages import Delivery, Item, Lost, Restarted, SourceKey
from kvindex.subscriber.spec import InstanceSpec

__all__ = ["SQLiteStore", "load_database"]


@dataclass(frozen=True, slots=True)
class WriterOptions:
    flush_interval: float = 0.05
    compact_interval: float = 2.0
    compact_log_rows: int = 20_000


class SQLiteStore(WorkerStore):
    """The service's side of a SQLite store: load at start, then hand items to the writer.

    The writer is a child process (`python -m kvindex.store.sqlite`) fed over a ZMQ PUSH
    socket on an ipc path: sends never block the event loop (ZMQ queues them in its own
    thread) and payloads are handed over without re-encoding.
    """

    def __init__(self, path: str | Path, options: WriterOptions | None = None) -> None:
        self.path = Path(path)
        self.options = options or WriterOptions()
        self._link = WorkerLink("the SQLite writer")
        self._encode = self._link.encode
        self._send = self._link.send

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

    # -- the hot path: one non-blocking send per item ----------------------------------

    def record(self, item: Item) -> None:
        source = item.source
        if isinstance(item, Delivery):
            if item.payload is None:
                raise StoreError("the Subscriber must keep payloads for a persistent store")
            header = self._encode(("b", source.instance, source.rank, item.seq))
            self._send([header, item.payload])
        elif isinstance(item, Restarted):
            self._send([self._encode(("r", source.instance, source.rank))])
        elif isinstance(item, Lost):
            self._send([self._encode(("l", source.instance, source.rank, item.count))])

    def remove_instance(self, name: str) -> None:
        self._send([self._encode(("x", name))])

    def save_instance(self, spec: InstanceSpec) -> None:
        self._send([self._encode(("i", spec.name, spec.render()))])

    # -- control: sync, compact, close come from WorkerStore ----------------------------

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "writer_alive": self._alive()}


def load_database(db: Any, index: FleetIndex) -> LoadResult:
    """Snapshot, then log tail, into `index`; returns checkpoints and runtime instances."""
    started = time.monotonic()
    mirror = Mirror(index)
    # Loading creates objects by the million and frees none: the cyclic GC's passes over
    # them would cost ~40% of the load for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        rows = restore_rows(index, read_blocks(db))
        replayed = _replay_log(db, mirror, snapshot_log_id(db))
    finally:
        if was_enabled:
            gc.enable()
    return LoadResult(
        checkpoints=read_checkpoints(db),
        instances=read_instances(db),
        blocks_restored=rows,
        log_batches_replayed=replayed,
        seconds=time.monotonic() - started,
    )


def _replay_log(db: Any, mirror: Mirror, after: int) -> int:
    count = 0
    for _id, instance, rank, kind, _seq, payload in read_log(db, after):
        source = SourceKey(instance, rank)
        if kind == KIND_BATCH:
            mirror.apply_payload(source, payload)
            count += 1
        elif kind == KIND_RESTART:
            mirror.restart(source)
        elif kind == KIND_REMOVE:
            mirror.remove_instance(instance)
    return count


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
    try:
        writer.run(inbox, acks, parent)
    finally:
        writer.close()
        inbox.close(linger=0)
        acks.close()


class _Writer:
    def __init__(self, path: str, options: WriterOptions) -> None:
        self.db = connect(path)
        self.options = options
        # The mirror starts as the service does: snapshot, then the log tail. The tail's
        # changes are noted, so the first compaction folds them into the snapshot.
        self.mirror = Mirror()
        restore_rows(self.mirror.index, read_blocks(self.db))
        self.pending_log_rows = _replay_log(self.db, self.mirror, snapshot_log_id(self.db))
        row = self.db.execute("SELECT max(id) FROM log").fetchone()
        self.last_log_id = int(row[0] or snapshot_log_id(self.db))
        self.last_compact = time.monotonic()

    def run(self, inbox: Any, acks: Any, parent_pid: int) -> None:
        if self.mirror.changes:
            self.compact()
        while True:
            messages = _drain(inbox, self.options.flush_interval)
            stop = self._commit(messages, acks)
            if stop or os.getppid() != parent_pid:
                self.compact()
                return
            if self._compaction_due():
                self.compact()

    def _compaction_due(self) -> bool:
        opts = self.options
        if not self.mirror.changes:
            return False
        return (
            self.pending_log_rows >= opts.compact_log_rows
            or time.monotonic() - self.last_compact >= opts.compact_interval
        )

    def _commit(self, messages: list[tuple[Any, ...]], acks: Any) -> bool:
        """Write a group of messages in one transaction; apply them to the mirror."""
        stop = False
        answers: list[tuple[str, int]] = []
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            for message in messages:
                kind = message[0]
                if kind in ("sync", "compact", "stop"):
                    answers.append((kind, message[1]))
                    stop |= kind == "stop"
                else:
                    self._write(message)
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

    def _write(self, message: tuple[Any, ...]) -> None:
        db, kind = self.db, message[0]
        if kind == "b":
            _, instance, rank, seq, payload = message
            self.last_log_id += 1
            db.execute(
                "INSERT INTO log VALUES (?,?,?,?,?,?)",
                (self.last_log_id, instance, rank, KIND_BATCH, seq, payload),
            )
            db.execute(
                "INSERT INTO sources (instance, rank, next_seq, last_digest) VALUES (?,?,?,?) "
                "ON CONFLICT (instance, rank) DO UPDATE SET next_seq = excluded.next_seq,"
                " last_digest = excluded.last_digest",
                (instance, rank, seq + 1, zlib.crc32(payload)),
            )
            self.pending_log_rows += 1
            self.mirror.apply_payload(SourceKey(instance, rank), payload)
        elif kind == "r":
            _, instance, rank = message
            self.last_log_id += 1
            db.execute(
                "INSERT INTO log VALUES (?,?,?,?,NULL,NULL)",
                (self.last_log_id, instance, rank, KIND_RESTART),
            )
            db.execute(
                "INSERT INTO sources VALUES (?,?,0,NULL,0,1) ON CONFLICT (instance, rank) DO "
                "UPDATE SET next_seq = 0, last_digest = NULL, lost_since_restart = 0,"
                " restarts = restarts + 1",
                (instance, rank),
            )
            self.mirror.restart(SourceKey(instance, rank))
        elif kind == "l":
            _, instance, rank, count = message
            db.execute(
                "UPDATE sources SET lost_since_restart = lost_since_restart + ?"
                " WHERE instance = ? AND rank = ?",
                (count, instance, rank),
            )
        elif kind == "x":
            _, name = message
            self.last_log_id += 1
            db.execute(
                "INSERT INTO log VALUES (?,?,0,?,NULL,NULL)", (self.last_log_id, name, KIND_REMOVE)
            )
            db.execute("DELETE FROM sources WHERE instance = ?", (name,))
            db.execute("DELETE FROM instances WHERE name = ?", (name,))
            self.mirror.remove_instance(name)
        elif kind == "i":
            _, name, spec = message
            db.execute("INSERT OR REPLACE INTO instances VALUES (?,?)", (name, spec))

    def compact(self) -> None:
        """Write the mirror's changes into `blocks` and drop the log rows they cover."""
        changes = self.mirror.take_changes()
        db, index = self.db, self.mirror.index
        db.execute("BEGIN IMMEDIATE")
        try:
            for name in changes.removed:
                db.execute("DELETE FROM blocks WHERE instance = ?", (name,))
            for source in changes.cleared:
                db.execute(
                    "DELETE FROM blocks WHERE instance = ? AND rank = ?",
                    (source.instance, source.rank),
                )
            resolved = resolve(changes, index)
            db.executemany(
                "DELETE FROM blocks WHERE instance=? AND rank=? AND grp=? AND medium=? AND hkey=?",
                [_sql_key(key) for key in resolved.deletes],
            )
            db.executemany(UPSERT_BLOCK, [block_row_values(row) for row in resolved.upserts])
            db.executemany(
                "UPDATE blocks SET copies=? WHERE instance=? AND rank=? AND grp=? AND medium=?"
                " AND hkey=?",
                [(copies, *_sql_key(key)) for key, copies in resolved.updates],
            )
            db.execute(
                "UPDATE meta SET value = ? WHERE key = 'snapshot_log_id'", (str(self.last_log_id),)
            )
            db.execute("DELETE FROM log WHERE id <= ?", (self.last_log_id,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.pending_log_rows = 0
        self.last_compact = time.monotonic()

    def close(self) -> None:
        self.db.close()


def _sql_key(key: DirtyKey) -> tuple[object, ...]:
    source, group, medium, h = key
    return (source.instance, source.rank, group, medium, hash_key(h))


def current_rows(path: str | Path) -> tuple[list[BlockRow], LoadResult]:
    """The store's blocks as of its last committed batch (snapshot + log tail), read-only
    with respect to the blocks table: what `kvindex export` prints while serve runs."""
    db = connect(path, create=False)
    try:
        rows = {row_key(row): row for row in read_blocks(db)}
        mirror = Mirror()
        restore_rows(mirror.index, rows.values())
        replayed = _replay_log(db, mirror, snapshot_log_id(db))
        fold(rows, mirror.take_changes(), mirror.index)
        result = LoadResult(
            checkpoints=read_checkpoints(db),
            instances=read_instances(db),
            blocks_restored=len(rows),
            log_batches_replayed=replayed,
        )
        return list(rows.values()), result
    finally:
        db.close()


_decode_header = msgspec.msgpack.Decoder()


def _drain(inbox: zmq.Socket[bytes], wait: float) -> list[tuple[Any, ...]]:
    """Everything queued now (bounded), waiting up to `wait` for the first message."""
    messages: list[tuple[Any, ...]] = []
    if not inbox.poll(int(wait * 1000)):
        return messages
    while len(messages) < 20_000:
        try:
            frames = inbox.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        header = tuple(_decode_header.decode(frames[0]))
        messages.append((*header, frames[1]) if len(frames) > 1 else header)
    return messages


if __name__ == "__main__":
    writer_main(sys.argv[1:])
