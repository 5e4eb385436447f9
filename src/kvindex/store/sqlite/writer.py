"""The SQLite store's writer process: `python -m kvindex.store.sqlite ...`.

It takes the service's groups (see kvindex.store.protocol) and:

1. appends every batch, as vLLM sent it, to the `log` table and moves that publisher's
   checkpoint, many batches per transaction, then tells the service up to which group all
   is durable (that is what `sync` waits for, and all the writer does while batches keep
   coming: about 10 us of its CPU per batch);
2. in the time left, applies the logged batches to its mirror of the service's blocks
   (mirror.Mirror) and every few seconds writes the runs that changed into `runs` and drops
   the log rows they cover, in one transaction: the compacted snapshot (snapshot.py).

Groups come again after a restart of the writer (the service resends what it was not
told is durable), so every message is applied idempotently: a batch whose seq the
publisher's checkpoint is already past is skipped, and so is a lost run it is past.

When a commit fails for want of room (a full disk, a file size limit) nothing is lost:
the transaction is rolled back, the writer says why, takes nothing more from the service
(whose link then holds what comes, bounded) and tries again every second; once there is
room it commits and goes on. Any other failure ends the process with one line on stderr,
and the service starts it again.

It never takes SIGINT (a terminal's Ctrl+C is for the service, which stops it), stops
when asked or when its service is gone (an orphan commits what it has and exits at once,
without compacting, so a service started right after can take the store over), and
checks before every commit that it still owns the store (see owner.py).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sqlite3
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from kvindex.store.link import PIPE_GROUPS
from kvindex.store.mirror import Mirror
from kvindex.store.protocol import (
    AppliedBatch,
    AppliedBatches,
    ControlRequest,
    Group,
    LostMark,
    Message,
    RemoveInstance,
    RestartMark,
    SaveInstance,
    StatusReport,
    WorkerReport,
    decode_frames,
    encode_report,
)
from kvindex.store.snapshot import load_runs, plan_changes
from kvindex.store.sqlite.load import apply_entry
from kvindex.store.sqlite.owner import lock_path, still_owner
from kvindex.store.sqlite.tables import (
    KIND_BATCH,
    KIND_REMOVE,
    KIND_RESTART,
    connect,
    read_log,
    read_mirror_runs,
    seq_of,
    snapshot_log_id,
    sql_seq,
    write_snapshot,
)
from kvindex.subscriber.messages import SourceKey

__all__ = ["SQLiteWriter", "WriterOptions", "writer_main"]

log = logging.getLogger("kvindex.store.sqlite")

SLICE_SECONDS = 0.02  # mirror work between two looks at the inbox
QUIET_SECONDS = 0.1  # no message for this long: the writer folds the log
PENDING_PAYLOADS = 20_000  # logged payloads kept in memory until folded (then: read back)
RETRY_SECONDS = 1.0  # a commit that found no room is tried again this often
DRAIN_MESSAGES = 20_000  # messages taken from the inbox per commit, at most
# The WAL is copied into the file (checkpointed) by the writer in the time left, not by
# SQLite after each commit: at most this much logged before one is done meanwhile anyway.
CHECKPOINT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class WriterOptions:
    flush_interval: float = 0.05
    compact_interval: float = 2.0
    compact_log_rows: int = 20_000
    synchronous: str = "normal"  # or "full": see tables.connect


class NotOwner(RuntimeError):
    """The store's lock file is no longer the one this writer's service locked."""


# A logged entry the mirror has not applied yet: log id, instance, rank, kind, payload.
Pending = tuple[int, str, int, int, Any]


def no_room(exc: BaseException) -> bool:
    """Whether a failed write wants room, not a fix: a full disk or a size limit."""
    if isinstance(exc, OSError):
        return exc.errno in (28, 27, 122)  # ENOSPC, EFBIG, EDQUOT
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and (
        "full" in text or "disk i/o" in text or "too big" in text
    )


class SQLiteWriter:
    """Appends to the log first (that is what `sync` waits for), and folds the log into
    the snapshot in the time left: its mirror follows the log a little behind, in slices
    between two commits, and every few seconds what changed in it becomes the new
    snapshot, in one transaction that also drops the log rows it covers."""

    def __init__(
        self,
        path: str,
        options: WriterOptions,
        owner_fd: int | None = None,
        freeze_gc: bool = False,
    ) -> None:
        """`freeze_gc`: the writer's own process (`writer_main`), whose objects the fold may
        freeze; never another's (gc.freeze takes every object of the process, garbage too)."""
        self.freeze_gc = freeze_gc
        self.db = connect(path, synchronous=options.synchronous)
        # SQLite checkpoints the WAL itself every 1,000 pages, in the commit that passes
        # them: every appended byte written twice while `sync` waits. The writer does it in
        # the time left instead (`_checkpoint`), bounded by CHECKPOINT_BYTES; the file
        # stays consistent either way (a WAL not yet checkpointed is read, and recovered
        # after a crash, as part of the database).
        self.db.execute("PRAGMA wal_autocheckpoint=0")
        self.db.execute(f"PRAGMA journal_size_limit={CHECKPOINT_BYTES}")
        self.unchecked = 0  # bytes logged since the last checkpoint (payloads)
        self.options = options
        self.owner_fd = owner_fd
        self.lock_path = lock_path(Path(path))
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
        self.next_seq = {
            SourceKey(i, r): seq_of(n)
            for i, r, n in self.db.execute("SELECT instance, rank, next_seq FROM sources")
        }
        self.last_group = 0  # the last group applied (groups come again after a restart)
        self.refused = 0  # batches skipped as logged already (see WorkerReport.refused)
        self.whole_snapshot = False  # a snapshot failed: the next one rewrites everything
        self.last_compact = self.last_message = time.monotonic()

    # -- the loop ---------------------------------------------------------------------

    def run(self, inbox: Any, acks: Any, parent_pid: int) -> None:
        flush = self.options.flush_interval
        waiting: list[Group] = []  # taken, not committed yet (no room)
        error = ""
        while True:
            # Appends come first; the log is folded only once the inbox has been quiet a
            # moment, or when the backlog passes the compaction threshold (so that under a
            # steady stream the snapshot stays as close behind as it always did).
            backlog = len(self.pending) > self.options.compact_log_rows
            quiet_in = self.last_message + QUIET_SECONDS - time.monotonic()
            wait = 0.0 if backlog else max(quiet_in, 0.0) if self.pending else flush
            if not waiting:
                waiting = _drain(inbox, RETRY_SECONDS if error else wait)
            elif error:
                time.sleep(RETRY_SECONDS)
            orphan = os.getppid() != parent_pid
            if waiting:
                self.last_message = time.monotonic()
                try:
                    done, stop = self.commit(waiting)
                except sqlite3.Error as exc:
                    if not no_room(exc) or orphan:
                        raise
                    self._make_room()
                    if not error:
                        error = f"can't write {self.db_path()}: {exc}; retrying every second"
                        acks.send(encode_report(self._report([], error)))
                    continue
                waiting, error = [], ""
                acks.send(encode_report(self._report(done)))
                if stop:
                    self._compact_at_stop()
                    return
            if orphan:
                while groups := _drain(inbox, 0):  # what its service handed over before it went
                    self.commit(groups)
                return  # the log has it all: no compaction, the next service does that
            if backlog or (not waiting and quiet_in <= 0) or self.unchecked >= CHECKPOINT_BYTES:
                try:
                    if backlog or (not waiting and quiet_in <= 0):
                        self._fold(SLICE_SECONDS)
                    else:
                        self._checkpoint()  # never quiet: the WAL is bounded all the same
                except sqlite3.Error as exc:
                    if not no_room(exc):
                        raise
                    self._make_room()
                    error = f"can't write {self.db_path()}: {exc}; retrying every second"

    def _report(self, done: list[int], error: str = "") -> WorkerReport:
        return WorkerReport(self.last_group, done, error, self.refused)

    def db_path(self) -> str:
        row = self.db.execute("PRAGMA database_list").fetchone()
        return str(row[2]) if row else "the store"

    # -- appending: the hot path -------------------------------------------------------

    def commit(self, groups: list[Group]) -> tuple[list[int], bool]:
        """Append the messages of these groups in one transaction (those of groups already
        applied are skipped); returns the requests answered and whether one was `stop`.
        A failure leaves the file and this writer as they were."""
        if self.owner_fd is not None and not still_owner(self.owner_fd, self.lock_path):
            raise NotOwner(f"{self.lock_path} is not the lock this writer's service took")
        appends = _Appends(self)
        requests: list[ControlRequest] = []
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            for group in groups:
                if group.id and group.id <= self.last_group:
                    continue  # sent again after a restart, and committed before it
                for message in group.messages:
                    if isinstance(message, AppliedBatch):
                        appends.add(message)
                    elif isinstance(message, AppliedBatches):
                        appends.add_many(message)
                    elif isinstance(message, ControlRequest):
                        requests.append(message)
                    else:
                        appends.flush()  # rare messages are written in order with batches
                        self._write(message, appends)
            appends.flush()
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            appends.undo()
            raise
        appends.done()
        self.unchecked += appends.bytes
        if groups:
            self.last_group = max(self.last_group, groups[-1].id)
        for request in requests:
            if request.kind == "compact":
                self.compact()
        return [r.token for r in requests if r.token], any(r.kind == "stop" for r in requests)

    def _log(self, appends: _Appends, instance: str, rank: int, kind: int) -> None:
        appends.log_id += 1
        self.db.execute(
            "INSERT INTO log VALUES (?,?,?,?,NULL,NULL)", (appends.log_id, instance, rank, kind)
        )
        appends.pending.append((appends.log_id, instance, rank, kind, None))

    def _write(self, message: Message, appends: _Appends) -> None:
        db = self.db
        if isinstance(message, RestartMark):
            source = SourceKey(message.instance, message.rank)
            self._log(appends, message.instance, message.rank, KIND_RESTART)
            db.execute(
                "INSERT INTO sources VALUES (?,?,0,NULL,0,1) ON CONFLICT (instance, rank) DO "
                "UPDATE SET next_seq = 0, last_digest = NULL, lost_since_restart = 0,"
                " restarts = restarts + 1",
                tuple(source),
            )
            appends.next_seq[source] = 0
        elif isinstance(message, LostMark):
            source = SourceKey(message.instance, message.rank)
            if message.last < appends.seq_of(source):
                return  # applied before a restart of this writer
            # The checkpoint moves past the lost seqs, with no digest to check on resume.
            # The count is added here, not in SQL: like a seq it may pass 2**63 (a publisher
            # first seen at a seq that large lost every one before it).
            had = db.execute(
                "SELECT lost_since_restart FROM sources WHERE instance = ? AND rank = ?",
                tuple(source),
            ).fetchone()
            lost = (seq_of(had[0]) if had else 0) + message.last - message.first + 1
            db.execute(
                "INSERT INTO sources VALUES (?,?,?,NULL,?,0) ON CONFLICT (instance, rank) DO "
                "UPDATE SET next_seq = excluded.next_seq, last_digest = NULL,"
                " lost_since_restart = excluded.lost_since_restart",
                (*source, sql_seq(message.last + 1), sql_seq(lost)),
            )
            appends.next_seq[source] = message.last + 1
        elif isinstance(message, RemoveInstance):
            self._log(appends, message.name, 0, KIND_REMOVE)
            db.execute("DELETE FROM sources WHERE instance = ?", (message.name,))
            db.execute("DELETE FROM instances WHERE name = ?", (message.name,))
            # Its publishers start over (as their rows in `sources` do): an instance added
            # again logs its batches from seq 0 (a late join's replay), not from where the
            # removed one stood (they were dropped as written: gone at the next start).
            known = {*self.next_seq, *appends.next_seq}
            for source in [s for s in known if s.instance == message.name]:
                appends.next_seq[source] = 0
        elif isinstance(message, SaveInstance):
            db.execute(
                "INSERT OR REPLACE INTO instances VALUES (?,?)", (message.name, message.spec)
            )
        elif isinstance(message, StatusReport):
            pass  # for replicas sharing a store; a SQLite store has one service

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
                apply_entry(mirror, (instance, rank, kind), payload)
                self.applied_id = log_id
            # The mirror holds no reference cycles: what it keeps need never be scanned
            # by the cyclic GC again (a fifth of the fold's time otherwise).
            if self.freeze_gc:
                gc.freeze()
        if self._snapshot_due():
            self._write_snapshot()
        elif not pending and self.unchecked:
            self._checkpoint()  # all folded: the WAL into the file, in the time left

    def _checkpoint(self) -> None:
        """Copy the WAL into the database file as far as readers let it (PASSIVE: never
        waits for them; what a reader still uses is copied next time)."""
        self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        self.unchecked = 0

    def _make_room(self) -> None:
        """A write found no room. The WAL never shrinks by itself: it still holds the
        failed transaction's pages and everything committed since the last checkpoint
        (up to CHECKPOINT_BYTES: SQLite's auto-checkpoint is off). Copy what is committed
        into the file and truncate the WAL, so that the next try has that room back."""
        try:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:
            if not no_room(exc):
                raise
            return  # the copy itself found no room: the next try makes room again
        self.unchecked = 0

    def _compact_at_stop(self) -> None:
        """The snapshot a stop writes is a saving, not a duty: everything is committed
        to the log already, and the next start folds what is left. With no room for it
        (a full disk), the WAL is truncated and it is tried once more; if that fails too,
        the writer still stops cleanly (exit 0: its service must not start it again)."""
        for last_try in (False, True):
            try:
                self.compact()
                return
            except sqlite3.Error as exc:
                if not no_room(exc):
                    raise
                self._make_room()
                if last_try:
                    log.warning(
                        "no room for the snapshot at stop (%s): the log holds everything; "
                        "the next start folds it",
                        exc,
                    )

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
        """What changed in the mirror into `runs`, and drop the log rows it covers. If that
        fails (no room), the changes taken from the mirror are gone: the next snapshot is
        then written whole (the log still holds everything since the last one)."""
        changes = self.mirror.take()
        whole = self.whole_snapshot
        if whole:
            changes.dirty = {k: set(s.runs.values()) for k, s in self.mirror.sources.items()}
        plans = plan_changes(self.mirror, changes, view=True)
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            if whole:
                db.execute("DELETE FROM runs")
            write_snapshot(db, changes.removed, changes.cleared, plans)
            db.execute(
                "UPDATE meta SET value = ? WHERE key = 'snapshot_log_id'", (str(self.applied_id),)
            )
            db.execute("DELETE FROM log WHERE id <= ?", (self.applied_id,))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            self.whole_snapshot = True
            raise
        self.whole_snapshot = False
        for plan in plans.values():
            plan.done()
        self.snapshot_id = self.applied_id
        self.last_compact = time.monotonic()
        self._checkpoint()

    def close(self) -> None:
        self.db.close()


