"""Plain lookups answered by a C thread on serve's listening socket, without the GIL.

Under a busy ingest a lookup answered in Python (kvindex.service.fastpath) first waits for
the GIL behind the ingest threads' Python work: a switch interval or more. The C thread of
`_lookupd.c` owns the listening socket instead: it answers every `POST /v1/lookup` (and
`POST /v1/lookup/hashes`) of the plain shape whose headers it fully understands and the
guard admits (the core's walk and JSON answer under its read lock, lookup_api.h), and
hands any other connection -- its socket and the bytes read so far -- to uvicorn's
protocol here, which serves it with every rule and limit of the service (the fast path
of fastpath.py included), and gives it back once that is answered and nothing more of it
is pending (`returning`). So the thread never takes the GIL, and answers exactly what
the Python path answers
(tests/test_lookupd.py holds the two to identical bytes).

What the answer needs from Python -- the instances with their DP ranks' bits and their
statuses -- is pushed to the thread when it changes (checked every `REFRESH` seconds and
whenever a connection is handed over); a lookup made while the core's publishers moved
since is handed over instead (the core's `sources_gen`), so an answer never names the
wrong bits. A status is at most `REFRESH` old. Each answer's time and hit are read into
the service's lookup metrics at the same pace, and before every /metrics scrape.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvindex.index import json_answerer
from kvindex.runtime import Fleet
from kvindex.security.http import HostNames, HttpGuard
from kvindex.security.limits import Limits
from kvindex.service.fastpath import PATH
from kvindex.service.metrics import LookupMetrics

__all__ = ["STAGES", "LookupThread", "LookupThreadCollector", "StageTimes", "available"]

REFRESH = 0.01  # seconds between two looks at the instances and the samples
HEAD_LIMIT = 8192  # request line and headers the thread reads before handing over
HANDOFF_AFTER = 1.0  # a request not whole after this long goes to Python's deadlines

_API: object | None
try:
    from kvindex.index._core import lookup_api as _API
    from kvindex.service._lookupd import Server
except ImportError:  # no compiled core or thread: Python answers every lookup
    _API = None
    Server = None  # type: ignore[assignment,misc]


# Where an answer's time goes, as the thread measures it (_lookupd.c's sample_t):
STAGES = (
    "queue",  # the kernel's receipt of the request to the thread's read: its wake-up
    "parse",  # that read to the walk: the HTTP head and the body
    "answer",  # the walk and the JSON, the core's read lock taken and let go
    "write",  # the answer made to the send returned (the client may have it before)
    "total",  # queue, parse and answer: from the request's receipt to its answer's send
)
STAGE_BUCKETS = (
    5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 7.5e-4,
    1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 1e-2, 2e-2, 5e-2, 0.1, 1.0,
)  # fmt: skip


class StageTimes:
    """The thread's answers by stage: a histogram per stage (STAGES), and how many were
    switched out during the walk, involuntarily (preempted: a core taken from the thread)
    and voluntarily (blocked: waiting for the core's read lock)."""

    def __init__(self) -> None:
        self.buckets = {stage: [0] * len(STAGE_BUCKETS) for stage in STAGES}
        self.sums = dict.fromkeys(STAGES, 0.0)
        self.counts = dict.fromkeys(STAGES, 0)
        self.preempted = 0
        self.blocked = 0

    def observe(self, stage: str, seconds: float) -> None:
        if seconds < 0:  # not measured (no receive timestamp, a write left for later)
            return
        self.sums[stage] += seconds
        self.counts[stage] += 1
        at = bisect.bisect_left(STAGE_BUCKETS, seconds)  # the first bound >= seconds
        if at < len(STAGE_BUCKETS):
            self.buckets[stage][at] += 1

    def add(
        self,
        answer: float,
        queue: float,
        parse: float,
        write: float,
        preempted: bool,
        blocked: bool,
    ) -> None:
        for stage, seconds in (("queue", queue), ("parse", parse), ("answer", answer)):
            self.observe(stage, seconds)
        self.observe("write", write)
        if queue >= 0:
            self.observe("total", queue + parse + answer)
        self.preempted += preempted
        self.blocked += blocked

    def metric(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "kvindex_lookup_thread_stage_seconds",
            "Where the C lookup thread's answers spend their time: queue (the kernel's "
            "receipt of the request to the thread's read of it), parse, answer (the walk "
            "and the JSON under the core's read lock), write (the send), and total (queue, "
            "parse and answer).",
            labels=["stage"],
        )
        for stage in STAGES:
            cumulative, rows = 0, []
            for bound, n in zip(STAGE_BUCKETS, self.buckets[stage], strict=True):
                cumulative += n
                rows.append((repr(bound), cumulative))
            rows.append(("+Inf", self.counts[stage]))
            family.add_metric([stage], rows, self.sums[stage])
        return family


def available(fleet: Fleet) -> bool:
    """Whether this fleet's lookups can be answered by the thread (a compiled index, or
    one in shards)."""
    return Server is not None and json_answerer(fleet.index) is not None


class _Handed(asyncio.Protocol):
    """uvicorn's protocol for a connection the thread handed over: the bytes it had read
    are given first, then everything else passes through."""

    def __init__(self, inner: Any, data: bytes, stopping: bool = False) -> None:
        self.inner = inner
        self.data = data
        self.stopping = stopping

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)
        data, self.data = self.data, b""
        if data and not transport.is_closing():
            self.inner.data_received(data)
        if self.stopping:  # handed over as the server stops: as uvicorn's own connections
            self.inner.shutdown()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class LookupThread:
    """The C lookup thread on `sock` (a listening socket), handing what it does not answer
    to `protocol` (a factory of uvicorn's protocol for one connection). `start` on the
    event loop that serves the handed-over connections; `stop` before the socket closes."""

    def __init__(
        self,
        fleet: Fleet,
        sock: socket.socket,
        guard: HttpGuard,
        max_body_bytes: int,
        metrics: LookupMetrics,
        default_headers: list[tuple[bytes, bytes]],
        date_header: bool = True,
        keep_alive: float = 5.0,
        limits: Limits | None = None,
    ) -> None:
        limits = limits or Limits()
        answerer = json_answerer(fleet.index)
        if Server is None or answerer is None:
            raise RuntimeError("the lookup thread needs the compiled core")
        self.fleet = fleet
        self.index = answerer
        self.core = answerer.answer_core()
        self.metrics = metrics
        hosts = None
        if guard.allowed_hosts is not None:
            names = HostNames(guard.allowed_hosts)
            hosts = None if names.any else sorted(n.encode() for n in names.allowed if n.isascii())
        token = guard.token.encode() if guard.token and guard.asks_token(PATH) else None
        self.server = Server(
            _API,
            self.core,
            sock.fileno(),
            max_body_bytes,
            guard.max_lookup_items,
            min(HEAD_LIMIT, limits.max_header_bytes),  # within the front's limit
            token,
            hosts,
            b"".join(name + b": " + value + b"\r\n" for name, value in default_headers),
            date_header,
            float(keep_alive),
            min(HANDOFF_AFTER, guard.request_timeout, limits.header_timeout),
            limits.max_connections,  # one cap over the thread's connections and Python's
        )
        self._pushed: tuple[int, object, object] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._protocol: Callable[[], asyncio.Protocol] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self.running = False
        self._closed = False
        self.stages = StageTimes()

    def start(self, protocol: Callable[[], asyncio.Protocol]) -> None:
        loop = asyncio.get_running_loop()
        self._loop, self._protocol = loop, protocol
        self.refresh()
        loop.add_reader(self.server.fileno(), self._take)
        self.server.start()
        self.running = True
        self._timer = loop.call_later(REFRESH, self._tick)

    def stop(self) -> None:
        """The thread ends: its idle connections closed, those with a request under way
        handed to uvicorn's protocol, told to close once answered (uvicorn's graceful stop
        waits for them as for its own; called as it begins); then the server is closed
        (it never starts again; its counts stay readable). Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.server.stop()
        if self._loop is not None and self.running:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.server.fileno())
            self._take(stopping=True)
        self.running = False
        for fd, _, _ in self.server.take():  # no loop to serve them on
            socket.socket(fileno=fd).close()
        self.read_samples()
        # Its buffers (the samples' ring, the answers, the limits) and its hold on the core
        # go now: serve keeps this object to the end (gc.freeze), past the core's life.
        self.server.close()
        self._closed = True

    def refresh(self) -> None:
        """Push the instances and their statuses to the thread if they moved."""
        if self._closed:
            return
        gen = self.index.sources_gen()  # before the slots: a later move makes them stale
        slots, statuses = self.fleet.answer_slots()
        pushed = self._pushed
        if pushed is not None and pushed[0] == gen and pushed[1] is slots and pushed[2] is statuses:
            return
        self.server.set_answer(slots, statuses, gen)
        self._pushed = (gen, slots, statuses)

    def read_samples(self) -> None:
        """The thread's answers since the last call, into the lookup metrics."""
        observe, stages = self.metrics.observe, self.stages.add
        for seconds, hit, kind, queue, parse, write, preempted, blocked in self.server.samples():
            observe(kind, seconds, hit, compiled=kind == "tokens")
            stages(seconds, queue, parse, write, preempted, blocked)

    def counts(self) -> tuple[int, int, int, int, int]:
        """(answered, handed over, stale, samples dropped, given back) since the start."""
        return self.server.counts()

    def returning(self, base: type[Any]) -> type[Any]:
        """`base` (uvicorn's httptools protocol, as serve configures it) for the
        connections handed over: once a response is complete and nothing more of the
        connection is pending (no request begun, none pipelined, every byte written), the
        connection goes back to the thread, which reads its next request. One
        `--max-connections` covers both sides: the protocol counts the thread's
        connections, the thread Python's (it hands a connection past the cap straight to
        Python, whose 503 says so)."""
        thread = self
        server = self.server

        class Returning(base):  # type: ignore[misc,valid-type]
            _begun = 0  # requests whose first byte came and whose last has not
            _kept = False  # never given back (see _take)

            def held_elsewhere(self) -> int:
                return server.connections()  # type: ignore[no-any-return]

            def connection_made(self, transport: Any) -> None:
                super().connection_made(transport)
                server.set_others(len(self.connections))

            def connection_lost(self, exc: Exception | None) -> None:
                super().connection_lost(exc)
                server.set_others(len(self.connections))

            def on_message_begin(self) -> None:
                self._begun += 1
                super().on_message_begin()

            def on_message_complete(self) -> None:
                self._begun -= 1
                super().on_message_complete()

            def on_response_complete(self) -> None:
                super().on_response_complete()
                thread._give_back(self)

        Returning.__name__ = Returning.__qualname__ = f"Returning{base.__name__}"
        return Returning

    def _give_back(self, protocol: Any) -> None:
        transport = protocol.transport
        cycle = protocol.cycle
        if (
            not self.running
            or protocol._kept
            or protocol._begun
            or protocol.pipeline
            or transport.is_closing()
            or transport.get_write_buffer_size()
            or (cycle is not None and not cycle.response_complete)
            or (cycle is not None and not cycle.keep_alive)
        ):
            return
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        fd = os.dup(sock.fileno())
        # Nothing is read between here and the thread's next read (this is the loop's
        # thread): bytes that came meanwhile wait in the socket for it.
        transport.pause_reading()
        if not self.server.adopt(fd):
            os.close(fd)
            transport.resume_reading()
            return
        transport.abort()  # the dup keeps the connection: the thread serves it now

    def _tick(self) -> None:
        try:
            self.refresh()
            self.read_samples()
        finally:
            if self.running and self._loop is not None:
                self._timer = self._loop.call_later(REFRESH, self._tick)

    def _take(self, stopping: bool = False) -> None:
        self.refresh()  # a stale answer is one reason to hand over: the next is right
        loop, protocol = self._loop, self._protocol
        assert loop is not None and protocol is not None
        for fd, data, bounced in self.server.take():
            sock = socket.socket(fileno=fd)

            def handed(data: bytes = data, bounced: bool = bounced) -> asyncio.Protocol:
                inner = protocol()
                # Back and over again with nothing answered in C: its requests are not
                # lookups (a health checker's, say); it stays here, not bounced each time.
                inner._kept = bounced  # type: ignore[attr-defined]
                return _Handed(inner, data, stopping)

            task = asyncio.ensure_future(loop.connect_accepted_socket(handed, sock))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._done, sock))

    def _done(self, sock: socket.socket, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is not None:
            sock.close()  # the connection failed while being set up (the peer left)


class LookupThreadCollector(Collector):
    """The thread's own counts, read when Prometheus scrapes."""

    def __init__(self, thread: LookupThread) -> None:
        self.thread = thread

    def collect(self) -> Iterator[Metric]:
        answered, handed, stale, dropped, returned = self.thread.counts()
        stages = self.thread.stages
        yield stages.metric()
        for name, text, value in (
            ("kvindex_lookup_thread_answered", "Lookups the C lookup thread answered.", answered),
            (
                "kvindex_lookup_thread_handed_over",
                "Connections the C lookup thread handed to Python (a request it does not "
                "take: another path, a refused or odd header, a body not of the plain shape, "
                "a slow request, the instances moved).",
                handed,
            ),
            (
                "kvindex_lookup_thread_given_back",
                "Connections given back to the C lookup thread once Python had answered "
                "the request it handed over.",
                returned,
            ),
            (
                "kvindex_lookup_thread_stale",
                "Lookups handed over because the index's publishers moved since the thread "
                "last had the instances.",
                stale,
            ),
            (
                "kvindex_lookup_thread_preempted",
                "Answers during whose walk the C lookup thread was switched out "
                "involuntarily (another thread took its core).",
                stages.preempted,
            ),
            (
                "kvindex_lookup_thread_blocked",
                "Answers during whose walk the C lookup thread waited (for the core's read "
                "lock, behind a batch being applied).",
                stages.blocked,
            ),
            (
                "kvindex_lookup_thread_samples_dropped",
                "Answers whose latency did not reach the lookup histogram (read too late).",
                dropped,
            ),
        ):
            yield CounterMetricFamily(name, text, value=value)
