"""Following SGLang's load stream (`kvindex.wire.engine_load`): the newest `LoadStat` per DP rank.

A gauge needs none of what the KV-event links do (no seq checking, no replay, no
backlog): the newest reading per rank wins, so each SUB socket keeps a small high-water
mark and everything read is folded into one reading per rank. The sockets live on one
thread of their own (`start`), so a load stream never holds up ingest; membership changes
(`follow`, `forget`) are handed to that thread and it is woken for them. A Follower not
started is stepped by hand (`step`), as the Fleet's tests do.

A payload that is no `LoadStat` is counted per rank (`LoadState.malformed`) and skipped;
a rank that stops sending keeps its last reading, whose age (`LoadReading.age`) says how
old it is (SGLang re-sends an unchanged gauge every second).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from kvindex.subscriber.capacity import SocketBudget, budget_of, need_of_load, subscriber_context
from kvindex.subscriber.messages import SourceKey
from kvindex.subscriber.spec import InstanceSpec
from kvindex.wire.engine_load import LoadStat, LoadStatError, decode_load

__all__ = ["LoadFollower", "LoadReading", "LoadState"]

log = logging.getLogger(__name__)

_RCVHWM = 16  # a gauge: newer readings supersede what a full pipe sheds
_MAX_READS = 256  # per socket per wake-up: a flood of readings never starves the others


@dataclass(frozen=True, slots=True)
class LoadReading:
    stat: LoadStat
    received: float  # monotonic time it was read

    @property
    def age(self) -> float:
        return max(0.0, time.monotonic() - self.received)


@dataclass(slots=True)
class LoadState:
    """One rank's load stream: its endpoint, newest reading and what was skipped."""

    endpoint: str
    reading: LoadReading | None = None
    readings: int = 0
    malformed: int = 0


class LoadFollower:
    """Every followed instance's load stream, one SUB socket per DP rank."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        """Sockets are made on `context`, by default the subscribers' own, and counted in
        its `SocketBudget` beside theirs (`follow` refuses what does not fit)."""
        self._ctx = context or subscriber_context()
        self._budget: SocketBudget = budget_of(self._ctx)
        self._reserved: set[str] = set()  # instances whose sockets the budget holds
        self._lock = threading.Lock()  # guards _states and _pending
        self._states: dict[SourceKey, LoadState] = {}
        self._pending: list[tuple[str, InstanceSpec | None]] = []  # (name, spec or forget)
        self._sockets: dict[zmq.Socket[bytes], tuple[SourceKey, str]] = {}  # the loop's own
        self._poller = zmq.Poller()
        # The loop's wake-up pair, opened by `start` only: a Follower stepped by hand (or
        # never started) holds no socket until it follows a load stream.
        self._wake_recv: zmq.Socket[bytes] | None = None
        self._wake_send: zmq.Socket[bytes] | None = None
        self._wake_lock = threading.Lock()  # a PAIR socket is for one thread at a time
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False

    # -- membership (any thread) -----------------------------------------------------

    def follow(self, spec: InstanceSpec) -> None:
        """Follow `spec`'s load stream (every rank), in place of what was followed under
        its name; nothing if it has none. Raises `CapacityError` (and nothing changes) if
        its sockets don't fit beside what the process follows."""
        ranks = len(spec.load_sources())
        if ranks:
            what = f"the load stream of {spec.name!r}"
            self._budget.reserve(id(self), spec.name, need_of_load(ranks), what)
            self._reserved.add(spec.name)
        else:
            self._release(spec.name)
        self._change(spec.name, spec)

    def forget(self, name: str) -> None:
        """Stop following the instance's load stream and drop its readings."""
        self._release(name)
        self._change(name, None)

    def _release(self, name: str) -> None:
        self._budget.release(id(self), name)
        self._reserved.discard(name)

    def _change(self, name: str, spec: InstanceSpec | None) -> None:
        with self._lock:
            followed = any(s.instance == name for s in self._states)
            if not followed and (spec is None or not spec.load_sources()):
                return  # no load stream before or after: nothing to do
            self._pending.append((name, spec))
            for source in [s for s in self._states if s.instance == name]:
                del self._states[source]  # no reading of the old publishers stays
            if spec is not None:
                for source, endpoint in spec.load_sources():
                    self._states[source] = LoadState(endpoint)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_send is not None and not self._closed:
                try:
                    self._wake_send.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # wake-ups are queued already: the loop will see every change

    # -- readings (any thread) -------------------------------------------------------

    def state(self, source: SourceKey) -> LoadState | None:
        """The rank's load stream (None if the instance advertises none)."""
        with self._lock:
            return self._states.get(source)

    # -- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None and not self._closed:
            with self._wake_lock:
                address = f"inproc://kvindex-load-{id(self):x}"
                self._wake_recv = self._ctx.socket(zmq.PAIR)
                self._wake_recv.bind(address)
                self._wake_send = self._ctx.socket(zmq.PAIR)
                self._wake_send.connect(address)
                self._poller.register(self._wake_recv, zmq.POLLIN)
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="kvindex-load", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and close every socket (the Follower is done with then)."""
        self._stopping = True
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout)
            self._thread = None
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            for sock in [*self._sockets, self._wake_recv, self._wake_send]:
                if sock is not None:
                    sock.close(linger=0)
            self._sockets.clear()
        for name in list(self._reserved):
            self._release(name)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.step(timeout=None)
        except Exception:  # a bug here must not pass silently, nor take ingest down
            log.exception("the load stream loop stopped")

    def step(self, timeout: float | None = 0) -> bool:
        """Apply membership changes and fold in what the sockets hold (waiting up to
        `timeout` seconds, None: until something comes); True if a reading was read."""
        self._apply_changes()
        wait = None if timeout is None else int(timeout * 1000)
        ready = dict(self._poller.poll(wait))
        wake = self._wake_recv
        if wake is not None and wake in ready:
            while wake.poll(0):
                wake.recv()
            self._apply_changes()
        read = False
        for sock, (source, endpoint) in list(self._sockets.items()):
            if sock in ready:
                read = self._drain(sock, source, endpoint) or read
        return read

    def _apply_changes(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for name, spec in pending:
            for sock in [s for s, (key, _) in self._sockets.items() if key.instance == name]:
                self._poller.unregister(sock)
                sock.close(linger=0)
                del self._sockets[sock]
            if spec is None:
                continue
            for source, endpoint in spec.load_sources():
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, _RCVHWM)
                sock.setsockopt(zmq.SUBSCRIBE, spec.load_topic.encode())
                if endpoint.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(endpoint)
                self._sockets[sock] = (source, endpoint)
                self._poller.register(sock, zmq.POLLIN)

    def _drain(self, sock: zmq.Socket[bytes], source: SourceKey, endpoint: str) -> bool:
        newest: LoadStat | None = None
        readings = malformed = 0
        for _ in range(_MAX_READS):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise LoadStatError(f"{len(frames)} frames, not [topic, seq, LoadStat]")
                newest = decode_load(frames[2])
                readings += 1
            except LoadStatError as exc:
                if malformed == 0:
                    log.debug("%r: load message skipped: %s", source, exc)
                malformed += 1
        with self._lock:
            state = self._states.get(source)
            if state is None or state.endpoint != endpoint:
                return False  # forgotten or moved meanwhile: not this socket's any more
            state.readings += readings
            state.malformed += malformed
            if newest is not None:
                state.reading = LoadReading(newest, time.monotonic())
        return newest is not None