@dataclass
class _Appends:
    """What one commit adds, applied to the writer only once it is committed: the log
    rows of its batches (written with one executemany per run of them), each publisher's
    checkpoint moved once to where its last batch leaves it, and the seqs the next
    messages are checked against."""

    writer: SQLiteWriter
    log_id: int = 0
    rows: list[tuple[int, str, int, int, int | bytes, bytes]] = field(default_factory=list)
    checkpoints: dict[SourceKey, tuple[int, int]] = field(default_factory=dict)
    next_seq: dict[SourceKey, int] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    refused: int = 0
    bytes: int = 0  # payload bytes logged

    def __post_init__(self) -> None:
        self.log_id = self.writer.last_log_id

    def seq_of(self, source: SourceKey) -> int:
        found = self.next_seq.get(source)
        return self.writer.next_seq.get(source, 0) if found is None else found

    def add(self, message: AppliedBatch) -> None:
        source = SourceKey(message.instance, message.rank)
        seq, payload = message.seq, message.payload
        if seq < self.seq_of(source):
            self.refused += 1
            return  # applied before a restart of this writer
        self.log_id += 1
        self.rows.append(
            (self.log_id, source.instance, source.rank, KIND_BATCH, sql_seq(seq), payload)
        )
        self.checkpoints[source] = (seq + 1, zlib.crc32(payload))
        self.next_seq[source] = seq + 1
        self.bytes += len(payload)
        self.pending.append((self.log_id, source.instance, source.rank, KIND_BATCH, payload))

    def add_many(self, message: AppliedBatches) -> None:
        """`add` for each of its batches, in bulk: only the last one's digest is kept."""
        source = SourceKey(message.instance, message.rank)
        first, payloads = message.first_seq, message.payloads
        if not payloads:
            return
        skip = self.seq_of(source) - first
        if skip > 0:  # applied before a restart of this writer
            self.refused += min(skip, len(payloads))
            if skip >= len(payloads):
                return
            first, payloads = first + skip, payloads[skip:]
        instance, rank, log_id = source.instance, source.rank, self.log_id
        self.rows.extend(
            (log_id + i, instance, rank, KIND_BATCH, sql_seq(first + i - 1), payload)
            for i, payload in enumerate(payloads, 1)
        )
        self.pending.extend(
            (log_id + i, instance, rank, KIND_BATCH, payload)
            for i, payload in enumerate(payloads, 1)
        )
        self.log_id = log_id + len(payloads)
        self.bytes += sum(map(len, payloads))
        last = first + len(payloads) - 1
        self.checkpoints[source] = (last + 1, zlib.crc32(payloads[-1]))
        self.next_seq[source] = last + 1

    def flush(self) -> None:
        if not self.rows:
            return
        db = self.writer.db
        db.executemany("INSERT INTO log VALUES (?,?,?,?,?,?)", self.rows)
        db.executemany(
            "INSERT INTO sources (instance, rank, next_seq, last_digest) VALUES (?,?,?,?) "
            "ON CONFLICT (instance, rank) DO UPDATE SET next_seq = excluded.next_seq,"
            " last_digest = excluded.last_digest",
            [(i, r, sql_seq(n), d) for (i, r), (n, d) in self.checkpoints.items()],
        )
        self.rows, self.checkpoints = [], {}

    def done(self) -> None:
        writer = self.writer
        writer.last_log_id = self.log_id
        writer.next_seq.update(self.next_seq)
        writer.refused += self.refused
        for log_id, instance, rank, kind, payload in self.pending:
            writer.pending.append((log_id, instance, rank, kind, writer._kept(payload)))

    def undo(self) -> None:
        self.rows, self.checkpoints, self.next_seq, self.pending = [], {}, {}, []
        self.refused = self.bytes = 0


