"""The service's link to a store's worker process: bounded, never blocking, supervised.

Both persistent stores do their I/O in a child process (`python -m ...`), fed over ZMQ
sockets on ipc paths. What the index applied is handed over in numbered `Group`s (see
`kvindex.store.protocol`): one ZMQ message per turn of an ingest thread, never one per
batch (a send per batch woke ZMQ's I/O thread for each: some 50 us of the service's CPU
per batch, as much as decoding and applying it). Without a running loop or ingest thread
calling `flush` (a script), a group goes every 64 messages or 10 ms. The C path's
batches (`PackedBatches`) are not copied into their group: their payloads, the buffer the
C receive kept them in, go as frames of their own beside the group's other bytes
(`protocol.group_frames`, a multipart ZMQ message, zero-copy for frames of 64 KiB and
more), and the worker joins them.

Nothing here ever waits on the worker:
- sends are non-blocking, into a pipe of a few groups; what does not fit waits here;
- every group is kept until the worker says it is durable (`WorkerReport.committed`), up
  to `max_bytes`. Past that (a worker that can't write, a disk that is full) new batches
  are not kept: each publisher's dropped run becomes one `LostMark`, so the store says it
  is incomplete rather than hold a state with a hole in it, and memory stays bounded;
- a supervisor thread reads the worker's reports and watches the process (every 0.1 s).
  A worker that died is started again at once (then after a pause growing to 2 s if it
  keeps dying) and handed every group it had not made durable, which it applies
  idempotently: nothing acknowledged is lost, and nothing is applied twice.

`health()` says how the link is doing for /healthz and /metrics.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvindex.runtime import StoreHealth
from kvindex.store.base import StoreError
from kvindex.store.protocol import (
    AppliedBatch,
    AppliedBatches,
    ControlRequest,
    LostMark,
    Outgoing,
    PackedBatches,
    RemoveInstance,
    RestartMark,
    SaveInstance,
    WorkerReport,
    decode_report,
    group_frames,
)
from kvindex.subscriber.messages import Delivery, Item, Lost, Restarted, SourceKey
from kvindex.subscriber.spec import InstanceSpec

__all__ = ["Command", "WorkerCommand", "WorkerLink", "WorkerStore"]

log = logging.getLogger("kvindex.store")

GROUP_MESSAGES = 64  # without a flush from the caller: a group at most this long
GROUP_SECONDS = 0.01  # or this old
GROUP_BYTES = 64 * 1024  # with or without: at most this many payload bytes
# Groups ZMQ holds towards the worker (as many again on its side); the rest wait here. Data
# moves to the worker as soon as it can take it: what it holds survives a `kill -9` of the
# service (an orphaned worker commits what it has before it exits).
PIPE_GROUPS = 256
MAX_BYTES = 256 * 1024 * 1024  # groups kept until durable, before batches are dropped
WATCH_EVERY = 0.1  # how often the supervisor looks (a dead worker is seen within this)
RESTART_PAUSE_MAX = 2.0
START_TIMEOUT = 30.0  # for a worker's first word (a process to start, imports)


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    """How to start a worker: its argv, what its stdin reads, the fds it inherits."""

    argv: list[str]
    stdin: bytes | None = None
    pass_fds: tuple[int, ...] = ()


# The command to start the worker with; its argument says it is not the first start.
Command = Callable[[bool], WorkerCommand]


@dataclass(slots=True)
class _Kept:
    """A group not yet durable: its id, its encoded frames (`protocol.group_frames`) and
    their bytes, when it was made."""

    id: int
    frames: list[bytes | memoryview]
    size: int
    made: float


class WorkerLink:
    """Sockets to one worker process, the groups it has not made durable, and the thread
    that supervises it (see the module)."""

    def __init__(self, what: str, *, max_bytes: int = MAX_BYTES) -> None:
        self.what = what  # "the SQLite writer": for messages
        self.max_bytes = max_bytes
        self.sockets: dict[str, zmq.Socket[bytes]] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._command: Command | None = None
        # Ingest threads post, the supervisor sends and trims, a sync may come from any
        # thread: one at a time (a ZMQ socket moves between threads only across a lock).
        self._lock = threading.RLock()
        self._answered = threading.Condition(self._lock)
        self._encode = msgspec.msgpack.Encoder().encode
        self._group: list[Outgoing] = []
        self._group_bytes = 0
        self._group_started = 0.0
        self._kept: deque[_Kept] = deque()
        self._kept_bytes = 0
        self._next_id = 1
        self._sent = 0  # the last group handed to ZMQ
        self._committed = 0  # the last group the worker made durable
        self._dropped: dict[tuple[str, int], list[int]] = {}  # source -> [first, last] seq
        self._done: set[int] = set()
        self._tokens = 0
        self._watcher: threading.Thread | None = None
        self._closing = False
        self._stopped = threading.Event()
        self._heard = threading.Event()  # the worker said something: its sockets are up
        # What health() reports.
        self.restarts = 0
        self.dropped_batches = 0
        self.refused_batches = 0  # over every worker process (see WorkerReport.refused)
        self._refused_before = 0  # those of the processes before this one
        self.error = ""  # why the worker can't write now, as it says
        self.last_error = ""  # the last thing that went wrong, kept after recovery
        self._pause = WATCH_EVERY
        self._restart_at = 0.0

    # -- start ------------------------------------------------------------------------

    def open(self, pulls: Sequence[str] = ()) -> str:
        """Bind the sockets; returns the ipc base path (`{base}/in`, `{base}/acks`, ...).

        On Linux the paths are in the abstract socket namespace: nothing on disk, so a
        killed service leaves nothing behind. Elsewhere, a temporary directory."""
        if sys.platform.startswith("linux"):
            base = f"ipc://@kvindex-store-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvindex-store-")
            base = f"ipc://{self._tmp.name}"
        self.sockets["in"] = self._bind(zmq.PUSH, f"{base}/in")
        for name in ("acks", *pulls):
            self.sockets[name] = self._bind(zmq.PULL, f"{base}/{name}")
        return base

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        if kind == zmq.PUSH:
            sock.setsockopt(zmq.SNDHWM, PIPE_GROUPS)
        else:
            sock.setsockopt(zmq.RCVHWM, 0)  # reports and a feed: the worker bounds them
        sock.setsockopt(zmq.LINGER, 0)  # what a worker did not take is kept here anyway
        sock.bind(endpoint)
        return sock

    def start(self, command: Command) -> None:
        """Start the worker and its supervisor. `command` is asked for the worker's argv
        and stdin at every (re)start."""
        self._command = command
        self._spawn(restarted=False)
        self._watcher = threading.Thread(target=self._watch, name="kvindex-store-link", daemon=True)
        self._watcher.start()
        # Until the worker is connected nothing can be handed over: what ingest applied
        # meanwhile would only be kept here, and lost with a `kill -9` of the service.
        deadline = time.monotonic() + START_TIMEOUT
        while not self._heard.wait(WATCH_EVERY):
            if time.monotonic() > deadline or not self.alive():
                why = self.error or f"no word from it in {START_TIMEOUT:g} s"
                raise StoreError(f"{self.what} did not start: {why}")

    def _spawn(self, restarted: bool) -> None:
        assert self._command is not None
        command = self._command(restarted)
        # Its own process group: a terminal's Ctrl+C (SIGINT to the foreground group) and a
        # signal to the whole group reach the service only, which stops the worker itself
        # after it has handed everything over.
        process = subprocess.Popen(
            command.argv,
            stdin=subprocess.PIPE if command.stdin is not None else None,
            pass_fds=command.pass_fds,
            process_group=0,
        )
        if command.stdin is not None:
            assert process.stdin is not None
            process.stdin.write(command.stdin)
            process.stdin.close()
        self.process = process

    # -- the hot path -------------------------------------------------------------------

    def post(self, message: Outgoing, size: int = 0) -> None:
        """Queue a message for the worker (`size`: its payload's bytes, if any); it goes
        with the next group."""
        with self._lock:
            group = self._group
            group.append(message)
            self._group_bytes += size
            if len(group) == 1:
                self._group_started = time.monotonic()
            if (
                self._group_bytes >= GROUP_BYTES
                or len(group) >= GROUP_MESSAGES
                or time.monotonic() - self._group_started >= GROUP_SECONDS
            ):
                self._flush()

    def flush(self) -> None:
        """Hand the queued messages over now, as one group."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        messages, self._group, self._group_bytes = self._group, [], 0
        if not messages:
            return
        if self._kept_bytes >= self.max_bytes or self._dropped:
            messages = self._keep_within_bounds(messages)
        group_id = self._next_id
        self._next_id += 1
        frames = group_frames(self._encode, group_id, messages)
        size = sum(map(len, frames))
        self._kept.append(_Kept(group_id, frames, size, time.monotonic()))
        self._kept_bytes += size
        self._send_waiting()

    def _keep_within_bounds(self, messages: list[Outgoing]) -> list[Outgoing]:
        """Over the bound: batches are dropped (each publisher's run of them noted); once
        there is room again, a publisher's next batch comes after a LostMark for its run."""
        full = self._kept_bytes >= self.max_bytes
        out: list[Outgoing] = []
        for message in messages:
            if isinstance(message, AppliedBatch | AppliedBatches | PackedBatches):
                source = (message.instance, message.rank)
                run = self._dropped.get(source)
                if full:
                    if isinstance(message, AppliedBatch):
                        first = last = message.seq
                    else:
                        first, last = message.first_seq, message.last_seq
                    self.dropped_batches += last - first + 1
                    if run is None:
                        self._dropped[source] = [first, last]
                    else:
                        run[1] = last
                    continue
                if run is not None:
                    del self._dropped[source]
                    out.append(LostMark(source[0], source[1], run[0], run[1]))
            out.append(message)
        if full and not self.error:
            self.error = f"{self.what} is {self.max_bytes >> 20} MiB behind: batches are dropped"
        return out

    def _send_waiting(self) -> None:
        """Hand ZMQ the groups not sent yet, in order, as far as its pipe takes them."""
        sock = self.sockets.get("in")
        if sock is None:
            raise StoreError(f"{self.what} was not started")
        if self._sent >= self._next_id - 1:
            return  # all sent: nothing to look through (the supervisor asks per report)
        for kept in self._kept:
            if kept.id <= self._sent:
                continue
            try:
                # One message, its frames all or none (ZMQ's multipart is atomic); frames
                # below pyzmq's copy threshold are copied, the payloads' are not.
                sock.send_multipart(kept.frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # the worker is busy, gone or stuck: the rest wait here
            self._sent = kept.id

    # -- requests ---------------------------------------------------------------------

    def request(self, kind: str, timeout: float) -> None:
        """Send a request and wait until the worker answers it (StoreError if it does not
        in `timeout` seconds: it can't write, or keeps dying)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._tokens += 1
            token = self._tokens
            self._group.append(ControlRequest(kind, token))  # type: ignore[arg-type]
            self._flush()
            while token not in self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    why = f": {self.error}" if self.error else ""
                    raise StoreError(f"{self.what} did not answer {kind} in {timeout:g} s{why}")
                self._answered.wait(min(left, WATCH_EVERY))
            self._done.discard(token)

    # -- the supervisor -----------------------------------------------------------------

    def _watch(self) -> None:
        while not self._wait():
            try:
                self._look()
            except Exception:  # the supervisor must outlive anything it meets
                log.exception("%s: supervising it failed", self.what)

    def _wait(self) -> bool:
        """Until the worker reports something, at most WATCH_EVERY; True once stopping.
        A report is read as it comes, not at the next tick: a `sync` answered in 1 ms
        waited up to 0.1 s for the tick before (the bench's store case measured that)."""
        acks = self.sockets.get("acks")
        if acks is None:
            return self._stopped.wait(WATCH_EVERY)
        try:
            acks.poll(int(WATCH_EVERY * 1000))
        except zmq.ZMQError:
            return self._stopped.wait(WATCH_EVERY)
        return self._stopped.is_set()

    def _look(self) -> None:
        self._read_reports()
        with self._lock:
            if self._group and time.monotonic() - self._group_started >= GROUP_SECONDS:
                self._flush()  # nobody flushed the last messages posted: they go now
        process = self.process
        if process is None or process.poll() is None:
            with self._lock:
                self._send_waiting()
            return
        if self._closing and process.returncode == 0:
            return  # it stopped as asked
        now = time.monotonic()
        if not self._restart_at:
            self._note_death(process.returncode)
            self._restart_at = now + (self._pause if self.restarts else 0.0)
        if now >= self._restart_at:
            self._restart()

    def _note_death(self, code: int) -> None:
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        why = f"{self.what} stopped ({how})" + (f": {self.error}" if self.error else "")
        self.last_error = self.error = why
        log.error("%s; starting it again", why)

    def _restart(self) -> None:
        with self._lock:
            # Everything not durable goes again, in order, to the new worker.
            self._sent = self._committed
            self.restarts += 1
            self._refused_before = self.refused_batches
            self._restart_at = 0.0
            self._pause = min(self._pause * 2, RESTART_PAUSE_MAX)
            try:
                self._spawn(restarted=True)
            except (OSError, StoreError) as exc:
                self.last_error = self.error = f"{self.what} could not be started: {exc}"
                self._restart_at = time.monotonic() + self._pause
                return
            self._send_waiting()

    def _read_reports(self) -> None:
        acks = self.sockets.get("acks")
        if acks is None:
            return
        while True:
            try:
                frame = acks.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return  # closed meanwhile
            self._take(decode_report(frame))

    def _take(self, report: WorkerReport) -> None:
        self._heard.set()
        with self._lock:
            self.refused_batches = max(self.refused_batches, self._refused_before + report.refused)
            if report.committed > self._committed:
                self._committed = report.committed
                kept = self._kept
                while kept and kept[0].id <= report.committed:
                    self._kept_bytes -= kept.popleft().size
                self._pause = WATCH_EVERY  # it works: a later death restarts it at once
            if report.error != self.error:
                if report.error:
                    self.last_error = report.error
                    log.error("%s: %s", self.what, report.error)
                elif self.error:
                    log.warning("%s writes again", self.what)
                self.error = report.error
            if report.done:
                self._done.update(report.done)
                self._answered.notify_all()

    # -- health -------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def health(self, url: str) -> StoreHealth:
        with self._lock:
            oldest = self._kept[0].made if self._kept else None
            if oldest is None and self._group:
                oldest = self._group_started
            pending = len(self._kept) + bool(self._group)
            error = self.error
        alive = self.alive()
        if not alive and not error:
            error = f"{self.what} is not running"
        return StoreHealth(
            url=url,
            up=alive and not error,
            reason=error or None,
            restarts=self.restarts,
            last_error=self.last_error or None,
            lag_seconds=0.0 if oldest is None else time.monotonic() - oldest,
            pending_groups=pending,
            dropped_batches=self.dropped_batches,
            refused_batches=self.refused_batches,
        )

    # -- stop ---------------------------------------------------------------------------

    def close(self, timeout: float) -> None:
        """Ask the worker to stop (it makes everything durable first), then free all."""
        with self._lock:
            self._closing = True
            if self.sockets.get("in") is not None and self.process is not None:
                self._group.append(ControlRequest("stop", 0))
                self._flush()
        # A worker that can't write (a full disk) can't finish either: don't wait long.
        deadline = time.monotonic() + (min(timeout, 5.0) if self.error else timeout)
        while self.process is not None and time.monotonic() < deadline:
            running = self.process
            if running.poll() is not None and running.returncode == 0:
                break
            if self._watcher is None:
                self._look()  # never started: nothing supervises it
            time.sleep(0.02)
        self._stopped.set()
        if self._watcher is not None:
            self._watcher.join()
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            log.error("%s did not stop in %g s: killed", self.what, timeout)
            process.kill()
            process.wait()
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class WorkerStore:
    """What a store whose work happens in a worker process does on the service's side:
    hand over what the index applied, and control the worker (load and start are the
    store's own)."""

    _link: WorkerLink

    @property
    def url(self) -> str:
        raise NotImplementedError

    # -- the hot path: one queued message per item ----------------------------------------

    def record(self, item: Item) -> None:
        source, post = item.source, self._link.post
        if isinstance(item, Delivery):
            if item.payload is None:
                raise StoreError("the Subscriber must keep payloads for a persistent store")
            payload = item.payload
            post(AppliedBatch(source.instance, source.rank, item.seq, payload), len(payload))
        elif isinstance(item, Restarted):
            post(RestartMark(source.instance, source.rank))
        elif isinstance(item, Lost):
            post(LostMark(source.instance, source.rank, item.first, item.last))

    def record_batches(
        self, source: SourceKey, first_seq: int, count: int, packed: bytes | memoryview
    ) -> None:
        """The C path's batches of one read: one message for them all, its payloads as
        they were packed (no object per batch, no copy: `packed` is sent as it is)."""
        message = PackedBatches(source.instance, source.rank, first_seq, msgspec.Raw(packed), count)
        self._link.post(message, len(packed))

    def save_instance(self, spec: InstanceSpec) -> None:
        self._link.post(SaveInstance(spec.name, spec.render()))

    def remove_instance(self, name: str) -> None:
        self._link.post(RemoveInstance(name))

    # -- control --------------------------------------------------------------------------

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

    def health(self) -> StoreHealth:
        return self._link.health(self.url)
