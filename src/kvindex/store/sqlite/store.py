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

import os
import sqlite3
import sys
from pathlib import Path

from kvindex.index import FleetIndex
from kvindex.store.base import LoadResult, SharedStore
from kvindex.store.link import WorkerCommand, WorkerLink, WorkerStore
from kvindex.store.sqlite.load import load_database
from kvindex.store.sqlite.owner import OwnerLock
from kvindex.store.sqlite.tables import connect, read_failure
from kvindex.store.sqlite.writer import WriterOptions

__all__ = ["SQLiteStore"]


class SQLiteStore(WorkerStore):
    """The service's side of a SQLite store: own it, load it at start, then hand items to
    the writer."""

    def __init__(self, path: str | Path, options: WriterOptions | None = None) -> None:
        self.path = Path(path)
        self.options = options or WriterOptions()
        self._owner = OwnerLock(self.path)
        self._link = WorkerLink("the SQLite writer")
        self._base = ""

    @property
    def url(self) -> str:
        extra = "" if self.options.synchronous == "normal" else "?synchronous=full"
        return f"sqlite:///{self.path}{extra}"

    def load(self, index: FleetIndex) -> LoadResult:
        if self._owner.fd is None:
            self._owner.acquire()
        try:
            db = connect(self.path)
            try:
                return load_database(db, index, self.path)
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
            opts.synchronous,
        ]  # fmt: skip
        return WorkerCommand(argv, pass_fds=(fd,))

    def close(self, timeout: float = 30.0) -> None:
        super().close(timeout)
        self._owner.release()

    # -- control: sync, compact, close, health come from WorkerStore -------------------

    def shared(self) -> SharedStore | None:
        return None