def _drain(inbox: zmq.Socket[bytes], wait: float) -> list[Group]:
    """The groups queued now (bounded), waiting up to `wait` for the first one."""
    groups: list[Group] = []
    if not inbox.poll(int(wait * 1000)):
        return groups
    count = 0
    while count < DRAIN_MESSAGES:
        try:
            frames = inbox.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
        group = decode_frames([frame.buffer for frame in frames])
        groups.append(group)
        count += len(group.messages)
    return groups


def writer_main(argv: list[str]) -> None:
    """`python -m kvindex.store.sqlite PATH INBOX ACKS PARENT_PID FLUSH COMPACT ROWS
    [OWNER_FD [SYNCHRONOUS]]`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops it (see the module)
    logging.basicConfig(level=logging.WARNING, format="kvindex store: %(levelname)s %(message)s")
    path, inbox_ep, acks_ep, parent = argv[0], argv[1], argv[2], int(argv[3])
    synchronous = argv[8] if len(argv) > 8 else "normal"
    options = WriterOptions(float(argv[4]), float(argv[5]), int(argv[6]), synchronous)
    owner_fd = int(argv[7]) if len(argv) > 7 else None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, PIPE_GROUPS)  # the service's link keeps the rest, bounded
    inbox.connect(inbox_ep)
    acks = ctx.socket(zmq.PUSH)
    acks.setsockopt(zmq.LINGER, 1000)
    acks.connect(acks_ep)
    acks.send(encode_report(WorkerReport(0)))  # here: the service may hand groups over
    code = 0
    try:
        writer = SQLiteWriter(path, options, owner_fd, freeze_gc=True)
        gc.freeze()  # what the start loaded lives as long as the process: never scan it
        try:
            writer.run(inbox, acks, parent)
        finally:
            writer.close()
    except Exception as exc:  # one line for the operator; the service restarts it
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        acks.send(encode_report(WorkerReport(0, [], f"{type(exc).__name__}: {reason}")))
        log.error("the SQLite writer failed: %s: %s", type(exc).__name__, reason)
        code = 1
    finally:
        inbox.close(linger=0)
        acks.close()
    sys.exit(code)
