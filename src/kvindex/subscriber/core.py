"""`Subscriber`: the sockets around `SourceState`, for one or many publishers.

One SUB socket per publisher (a SUB connected to several PUBs could not tell their seqs
apart), a fresh DEALER per replay request (a reused one would hand us late answers to an
earlier request), a socket monitor per SUB to see the link drop and come back, and one
poller over all of them, so a slow replay of one publisher never stalls another.

Use it as a blocking iterator, an async iterator, or step it with `poll()` from your own
loop. It yields `Delivery` (unpacks as `(instance, seq, batch)`) and `Notice` items.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvindex.security.curve import client_setup
from kvindex.subscriber.capacity import SocketBudget, budget_of, need_of, subscriber_context
from kvindex.subscriber.inorder import Applied, InOrder
from kvindex.subscriber.inorder import available as inorder_available
from kvindex.subscriber.linkwatch import LINK_EVENTS, LinkWatch
from kvindex.subscriber.messages import (
    Connection,
    DecodeFailed,
    Delivery,
    Discarded,
    Item,
    Malformed,
    Notice,
    ReplayRefused,
    SourceKey,
    SourceStats,
    Status,
    Unreachable,
)
from kvindex.subscriber.spec import InstanceSpec, SourceSpec
from kvindex.subscriber.state import (
    Checkpoint,
    Deliver,
    Output,
    ReplayPolicy,
    SourceState,
    StartReplay,
    StopReplay,
)
from kvindex.wire import (
    END_SEQ,
    BatchDecoder,
    EventBatch,
    WireError,
    parse_live,
    parse_replay,
    replay_request,
)

__all__ = ["DEFAULT_SUB_HWM", "Subscriber"]

DEFAULT_SUB_HWM = 100_000  # live messages queued per SUB socket before ZMQ drops new ones

log = logging.getLogger(__name__)

_DRAIN = 512  # messages taken from one socket before looking at the others
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


def _close_pair(sub: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
    try:
        sub.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(linger=0)
    sub.close(linger=0)


def recv_frames(sock: zmq.Socket[bytes]) -> list[bytes]:
    """`sock.recv_multipart(zmq.NOBLOCK)` without its per-frame option lookups (pyzmq
    turns each into an enum: a tenth of the cost of receiving a small batch)."""
    frames = [sock.recv(_NOBLOCK)]
    while sock.get(_RCVMORE):
        frames.append(sock.recv(_NOBLOCK))
    return frames


def _fast_receiver() -> Callable[[int, int], list[tuple[int, bytes | int]]] | None:
    """`_recv.recv_live` when it was built and found pyzmq's libzmq; KVINDEX_PURE=1 (or no
    compiler at install time) reads with pyzmq."""
    if os.environ.get("KVINDEX_PURE", "") not in ("", "0"):
        return None
    try:
        from kvindex.subscriber import _recv
    except ImportError:
        return None
    return _recv.recv_live if _recv.available() else None


_recv_live = _fast_receiver()


def _c_ingest() -> Callable[..., tuple[int, tuple[int, bytes | int] | None, float, float]] | None:
    """`_recv.ingest_live` (the in-order path in C) where the C receive is used."""
    if _recv_live is None:
        return None
    from kvindex.subscriber import _recv

    return _recv.ingest_live


_ingest_live = _c_ingest()


# The link is up once the ZMTP handshake succeeded, for every mechanism: a TCP connection
# the server then refuses (CURVE on one side only, a key ZAP turned away) must not look like
# a publisher that came and went (which renews the socket: thousands of times a second).
_REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)
_LINK_STATE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED)
_UNDECODED = EventBatch(0.0, [])  # the batch of a `decode=False` Delivery: see its payload


@dataclass(slots=True)
class _SourceSockets:
    spec: SourceSpec
    state: SourceState
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    decoder: BatchDecoder
    link: LinkWatch
    dealer: zmq.Socket[bytes] | None = None
    dealer_req: int = 0
    renew_at: float | None = None  # when to try again to renew a SUB that could not be
    inorder: InOrder | None = None  # the in-order path in C, when `apply_in_c` is on


@dataclass(frozen=True, slots=True)
class _InC:
    api: object  # the core's capsule (Core.ingest_api())
    core: object  # the Core it applies to
    bit_of: Callable[[SourceKey], int | None]  # a publisher's bit, None before its first batch
    keep_payloads: bool = False  # the batches C applied are handed over with their payloads


@dataclass(slots=True)
class _Options:
    policy: ReplayPolicy = field(default_factory=ReplayPolicy)
    rcvhwm: int = DEFAULT_SUB_HWM
    max_payload: int = 64 * 1024 * 1024
    decode: bool = True


class Subscriber:
    """Follows vLLM KV-event publishers and yields every batch once, in order, decoded.

    >>> with Subscriber("tcp://127.0.0.1:5557", replay="tcp://127.0.0.1:5558") as sub:
    ...     for item in sub:
    ...         match item:
    ...             case Delivery(): instance, seq, batch = item
    ...             case Restarted(): ...  # drop what you know of item.instance
    """

    def __init__(
        self,
        endpoint: str | None = None,
        replay: str | None = None,
        *,
        topic: str = "",
        name: str = "vllm",
        dp: int = 1,
        instances: Iterable[InstanceSpec] = (),
        resume: Mapping[SourceKey, Checkpoint] | None = None,
        policy: ReplayPolicy | None = None,
        rcvhwm: int = DEFAULT_SUB_HWM,
        max_payload: int = 64 * 1024 * 1024,
        keep_payload: bool = False,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        decode: bool = True,
        catch_up: bool = True,
    ) -> None:
        """`decode=False` passes every payload through undecoded (`Delivery.payload`, an
        empty `batch`, no DecodeFailed): what a relay needs, which forwards batches as
        they came. `catch_up=False` starts each publisher not resumed at its first live
        batch instead of with its replay buffer (`kvindex record --from now`).

        `rcvhwm` bounds the live messages queued on each SUB socket: past it, ZMQ drops
        new ones (a gap, then filled by a replay). Sockets are made on `context`, by
        default one shared by the process's subscribers whose socket limit is raised
        (`kvindex.subscriber.capacity`; an `inproc://` publisher needs its own context
        passed here)."""
        self._ctx = context or subscriber_context()
        self._budget = budget_of(self._ctx)
        self._opts = _Options(policy or ReplayPolicy(), rcvhwm, max_payload, decode)
        self._keep_payload = keep_payload  # for recorders and stores that persist raw batches
        self._catch_up = catch_up
        self._resume = dict(resume or {})
        self._sources: dict[SourceKey, _SourceSockets] = {}
        self._by_socket: dict[zmq.Socket[bytes], _SourceSockets] = {}
        self._poller = zmq.Poller()
        self._wake_fd: int | None = None
        self._instances: dict[str, InstanceSpec] = {}
        self._closed = False
        self._in_c: _InC | None = None
        self._applied: list[Applied] = []
        self._touched: set[SourceKey] = set()  # sources Python produced items for, this poll
        self.c_seconds = 0.0  # CPU time in the C loop without the GIL (GIL accounting)
        self.c_apply_seconds = 0.0  # the part of it applying, under the index's write lock
        # Called with each `Unreachable`, `ReplayRefused` and `Discarded` notice too (they
        # are yielded as well): for a caller that applies items without reading notices,
        # e.g. to log them (`kvindex serve`). Each is rare: at most one a minute, or one per
        # replay backoff.
        self.link_hooks: list[Callable[[Notice], None]] = []
        specs = list(instances)
        if endpoint is not None:
            specs.insert(0, InstanceSpec(name, endpoint, replay, topic, dp))
        for spec in specs:
            self.add_instance(spec)

    # -- fleet membership --------------------------------------------------------------

    def add_instance(self, spec: InstanceSpec) -> list[Item]:
        """Follow an instance (all its DP ranks), or nothing: raises ValueError if the name
        is taken, `CapacityError` if its sockets don't fit in this process (see
        `kvindex.subscriber.capacity`), zmq.ZMQError if one can't be opened anyway; then
        nothing of it is left open."""
        if spec.name in self._instances:
            raise ValueError(f"instance {spec.name!r} is already followed")
        sources = spec.sources()
        need = need_of(len(sources), spec.replay_endpoint is not None)
        self._budget.reserve(id(self), spec.name, need)
        opened: list[_SourceSockets] = []
        try:
            for source_spec in sources:
                opened.append(self._open_source(source_spec))
        except BaseException:
            for src in opened:
                self._close_source(self._sources.pop(src.spec.source))
            self._budget.release(id(self), spec.name)
            raise
        self._instances[spec.name] = spec
        items: list[Item] = []
        now = time.monotonic()
        for src in opened:
            self._handle(src, src.state.start(now), items)
        return items

    def change_instance(self, spec: InstanceSpec) -> tuple[list[Item], list[SourceKey]]:
        """Follow `spec` in place of the instance of that name (an engine whose publishers
        changed: more or fewer DP ranks, other ports), keeping the ranks whose publisher
        is the same: their sockets, seqs and state go on untouched. Returns the items the
        new ranks start with, and the ranks closed (gone, or moved: what was known of them
        is void). Raises `CapacityError` (nothing changed) if the new ranks don't fit; if
        one can't be opened anyway (zmq.ZMQError), the instance is no longer followed."""
        old = self._instances[spec.name].sources()
        new = spec.sources()
        need = need_of(len(new), spec.replay_endpoint is not None)
        self._budget.reserve(id(self), spec.name, need)  # in place of what it held
        closed = [s.source for s in old if s not in new]
        for source in closed:
            self._close_source(self._sources.pop(source))
        self._instances[spec.name] = spec
        opened: list[_SourceSockets] = []
        try:
            for source_spec in new:
                if source_spec not in old:
                    opened.append(self._open_source(source_spec))
        except BaseException:
            del self._instances[spec.name]
            for source in [k for k in self._sources if k.instance == spec.name]:
                self._close_source(self._sources.pop(source))
            self._budget.release(id(self), spec.name)
            raise
        items: list[Item] = []
        now = time.monotonic()
        for src in opened:
            self._handle(src, src.state.start(now), items)
        return items, closed

    def remove_instance(self, name: str) -> None:
        spec = self._instances.pop(name)
        for source_spec in spec.sources():
            self._close_source(self._sources.pop(source_spec.source))
        self._budget.release(id(self), name)

    @property
    def budget(self) -> SocketBudget:
        """The sockets and descriptors the subscribers of this one's context may hold."""
        return self._budget

    @property
    def instances(self) -> dict[str, InstanceSpec]:
        return dict(self._instances)

    def follows(self, name: str) -> bool:
        """Whether the instance of that name is followed (cheap: per item read)."""
        return name in self._instances

    def sources(self) -> list[SourceKey]:
        return list(self._sources)

    def stats(self, source: SourceKey) -> SourceStats:
        return self._sources[source].state.stats

    def status(self, source: SourceKey) -> Status:
        return self._sources[source].state.status

    def checkpoint(self, source: SourceKey) -> Checkpoint:
        """Where `source` stands (on the thread that polls, while the C path is on)."""
        src = self._sources[source]
        if src.inorder is not None:
            return src.inorder.checkpoint()
        return src.state.checkpoint()

    # -- the in-order path in C ----------------------------------------------------------

    @property
    def in_c(self) -> bool:
        return self._in_c is not None

    @property
    def keeps_payloads(self) -> bool:
        """Whether the C path hands over the payloads of the batches it applied."""
        return self._in_c is not None and self._in_c.keep_payloads

    def apply_in_c(
        self,
        api: object,
        core: object,
        bit_of: Callable[[SourceKey], int | None],
        keep_payloads: bool = False,
    ) -> bool:
        """Have every live batch that is the one due applied to the compiled `core` in C,
        through its `api` capsule, without Python (subscriber/inorder.py); the batches C
        applied are reported by `take_applied`, not as items, with their payloads if
        `keep_payloads` (a persistent store logs them). False (and nothing changes) where
        the C receive is not available. Call on the thread that polls."""
        if _ingest_live is None or not inorder_available():
            return False
        self._in_c = _InC(api, core, bit_of, keep_payloads)
        for src in self._sources.values():
            if src.inorder is not None and src.inorder.keep_payloads != keep_payloads:
                self._py(src)  # what it holds is handed over first
                src.inorder = None
            if src.inorder is None:
                src.inorder = InOrder(src.state, self._applied, keep_payloads)
        return True

    def apply_in_python(self) -> None:
        """Every batch through the Python path again (`apply_in_c` undone)."""
        self._in_c = None
        for src in self._sources.values():
            self._py(src)
            src.inorder = None

    def take_applied(self) -> list[Applied]:
        """The batches the C path applied since the last call, per publisher and read."""
        applied = self._applied[:]  # the InOrders hold this very list
        self._applied.clear()
        return applied

    # -- iteration ---------------------------------------------------------------------

    def poll(self, timeout: float | None = 0.1, max_messages: int = _DRAIN) -> list[Item]:
        """Wait up to `timeout` seconds for socket activity; return what it produced.

        `max_messages` bounds the live messages taken from each socket in this call, so a
        caller sharing an event loop can keep each step short.
        """
        items: list[Item] = []
        now = time.monotonic()
        wait = self._wait_ms(timeout, now)
        if self._sources or self._wake_fd is not None:
            ready = dict(self._poller.poll(wait))
        else:
            ready = {}
            if wait:
                time.sleep(wait / 1000)
        self._process(ready, items, max_messages)
        return items

    def wake_on(self, fd: int) -> None:
        """Have `poll` also return (with what it has) as soon as `fd` is readable: another
        thread's way to interrupt a wait. The caller drains the fd."""
        self._wake_fd = fd
        self._poller.register(fd, zmq.POLLIN)

    def sockets(self) -> list[zmq.Socket[bytes]]:
        """Every socket in use now (SUBs, monitors, replay DEALERs): for external pollers."""
        return list(self._by_socket)

    def __iter__(self) -> Iterator[Item]:
        while not self._closed:
            yield from self.poll(0.5)

    async def __aiter__(self) -> AsyncIterator[Item]:
        while not self._closed:
            items = self.poll(0)
            if items:
                for item in items:
                    yield item
                continue
            await self._wait_async(self._wait_ms(0.5, time.monotonic()))

    async def _wait_async(self, timeout_ms: int) -> None:
        if not self._by_socket:
            await asyncio.sleep(timeout_ms / 1000)
            return
        # Fresh shadows per wait: a cached shadow keeps its fd registered with the loop after
        # its socket closes, and a later socket reusing that fd number would never wake us.
        poller = zmq.asyncio.Poller()
        shadows = [zmq.asyncio.Socket.shadow(sock.underlying) for sock in self._by_socket]
        for shadow in shadows:
            poller.register(shadow, zmq.POLLIN)
        try:
            await poller.poll(timeout_ms)
        finally:
            for shadow in shadows:
                poller.unregister(shadow)

    def close(self) -> None:
        """Close every socket. Counters and status stay readable afterwards."""
        self._closed = True
        for src in list(self._sources.values()):
            self._close_source(src)
        for name in self._instances:
            self._budget.release(id(self), name)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sockets -----------------------------------------------------------------------

    def _open_source(self, spec: SourceSpec) -> _SourceSockets:
        state = SourceState(
            spec.source,
            has_replay=spec.replay_endpoint is not None,
            resume=self._resume.get(spec.source),
            policy=self._opts.policy,
            catch_up=self._catch_up,
        )
        sub, monitor = self._connect_sub(spec)
        link = LinkWatch(spec.endpoint, spec.curve is not None, time.monotonic())
        src = _SourceSockets(spec, state, sub, monitor, BatchDecoder(self._opts.max_payload), link)
        if self._in_c is not None:
            src.inorder = InOrder(state, self._applied, self._in_c.keep_payloads)
        self._sources[spec.source] = src
        self._watch(src)
        return src

    def _connect_sub(self, spec: SourceSpec) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._opts.rcvhwm)
            sub.setsockopt(zmq.MAXMSGSIZE, self._opts.max_payload + 4096)
            if spec.curve is not None:
                client_setup(sub, spec.curve)
            monitor = sub.get_monitor_socket(LINK_EVENTS)
        except BaseException:
            sub.close(linger=0)
            raise
        try:
            sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
            sub.connect(spec.endpoint)
        except BaseException:
            _close_pair(sub, monitor)
            raise
        return sub, monitor

    def _watch(self, src: _SourceSockets) -> None:
        for sock in (src.monitor, src.sub):
            self._by_socket[sock] = src
            self._poller.register(sock, zmq.POLLIN)

    def _close_sub(self, src: _SourceSockets) -> None:
        for sock in (src.monitor, src.sub):
            self._forget(sock)
        _close_pair(src.sub, src.monitor)

    def _renew_sub(self, src: _SourceSockets) -> None:
        """Follow the publisher on a fresh SUB: whatever the new socket receives was sent on
        the new connection, never mixed with leftovers of the old one. The new one is made
        first: if it can't be (no descriptor free), the old one goes on (ZMQ reconnects
        it; the reconnect check still runs) and the renewal is tried again in a second."""
        try:
            sub, monitor = self._connect_sub(src.spec)
        except zmq.ZMQError as exc:
            log.warning("%r: can't renew the SUB socket (%s); keeping the old one", src, exc)
            src.renew_at = time.monotonic() + 1.0
            return
        src.renew_at = None
        self._close_sub(src)
        src.sub, src.monitor = sub, monitor
        self._watch(src)

    def _close_source(self, src: _SourceSockets) -> None:
        self._py(src)
        # Its state handed back: the C Sequencer (its digest ring) goes with the link, not
        # with this object (serve keeps it to the process's end: gc.freeze).
        src.inorder = None
        self._stop_replay(src)
        self._close_sub(src)

    def _forget(self, sock: zmq.Socket[bytes]) -> None:
        self._by_socket.pop(sock, None)
        try:
            self._poller.unregister(sock)
        except KeyError:
            pass

    def _start_replay(self, src: _SourceSockets, req: StartReplay, items: list[Item]) -> None:
        self._stop_replay(src)
        assert src.spec.replay_endpoint is not None
        try:
            dealer = self._open_dealer(src.spec, src.spec.replay_endpoint)
        except zmq.ZMQError as exc:
            # No socket for it now (descriptors exhausted by something else): the request
            # fails like one that got no answer; ingest goes on.
            why = f"can't open a replay socket: {exc}"
            failed = src.state.on_replay_error(req.req_id, why, time.monotonic(), False)
            self._handle(src, failed, items)
            return
        try:
            # Never block: a peer that refused our handshake (CURVE vs plain, a key ZAP
            # turned away) leaves no pipe to queue on. Unsent, the request times out.
            dealer.send_multipart(replay_request(req.start), zmq.NOBLOCK)
        except zmq.Again:
            pass
        src.dealer, src.dealer_req = dealer, req.req_id
        self._by_socket[dealer] = src
        self._poller.register(dealer, zmq.POLLIN)

    def _open_dealer(self, spec: SourceSpec, endpoint: str) -> zmq.Socket[bytes]:
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            # Bounded: a replay endpoint that streams faster than we apply waits (or, a
            # ROUTER, drops what does not fit, which the seq checks then see).
            dealer.setsockopt(zmq.RCVHWM, self._opts.policy.reply_queue)
            dealer.setsockopt(zmq.MAXMSGSIZE, self._opts.max_payload + 4096)
            if spec.curve is not None:
                client_setup(dealer, spec.curve)
            dealer.connect(endpoint)
        except BaseException:
            dealer.close(linger=0)
            raise
        return dealer

    def _stop_replay(self, src: _SourceSockets) -> None:
        if src.dealer is not None:
            self._forget(src.dealer)
            src.dealer.close(linger=0)
            src.dealer = None

    # -- the loop ----------------------------------------------------------------------

    def _wait_ms(self, timeout: float | None, now: float) -> int:
        wait = 3_600.0 if timeout is None else timeout
        for src in self._sources.values():
            for deadline in (src.state.next_deadline, src.link.next_deadline, src.renew_at):
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - now))
        return int(wait * 1000 + 0.999)

    def _process(
        self, ready: Mapping[zmq.Socket[bytes], int], items: list[Item], limit: int = _DRAIN
    ) -> None:
        self._touched.clear()  # every item of an earlier poll is applied by now
        # Connection changes first: a link that went down must be seen before more traffic.
        sockets = list(ready)
        for sock in sockets:
            src = self._by_socket.get(sock)
            if src is not None and sock is src.monitor:
                self._read_monitor(src, items)
        for sock in sockets:
            src = self._by_socket.get(sock)
            if src is None:
                continue
            if sock is src.sub:
                self._read_live(src, items, limit)
            elif sock is src.dealer:
                self._read_replay(src, items)
        now = time.monotonic()
        for src in list(self._sources.values()):
            deadline = src.state.next_deadline
            if deadline is not None and now >= deadline:
                self._py(src)
                self._handle(src, src.state.on_tick(now), items)
            deadline = src.link.next_deadline
            if deadline is not None and now >= deadline:
                self._report_link(src, src.link.on_tick(now), now, items)
            if src.renew_at is not None and now >= src.renew_at:
                self._renew_sub(src)

    def _py(self, src: _SourceSockets) -> None:
        """Python decides for `src` next: the C path hands its state back first."""
        if src.inorder is not None:
            src.inorder.disarm()

    def _c_may(self, src: _SourceSockets) -> bool:
        """Whether the C path may take `src`'s batches now: on, armed or armable, and no
        item of `src` from this poll still waiting to be applied (C would overtake it)."""
        inorder, in_c = src.inorder, self._in_c
        if inorder is None or in_c is None or src.spec.source in self._touched:
            return False
        if inorder.armed:
            return True
        bit = in_c.bit_of(src.spec.source)
        return bit is not None and inorder.arm(bit)

    def _read_live(self, src: _SourceSockets, items: list[Item], limit: int = _DRAIN) -> None:
        while limit > 0 and self._c_may(src):
            limit = self._read_live_c(src, items, limit)
        if limit <= 0:
            return
        self._py(src)
        if _recv_live is not None:
            self._read_live_many(src, items, limit)
            return
        state = src.state
        for _ in range(limit):
            try:
                frames = recv_frames(src.sub)
            except zmq.Again:
                return
            try:
                frame = parse_live(frames)
            except WireError as exc:
                self._malformed(src, str(exc), items)
                continue
            self._handle(src, state.on_live(frame.seq, frame.payload, time.monotonic()), items)

    def _read_live_c(self, src: _SourceSockets, items: list[Item], limit: int) -> int:
        """Up to `limit` live messages through the C path, until the first one it does not
        take, which Python then decides. Returns the limit left: 0 once the socket is dry."""
        assert _ingest_live is not None and self._in_c is not None and src.inorder is not None
        in_c, inorder = self._in_c, src.inorder
        address = src.sub.underlying
        while limit > 0:
            chunk = min(limit, _DRAIN)
            try:
                taken, stop, seconds, applying = _ingest_live(
                    address, inorder.sequencer, in_c.api, in_c.core, chunk
                )
            except OSError as exc:
                inorder.sync()
                raise zmq.ZMQError(exc.errno) from None
            self.c_seconds += seconds
            self.c_apply_seconds += applying
            limit -= taken
            if stop is not None:
                inorder.disarm()
                limit -= 1
                seq, payload = stop
                if isinstance(payload, int):  # not [topic, seq, payload]: its frame count
                    self._malformed(src, f"live message of {payload} frames, expected 3", items)
                else:
                    self._handle(src, src.state.on_live(seq, payload, time.monotonic()), items)
                return limit
            if taken < chunk:
                break
        inorder.sync()
        return 0

    def _read_live_many(self, src: _SourceSockets, items: list[Item], limit: int) -> None:
        """`_read_live` with the frames read in C, many messages per call (_recv.c)."""
        assert _recv_live is not None
        state = src.state
        address = src.sub.underlying
        while limit > 0:
            try:
                messages = _recv_live(address, min(limit, _DRAIN))
            except OSError as exc:
                raise zmq.ZMQError(exc.errno) from None
            if not messages:
                return
            limit -= len(messages)
            now = time.monotonic()
            for seq, payload in messages:
                if isinstance(payload, int):  # not [topic, seq, payload]: its frame count
                    self._malformed(src, f"live message of {payload} frames, expected 3", items)
                else:
                    self._handle(src, state.on_live(seq, payload, now), items)

    def _read_replay(self, src: _SourceSockets, items: list[Item]) -> None:
        self._py(src)
        for _ in range(_DRAIN):
            dealer = src.dealer
            if dealer is None:
                return
            try:
                frames = recv_frames(dealer)
            except zmq.Again:
                return
            now = time.monotonic()
            try:
                frame = parse_replay(frames)
            except WireError as exc:
                # No publisher sends that: the endpoint is not a replay socket, or broken.
                self._malformed(src, str(exc), items)
                why = f"a reply that is no replay reply ({exc})"
                self._handle(src, src.state.on_replay_error(src.dealer_req, why, now, True), items)
                return
            if frame.seq == END_SEQ:
                outputs = src.state.on_replay_end(src.dealer_req, now)
            else:
                outputs = src.state.on_replay_frame(src.dealer_req, frame.seq, frame.payload, now)
            self._handle(src, outputs, items)

    def _read_monitor(self, src: _SourceSockets, items: list[Item]) -> None:
        self._py(src)
        while True:
            try:
                frames = src.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = parse_monitor_message(frames)
            event, now = message["event"], time.monotonic()
            self._report_link(src, src.link.on_event(event, int(message["value"]), now), now, items)
            if event in _REFUSED_EVENTS:
                src.state.stats.handshake_failures += 1
                continue
            if event not in _LINK_STATE_EVENTS:
                continue
            connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if connected == src.state.stats.connected:
                continue
            if not connected:
                # Everything the old connection brought is applied before the link is
                # reported down; then a fresh socket takes over.
                self._read_live(src, items, limit=1 << 62)
            self._py(src)
            items.append(Connection(src.spec.source, connected))
            self._handle(src, src.state.on_connection(connected, time.monotonic()), items)
            if not connected:
                self._renew_sub(src)
                return

    def _report_link(
        self, src: _SourceSockets, problem: str | None, now: float, items: list[Item]
    ) -> None:
        src.state.stats.problem = src.link.problem
        if problem is None:
            return
        seconds = max(0.0, now - src.link.since)
        notice = Unreachable(src.spec.source, src.spec.endpoint, problem, seconds)
        items.append(notice)
        for hook in list(self.link_hooks):
            hook(notice)

    def _malformed(self, src: _SourceSockets, error: str, items: list[Item]) -> None:
        src.state.stats.malformed_messages += 1
        items.append(Malformed(src.spec.source, error))

    def _handle(self, src: _SourceSockets, outputs: list[Output], items: list[Item]) -> None:
        if outputs:
            self._touched.add(src.spec.source)
        for out in outputs:
            if isinstance(out, Deliver):
                items.append(self._decode(src, out))
            elif isinstance(out, Notice):
                items.append(out)
                if isinstance(out, ReplayRefused | Discarded):
                    for hook in list(self.link_hooks):
                        hook(out)
            elif isinstance(out, StartReplay):
                self._start_replay(src, out, items)
            elif isinstance(out, StopReplay) and src.dealer_req == out.req_id:
                self._stop_replay(src)

    def _decode(self, src: _SourceSockets, out: Deliver) -> Item:
        stats = src.state.stats
        if not self._opts.decode:
            size = len(out.payload)
            return Delivery(src.spec.source, out.seq, _UNDECODED, out.replayed, size, out.payload)
        try:
            batch = src.decoder.decode(out.payload)
        except WireError as exc:
            stats.decode_errors += 1
            return DecodeFailed(src.spec.source, out.seq, str(exc))
        if batch.malformed_events:
            stats.decode_errors += batch.malformed_events
        if batch.unknown_events:
            stats.unknown_events += batch.unknown_events
        stats.last_ts = batch.ts
        payload = out.payload if self._keep_payload else None
        return Delivery(src.spec.source, out.seq, batch, out.replayed, len(out.payload), payload)
