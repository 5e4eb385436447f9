"""One owner per SQLite store: a lock beside the file (`PATH.owner`), held while a service
and its writer use it.

The service takes it before it reads or migrates anything, and its writer process
inherits it (the same open file, so the lock lasts while either lives: a writer left
behind by a `kill -9` of its service still holds it until it has finished and gone). A
second service finds it taken and stops with one line naming the owner's pid and host;
one started right after a `kill -9` waits the moment the orphaned writer needs to finish
(it sees its service gone within 0.1 s, commits what it has and exits), so it never
writes beside it. The file's content (pid, host, start time) is only for those messages:
the lock is the kernel's `flock`, freed with the last process holding it.

Within one process the lock is shared (a script or a test may open a store twice): only
other processes are kept out.

The writer checks before every commit that the lock file is still the one it locked (a
file deleted by hand and made anew by another service would give the store two owners).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from kvindex.store.base import StoreError

__all__ = ["OwnerLock", "lock_path", "still_owner"]

ORPHAN_WAIT = 15.0  # seconds an orphaned writer may take to finish before we give up

_held: dict[Path, list[int]] = {}  # lock file -> [fd, holders] in this process


def lock_path(store: Path) -> Path:
    return store.with_name(store.name + ".owner")


class OwnerLock:
    """The lock of one store, taken by `acquire` (StoreError if another service has it)."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.path = lock_path(store)
        self.fd: int | None = None

    def acquire(self, orphan_wait: float = ORPHAN_WAIT) -> None:
        key = self.path.resolve()
        held = _held.get(key)
        if held is not None:
            held[1] += 1
            self.fd = held[0]
            return
        self.fd = self._lock(orphan_wait)
        _held[key] = [self.fd, 1]

    def _lock(self, orphan_wait: float) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot lock the store {self.store}: {exc.strerror or exc}") from None
        deadline = time.monotonic() + orphan_wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                owner = _read(fd)
                if _orphaned(owner) and time.monotonic() < deadline:
                    time.sleep(0.05)  # its service is gone: its writer is finishing
                    continue
                os.close(fd)
                raise StoreError(_in_use(self.store, owner)) from None
        os.ftruncate(fd, 0)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return fd

    def release(self) -> None:
        # The file stays: another service may have it open, waiting for the lock, and
        # would lock a file nobody else can see if this one unlinked it.
        if self.fd is None:
            return
        self.fd = None
        key = self.path.resolve()
        held = _held.get(key)
        if held is not None:
            held[1] -= 1
            if held[1] <= 0:
                del _held[key]
                os.close(held[0])


def still_owner(fd: int, path: Path) -> bool:
    """Whether the lock file at `path` is the one locked through `fd` (a stat each)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def _read(fd: int) -> dict[str, object]:
    with contextlib.suppress(OSError, ValueError):
        data = os.pread(fd, 4096, 0)
        record = json.loads(data) if data else {}
        if isinstance(record, dict):
            return record
    return {}


def _orphaned(owner: dict[str, object]) -> bool:
    """The owner is a service of this host that is gone (its writer still holds the lock)."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _in_use(store: Path, owner: dict[str, object]) -> str:
    pid, host = owner.get("pid", "?"), owner.get("host", "?")
    return (
        f"the store {store} is in use by kvindex serve pid {pid} on {host} "
        f"(one service per store: stop that one, or give this one another --store)"
    )
