"""The link between the service and a store's worker process.

Both persistent stores do their I/O in a child process (`python -m ...`), fed over ZMQ
sockets on ipc paths: sends never block the event loop (ZMQ queues them in its own thread,
without limit: memory absorbs bursts), and `request` waits for the worker to acknowledge a
control message (sync, compact).

Messages (tuples: a kind, then fields) are handed over in groups: one ZMQ message, a
msgpack list of them, per turn of the service's event loop (the Fleet ingests in slices of
about a millisecond). One send per batch made ZMQ's I/O thread wake up for each (its queue
runs dry between two batches): some 50 us of the service's CPU per batch, as much as
decoding and applying it. Without a running loop (a script), a group goes every 64
messages or 10 ms, and always before `request` and `close`.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from kvindex.store.sqlite_db import StoreError

__all__ = ["WorkerLink", "WorkerStore", "decode_group"]

GROUP_MESSAGES = 64  # without an event loop: a group at most this long
GROUP_SECONDS = 0.01  # or this old
# With or without: at most this many payload bytes. Larger buffers are mmap'd by malloc
# (from 128 KiB) and page-faulted in at each send: 1 ms for a 160 KiB group here.
GROUP_BYTES = 64 * 1024

decode_group = msgspec.msgpack.Decoder(list[tuple[Any, ...]]).decode


class WorkerLink:
    """Sockets to one worker process: `in` (PUSH, to it), `acks` and any extra PULLs."""

    def __init__(self, what: str) -> None:
        self.what = what  # "the SQLite writer": for error messages
        self.sockets: dict[str, zmq.Socket[bytes]] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._tokens = 0
        # Ingest threads record, and a sync may come from another thread: one at a time
        # on the socket (a ZMQ socket moves between threads only across a lock).
        self._lock = threading.RLock()
        self.encode = msgspec.msgpack.Encoder().encode
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray(GROUP_BYTES * 2)
        self._group: list[tuple[Any, ...]] = []
        self._group_bytes = 0
        self._group_started = 0.0
        self._flush_scheduled = False

    def open(self, pulls: Sequence[str] = ()) -> str:
        """Bind the sockets; returns the ipc base path (`{base}/in`, `{base}/acks`, ...)."""
        self._tmp = tempfile.TemporaryDirectory(prefix="kvindex-store-")
        base = f"ipc://{self._tmp.name}"
        self.sockets["in"] = self._bind(zmq.PUSH, f"{base}/in")
        for name in ("acks", *pulls):
            self.sockets[name] = self._bind(zmq.PULL, f"{base}/{name}")
        return base

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 2000 if kind == zmq.PUSH else 0)
        sock.bind(endpoint)
        return sock

    def spawn(self, argv: list[str], stdin: bytes | None = None) -> None:
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else None)
        if stdin is not None:
            assert self.process.stdin is not None
            self.process.stdin.write(stdin)
            self.process.stdin.close()

    def post(self, message: tuple[Any, ...], size: int = 0) -> None:
        """Queue a message for the worker (`size`: the bytes of its payload, if any); it
        goes with the next group (see the module)."""
        with self._lock:
            self._post(message, size)

    def _post(self, message: tuple[Any, ...], size: int) -> None:
        group = self._group
        group.append(message)
        self._group_bytes += size
        if len(group) == 1:
            self._group_started = time.monotonic()
            try:
                asyncio.get_running_loop().call_soon(self.flush)
                self._flush_scheduled = True
            except RuntimeError:
                self._flush_scheduled = False  # no loop: by size or age, or the next flush()
        if self._group_bytes >= GROUP_BYTES or (
            not self._flush_scheduled
            and (
                len(group) >= GROUP_MESSAGES
                or time.monotonic() - self._group_started >= GROUP_SECONDS
            )
        ):
            self._flush()

    def flush(self) -> None:
        """Hand the queued messages over now, as one ZMQ message."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        group, self._group, self._group_bytes = self._group, [], 0
        if not group:
            return
        sock = self.sockets.get("in")
        if sock is None:
            raise StoreError(f"{self.what} was not started")
        # Encoded into one reused buffer, then copied by ZMQ (tens of microseconds): a fresh
        # buffer per group is page-faulted in each time, and zero-copy would have pyzmq
        # release it later from its own thread, which takes the GIL from the event loop.
        self._encoder.encode_into(group, self._buffer)
        sock.send(self._buffer)

    def request(self, kind: str, timeout: float) -> None:
        """Send `(kind, token)` and wait until the worker acknowledges that token."""
        with self._lock:
            self._tokens += 1
            token = self._tokens
            self.post((kind, token))
            self.flush()
            acks = self.sockets["acks"]
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.alive():
                if acks.poll(100) and int(acks.recv()) == token:
                    return
            raise StoreError(f"{self.what} did not answer {kind} in {timeout:g} s")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self, timeout: float) -> None:
        """Ask the worker to stop (it finishes its work first), then free everything."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            self.post(("stop", 0))
            self.flush()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class WorkerStore:
    """What a store whose work happens in a worker process offers for control: the rest
    (load, start, record) is the store's own."""

    _link: WorkerLink

    def flush(self) -> None:
        self._link.flush()

    def sync(self, timeout: float = 30.0) -> None:
        """Wait until everything handed over so far is persisted by the worker."""
        self._link.request("sync", timeout)

    def compact(self, timeout: float = 60.0) -> None:
        """Have the worker write a snapshot now (if it may), and wait for it."""
        self._link.request("compact", timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Let the worker finish (commit, snapshot) and stop."""
        self._link.close(timeout)

    def _alive(self) -> bool:
        return self._link.alive()
