"""Ingest off the event loop: worker threads, each following a share of the fleet.

A worker owns one `Subscriber` (its instances' sockets: ZMQ sockets stay on the thread
that made them) and applies every batch it reads to the shared index as the publisher
sent it (`apply_payload`): with the compiled index the parse and apply run with the GIL
released, so the HTTP loop answers lookups on another core meanwhile, and lookups take the
index's read lock, so they never see half a batch. With the pure-Python index a lock does
the same (`IndexGuard`), and ingest and lookups share one core.

With the compiled index and nothing that must see every batch as an item (no item hooks;
a persistent store takes them in bulk), the in-order path runs in C
(kvindex.subscriber.inorder): each live batch whose seq is the one due is received,
checked, digested, parsed and applied without the GIL and without a Python object; Python
sees only what is not ordinary (a gap, a restart, a malformed message, a batch the fast
parser leaves to the decoder) and the counters, in bulk, once per read, with the batches'
payloads when a store must log them (`keep_payloads`). `KVINDEX_C_INGEST=0` keeps every
batch on the Python path.

Changes of membership come from other threads (an API call adding an instance): they
are handed to the owning worker as commands and run between two reads; a pipe wakes the
worker out of its poll at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kvindex.index import COMPILED, FleetIndex
from kvindex.subscriber import (
    Applied,
    DecodeFailed,
    Delivery,
    Item,
    Restarted,
    SourceKey,
    Subscriber,
)
from kvindex.wire import WireError

__all__ = [
    "IndexGuard",
    "IngestCounters",
    "IngestWorker",
    "WorkerUnavailable",
    "c_ingest_wanted",
    "default_workers",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

COMMAND_TIMEOUT = 30.0  # an add or remove waits this long for its worker


class WorkerUnavailable(RuntimeError):
    """The ingest worker that owns an instance did not run a command: it stopped, or it
    did not get to it within COMMAND_TIMEOUT (then the command never runs)."""


def default_workers() -> int:
    """Ingest threads by default: one per core (the compiled index applies without the
    GIL); one with the pure-Python index, whose applies hold the GIL anyway."""
    return max(1, os.cpu_count() or 1) if COMPILED else 1


def c_ingest_wanted() -> bool:
    """Whether the in-order path may run in C (KVINDEX_C_INGEST=0: never; KVINDEX_PURE=1
    has no C path at all)."""
    return os.environ.get("KVINDEX_C_INGEST", "1") not in ("", "0")


class IndexGuard:
    """Mutual exclusion for an index that has none of its own (the pure-Python one); the
    compiled index has a read-write lock inside and needs nothing here."""

    def __init__(self, index: FleetIndex) -> None:
        self._lock: threading.RLock | None = None if _locks_itself(index) else threading.RLock()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self._lock is None:
            yield
            return
        with self._lock:
            yield


def _locks_itself(index: FleetIndex) -> bool:
    try:
        from kvindex.index.compiled import CompiledIndex
    except ImportError:
        return False
    return isinstance(index, CompiledIndex)


@dataclass(slots=True)
class IngestCounters:
    """How one worker is doing (summed by the Fleet for /v1/stats and the metrics)."""

    items: int = 0
    deliveries: int = 0
    slices: int = 0  # reads of the sockets
    waits: int = 0  # reads that found nothing and waited
    errors: int = 0
    hook_errors: int = 0
    longest_slice_seconds: float = 0.0  # the longest read + apply
    batches_in_c: int = 0  # ordinary batches the C path received and applied
    # This thread's CPU time in Python (holding the GIL) on the ingest path: each read and
    # apply, less the C loop's own time without the GIL. Per ordinary batch, it is what
    # bounds one process's ingest however many cores it has (docs/performance.md).
    gil_seconds: float = 0.0
    # Of the C path's CPU time, the part applying under the index's write lock (sampled: 1
    # batch in 16): the other part no two workers do at once, whatever the cores.
    apply_locked_seconds: float = 0.0


class IngestWorker:
    """One ingest thread and the `Subscriber` it owns."""

    def __init__(
        self,
        name: str,
        subscriber: Subscriber,
        index: FleetIndex,
        guard: IndexGuard,
        on_item: Callable[[Item], None],
        after_read: Callable[[], None] | None = None,
        after_apply: Callable[[], None] | None = None,
        idle_wait: float = 0.05,
        in_c: Callable[[], bool] | None = None,
        on_applied: Callable[[Applied], None] | None = None,
        keep_payloads: Callable[[], bool] | None = None,
    ) -> None:
        """`on_item` sees every item after the index applied it (the Fleet's hooks);
        `after_read` runs on this thread after each read, before its items are applied (a
        shared store's membership), `after_apply` once they are (a store's flush).
        `in_c`, asked before each read: whether the ordinary batches may be applied in C
        now (they then reach no `on_item`; `on_applied` sees what C applied of each
        publisher, once per read, with the payloads if `keep_payloads()` says so)."""
        self.name = name
        self.subscriber = subscriber
        self.counters = IngestCounters()
        # Bumped after anything that may change a source's status (a read, a command):
        # readers cache what they derive from the statuses until it moves.
        self.changes = 0
        self.lag: dict[SourceKey, float] = {}
        self.failure: str | None = None
        self._index = index
        self._guard = guard
        self._on_item = on_item
        self._after_read = after_read
        self._after_apply = after_apply
        self._idle_wait = idle_wait
        self._in_c = in_c
        self._on_applied = on_applied
        self._keep_payloads = keep_payloads
        self._c_api: tuple[object, object] | None = _c_api(index)
        self._commands: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._pending: list[Item] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        subscriber.wake_on(self._wake_r)

    # -- the thread -----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def backlog(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; it closes its sockets on the way out. The wake pipe is closed
        only once no thread polls it (a thread still running keeps it: a closed fd number
        could be reused by another file meanwhile)."""
        self._stopping = True
        self._wake()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("ingest worker %s did not stop within %.0f s", self.name, timeout)
                return
        else:
            self.subscriber.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                self.step(self._idle_wait)
        except BaseException as exc:  # a bug: the service must say it is unhealthy
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("ingest worker %s stopped", self.name)
        finally:
            self._fail_commands()
            self.subscriber.close()

    # -- commands from other threads ------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on this worker's thread (now, if it is not running or this is it) and
        return its result or raise its exception. Raises WorkerUnavailable if the thread
        stopped, or did not start `fn` within `COMMAND_TIMEOUT` (`fn` never runs then; one
        that started is waited for)."""
        if self._thread is None or threading.current_thread() is self._thread:
            try:
                return fn()
            finally:
                self.changes += 1
        if not self.running:
            raise WorkerUnavailable(f"ingest worker {self.name} is not running")
        future: Future[T] = Future()
        self._commands.append((fn, future))
        self._wake()
        try:
            return future.result(COMMAND_TIMEOUT)
        except TimeoutError:
            if future.cancel():
                raise WorkerUnavailable(
                    f"ingest worker {self.name} did not answer within {COMMAND_TIMEOUT:.0f} s"
                ) from None
            return future.result()  # it runs now: its end is near

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe is awake already
            os.write(self._wake_w, b"x")

    def _run_commands(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 4096):
                pass
        while self._commands:
            fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                self.changes += 1

    def _fail_commands(self) -> None:
        while self._commands:
            _, future = self._commands.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(WorkerUnavailable(f"ingest worker {self.name} stopped"))

    # -- reading and applying ---------------------------------------------------------------

    def step(self, timeout: float = 0.0) -> bool:
        """Read what the sockets have (waiting up to `timeout` for something) and apply it
        all; True if anything was read. Tests drive a Fleet that was not started this way."""
        start, cpu = time.perf_counter(), time.thread_time()
        counters = self.counters
        counters.slices += 1
        subscriber = self.subscriber
        c_before, locked_before = subscriber.c_seconds, subscriber.c_apply_seconds
        self._choose_path()
        items = subscriber.poll(timeout, max_messages=1024 if subscriber.in_c else 256)
        applied = subscriber.take_applied() if subscriber.in_c else []
        self.changes += 1
        if self._after_read is not None:
            self._after_read()
        if not items and not applied:
            counters.waits += 1
            counters.gil_seconds += time.thread_time() - cpu - (subscriber.c_seconds - c_before)
            return False
        for done in applied:  # they came before the items
            self._applied_in_c(done)
        self._pending = items
        for item in items:
            self.apply(item)
        self._pending = []
        if self._after_apply is not None:
            self._after_apply()
        took = time.perf_counter() - start
        if took > counters.longest_slice_seconds:
            counters.longest_slice_seconds = took
        counters.gil_seconds += time.thread_time() - cpu - (subscriber.c_seconds - c_before)
        counters.apply_locked_seconds += subscriber.c_apply_seconds - locked_before
        return True

    def _choose_path(self) -> None:
        """The C path on or off for this read (off: the Python path, as before)."""
        subscriber, api = self.subscriber, self._c_api
        want = api is not None and self._in_c is not None and self._in_c()
        keep = want and self._keep_payloads is not None and self._keep_payloads()
        if want and api is not None and (not subscriber.in_c or subscriber.keeps_payloads != keep):
            index = self._index
            assert isinstance(index, _compiled_type())
            subscriber.apply_in_c(api[0], api[1], index.publisher_bit, keep)
        elif not want and subscriber.in_c:
            subscriber.apply_in_python()

    def _applied_in_c(self, done: Applied) -> None:
        """The bookkeeping of the batches C applied for one publisher (apply's, in bulk)."""
        counters = self.counters
        counters.items += done.batches
        counters.deliveries += done.batches
        counters.batches_in_c += done.batches
        index = self._index
        assert isinstance(index, _compiled_type())
        index.applied_in_c(done.source, done.last_seq, done.ts, done.counts)
        if done.ts is not None:
            with contextlib.suppress(KeyError):  # closed since (removed, moved)
                self.subscriber.stats(done.source).last_ts = done.ts
                self.lag[done.source] = max(0.0, time.time() - done.ts)
        if done.packed is not None and not self.subscriber.follows(done.source.instance):
            # Removed since (a shared store's membership, after the read): as for an item
            # of it, nothing is recorded (the store has forgotten it already).
            done = done._replace(packed=None)
        if self._on_applied is not None:
            self._on_applied(done)

    def apply(self, item: Item) -> None:
        source = getattr(item, "source", None)
        if source is not None and not self.subscriber.follows(source.instance):
            return  # read before its instance was removed (by `after_read`, or a command)
        self.counters.items += 1
        try:
            item = self._apply_to_index(item)
        except Exception:
            self.counters.errors += 1
            log.exception("could not apply %r", item)
        self._on_item(item)

    def _apply_to_index(self, item: Item) -> Item:
        """Apply one item; a Delivery's payload goes to the index as it came. Returns what
        the hooks see: the item, or a DecodeFailed for a payload that is not a batch."""
        if not isinstance(item, Delivery):
            if isinstance(item, Restarted):
                with self._guard():
                    self._index.drop_source(item.source)
            return item
        self.counters.deliveries += 1
        stats = self.subscriber.stats(item.source)
        if item.payload is None:  # decoded already (a shared store's feed of other replicas)
            with self._guard():
                self._index.apply(item.source, item.batch, item.seq)
            self.lag[item.source] = max(0.0, time.time() - item.batch.ts)
            return item
        try:
            with self._guard():
                result = self._index.apply_payload(item.source, item.payload, item.seq)
        except WireError as exc:
            stats.decode_errors += 1
            return DecodeFailed(item.source, item.seq, str(exc))
        stats.decode_errors += result.malformed_events
        stats.unknown_events += result.unknown_events
        stats.last_ts = result.ts
        self.lag[item.source] = max(0.0, time.time() - result.ts)
        return item


def _compiled_type() -> type[Any]:
    from kvindex.index.compiled import CompiledIndex

    return CompiledIndex


def _c_api(index: FleetIndex) -> tuple[object, object] | None:
    """The compiled core's ingest capsule, if `index` is the compiled one."""
    if not _locks_itself(index):
        return None
    ingest_api = getattr(index, "ingest_api", None)
    return None if ingest_api is None else ingest_api()
