"""`Fleet`: one Subscriber and one FleetIndex, ingested in the HTTP server's own event loop.

Why one loop and no thread: the index is plain Python, so an ingest thread would hold the
GIL for up to a switch interval (5 ms) while a lookup waits. Instead ingest is a task that
works in slices of about a millisecond and then yields (`await asyncio.sleep(0)`), so a
request that arrived meanwhile runs between two slices; when there is nothing to read it
awaits the sockets' readiness, costing nothing. Every read or change of the index happens
on the loop's thread, so lookups see a consistent state without locks.

Waiting on readiness: each ZMQ socket exposes an edge-triggered file descriptor. The task
waits on those descriptors (`loop.add_reader`) only after checking that no socket has a
message left (that check re-arms the edge), and unregisters them after every wait, so a
socket the Subscriber closes (a finished replay, a renewed SUB, a removed instance) never
leaves a stale registration behind for a later socket that reuses its descriptor number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from kvindex.index import CacheStats, FleetIndex, LookupRow
from kvindex.index.sharing import Sharing, sharing
from kvindex.runtime.views import (
    FleetSummary,
    InstanceMatch,
    InstanceView,
    LookupAnswer,
    RankMatch,
    RankView,
    worst_status,
)
from kvindex.subscriber import (
    Checkpoint,
    Delivery,
    InstanceSpec,
    Item,
    ReplayPolicy,
    Restarted,
    SourceKey,
    SourceStats,
    Status,
    Subscriber,
)
from kvindex.wire import BlockHash

__all__ = [
    "DuplicateInstance",
    "Fleet",
    "IngestStats",
    "MembershipChange",
    "MembershipFeed",
    "UnknownInstance",
]

log = logging.getLogger(__name__)

ItemHook = Callable[[Item], None]
RemoveHook = Callable[[str], None]


class DuplicateInstance(ValueError):
    """An instance of that name is already followed."""


class UnknownInstance(KeyError):
    """No instance of that name is followed."""


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """An instance added (`spec`) or removed (`spec` None) somewhere else: by another
    replica sharing this one's store."""

    name: str
    spec: InstanceSpec | None


class MembershipFeed(Protocol):
    """Where changes of the fleet made elsewhere come from (a shared store's Subscriber).

    The Fleet takes them after every read of its Subscriber and applies them itself; the
    feed holds back the input that follows a change until the change is taken, so a new
    instance's first batch never arrives before the instance."""

    def membership_changes(self) -> list[MembershipChange]:
        """The changes read since the last call, in order (and lets input flow again)."""
        ...


@dataclass(slots=True)
class _Counts:
    stats: CacheStats  # `active` = distinct hashes over all mediums
    by_medium: dict[str, int]


@dataclass(slots=True)
class IngestStats:
    """How the ingest task is doing: for `/v1/stats` and the metrics."""

    items: int = 0
    deliveries: int = 0
    slices: int = 0
    waits: int = 0
    errors: int = 0
    hook_errors: int = 0
    longest_slice_seconds: float = 0.0


@dataclass(slots=True)
class _Wait:
    future: asyncio.Future[None]
    fds: list[int] = field(default_factory=list)


class Fleet:
    """Follows a set of vLLM instances and keeps their exact state, inside an event loop.

    Call `start()` from the loop that serves requests and `stop()` before it closes.
    `on_item` hooks see every item after the index applied it (a store layer can persist
    from there); `on_add` and `on_remove` hooks see every instance added or removed here
    at runtime (not those a `membership` feed reports: they were made elsewhere).
    """

    def __init__(
        self,
        instances: Iterable[InstanceSpec] = (),
        *,
        policy: ReplayPolicy | None = None,
        rate_window: float = 60.0,
        slice_seconds: float = 0.001,
        idle_wait: float = 0.05,
        index: FleetIndex | None = None,
        resume: Mapping[SourceKey, Checkpoint] | None = None,
        keep_payload: bool = False,
        subscriber: Subscriber | None = None,
        membership: MembershipFeed | None = None,
    ) -> None:
        # `index` and `resume` come from a store's warm start: the state as persisted, and
        # where each publisher's stream continues. A shared store brings its own
        # `subscriber`, which also yields the batches other replicas ingest, and the
        # `membership` feed of the instances they add and remove.
        self.subscriber = subscriber or Subscriber(
            policy=policy, resume=resume, keep_payload=keep_payload
        )
        self.index = index if index is not None else FleetIndex(rate_window=rate_window)
        self._membership = membership
        self.on_item: list[ItemHook] = []
        self.on_remove: list[RemoveHook] = []
        self.on_add: list[Callable[[InstanceSpec], None]] = []  # runtime additions only
        self.ingest = IngestStats()
        self._slice = slice_seconds
        # Requests waiting for the loop that ingest should make way for (lookups, counted
        # by the HTTP layer): while there are any, slices are a tenth as long, so a lookup
        # needing several loop turns does not wait a whole slice at each.
        self.urgent = 0
        self._idle_wait = idle_wait  # also how often replay deadlines are checked when idle
        self._specs: dict[str, InstanceSpec] = {}  # the Subscriber's own map is copied per read
        self._ranks: dict[str, list[SourceKey]] = {}
        self._backlog: deque[Item] = deque()
        self._lag: dict[SourceKey, float] = {}
        self._counts: dict[str, _Counts] = {}  # per instance, valid until it changes
        self._task: asyncio.Task[None] | None = None
        self._wait: _Wait | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        for spec in instances:
            self.add_instance(spec)

    # -- membership --------------------------------------------------------------------

    @property
    def specs(self) -> dict[str, InstanceSpec]:
        """The instances followed, by name (read-only: use add/remove_instance)."""
        return self._specs

    def has_instance(self, name: str) -> bool:
        return name in self._specs

    def add_instance(self, spec: InstanceSpec) -> None:
        """Follow a new instance now; raises DuplicateInstance if the name is taken."""
        self._add(spec)
        for hook in list(self.on_add):
            self._call_hook(hook, spec)

    def remove_instance(self, name: str) -> None:
        """Stop following an instance and forget its state; raises UnknownInstance."""
        self._remove(name)
        for hook in list(self.on_remove):
            self._call_hook(hook, name)

    def _add(self, spec: InstanceSpec) -> None:
        if self.has_instance(spec.name):
            raise DuplicateInstance(f"instance {spec.name!r} already exists")
        self._interrupt_wait()  # the wait in progress does not watch the new sockets
        self._backlog.extend(self.subscriber.add_instance(spec))
        self._specs[spec.name] = spec
        self._ranks[spec.name] = [source.source for source in spec.sources()]
        self._counts.pop(spec.name, None)

    def _remove(self, name: str) -> None:
        if not self.has_instance(name):
            raise UnknownInstance(name)
        self._interrupt_wait()  # before its sockets close under a registered reader
        self.subscriber.remove_instance(name)
        del self._specs[name], self._ranks[name]
        self.index.remove_instance(name)
        self._backlog = deque(i for i in self._backlog if i.source.instance != name)
        self._lag = {k: v for k, v in self._lag.items() if k.instance != name}
        self._counts.pop(name, None)

    def _follow_membership(self, feed: MembershipFeed) -> None:
        """Apply the changes made elsewhere (no hooks: they are not this replica's news)."""
        for change in feed.membership_changes():
            try:
                if change.spec is None:
                    if self.has_instance(change.name):
                        self._remove(change.name)
                elif not self.has_instance(change.name):
                    self._add(change.spec)
            except (ValueError, KeyError, zmq.ZMQError) as exc:
                log.warning("could not follow the fleet change of %s: %s", change.name, exc)

    # -- views -------------------------------------------------------------------------

    def status(self, name: str) -> Status:
        """The worst status among the instance's DP ranks (cheap: no block counting)."""
        ranks = self._ranks.get(name)
        if ranks is None:
            raise UnknownInstance(name)
        return worst_status(self.subscriber.status(source) for source in ranks)

    def instance_views(self) -> list[InstanceView]:
        return [self.instance_view(name) for name in sorted(self._specs)]

    def instance_view(self, name: str) -> InstanceView:
        spec = self._specs.get(name)
        if spec is None:
            raise UnknownInstance(name)
        ranks = [self._rank_view(source) for source in self._ranks[name]]
        counts = self._counts_of(name)
        stats = counts.stats
        return InstanceView(
            spec=spec,
            status=worst_status(r.status for r in ranks),
            ranks=ranks,
            blocks=stats.active,
            blocks_by_medium=dict(counts.by_medium),
            stored=stats.stored,
            removed=stats.removed,
            clears=stats.clears,
            batches=stats.batches,
        )

    def _rank_view(self, source: SourceKey) -> RankView:
        stats: SourceStats = self.subscriber.stats(source)
        # The last seq the *index* applied: what the blocks and lookups answered next
        # reflect (the Subscriber may have delivered more into the backlog already).
        applied_seq, _ = self.index.source_state(source)
        return RankView(
            rank=source.rank,
            status=self.subscriber.status(source),
            last_seq=applied_seq if applied_seq is not None else stats.last_seq,
            gaps=stats.gaps,
            received=stats.received,
            delivered=stats.delivered,
            replayed_batches=stats.replayed_batches,
            lost_batches=stats.lost_batches,
            decode_errors=stats.decode_errors,
            publisher_restarts=stats.publisher_restarts,
            last_batch_ts=stats.last_ts,
            ingest_lag_seconds=self._lag.get(source),
            problem=stats.problem,
        )

    def _counts_of(self, name: str) -> _Counts:
        # Distinct counts need a union over ranks and groups: O(blocks). They are kept until
        # the instance changes, so an idle fleet is scraped and listed for free.
        counts = self._counts.get(name)
        if counts is None:
            counts = _Counts(self.index.cache_stats(name), self.index.blocks_by_medium(name))
            self._counts[name] = counts
        return counts

    def summary(self, views: list[InstanceView] | None = None) -> FleetSummary:
        """Totals over the fleet (from `views` when the caller has them already)."""
        views = self.instance_views() if views is None else views
        return FleetSummary.of(views, entries=self.index.entries(), backlog=self.backlog)

    def rates_per_minute(self) -> dict[str, float]:
        """Stores, removes and clears per minute over the index's rate window."""
        return self.index.rates.per_minute()

    def block_hashes(self, name: str, medium: str | None = None) -> set[BlockHash]:
        """Every distinct block hash the instance holds now (all ranks); raises
        UnknownInstance."""
        if not self.has_instance(name):
            raise UnknownInstance(name)
        return self.index.block_hashes(name, medium)

    def sharing(self, max_instances: int, max_nodes: int) -> Sharing:
        """Which instances hold the same blocks, and the hottest shared prefixes: over the
        `max_instances` largest instances, walking at most `max_nodes` tree nodes."""
        names = self.index.instances()
        if len(names) > max_instances:
            names = sorted(names, key=self.index.block_count, reverse=True)
            names = sorted(names[:max_instances])
        return sharing(self.index, instances=names, max_nodes=max_nodes)

    # -- lookups -----------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], lora_name: str | None = None) -> LookupAnswer:
        """Per instance, the longest cached prefix of the prompt, in whole blocks from its
        first token; rows best first."""
        return self._answer(self.index.lookup(token_ids, lora_name), by_tokens=True)

    def lookup_hashes(self, block_hashes: Sequence[BlockHash]) -> LookupAnswer:
        """Per instance, how many of these block hashes, from the first, it holds now."""
        return self._answer(self.index.lookup_hashes(block_hashes), by_tokens=False)

    def _answer(self, rows: list[LookupRow], by_tokens: bool) -> LookupAnswer:
        """One row per followed instance (0 where it holds nothing yet), best first; `best`
        is never a `down` instance (its engine is unreachable)."""
        found = {row.instance: row for row in rows}
        out = [self._match(spec, found.get(name), by_tokens) for name, spec in self._specs.items()]
        out.sort(key=lambda r: (-r.matched_blocks, r.name))
        best = next((r.name for r in out if r.matched_blocks > 0 and r.status != Status.DOWN), None)
        return LookupAnswer(best, out)

    def _match(self, spec: InstanceSpec, row: LookupRow | None, by_tokens: bool) -> InstanceMatch:
        ranks = dict.fromkeys(range(spec.dp), 0)
        if row is not None:
            ranks.update(row.ranks)
        size = row.block_size if row is not None and row.matched_blocks else None
        matched = row.matched_blocks if row is not None else 0
        return InstanceMatch(
            name=spec.name,
            status=self.status(spec.name),
            matched_blocks=matched,
            matched_tokens=matched * (size or 0) if by_tokens else None,
            block_size=size if by_tokens else None,
            best_rank=row.best_rank if row is not None else 0,
            ranks=[RankMatch(r, n) for r, n in sorted(ranks.items())],
        )

    # -- ingest ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def backlog(self) -> int:
        """Items read from the sockets but not applied yet (ingest is behind if it grows)."""
        return len(self._backlog)

    @property
    def failure(self) -> str | None:
        """Why ingest stopped on its own (a bug): the service is then unhealthy."""
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        exc = task.exception()
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    async def start(self) -> None:
        """Start ingesting in the running loop (the one that serves requests)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.create_task(self._run(), name="kvindex-ingest")

    async def stop(self) -> None:
        """Stop ingesting and close every socket."""
        task, self._task = self._task, None
        if task is not None:
            self._interrupt_wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.subscriber.close()

    def close(self) -> None:
        """Close the sockets without a loop (for a Fleet that never started)."""
        self.subscriber.close()

    async def _run(self) -> None:
        while True:
            if self.step():
                await asyncio.sleep(0)
            else:
                await self._wait_ready()

    def step(self) -> bool:
        """Ingest for about one slice; True if more input may be waiting right now.

        Applying one item takes microseconds, so the clock is read between items and the
        slice ends as soon as it is used up; what is left stays in the backlog, in order.
        """
        start = time.perf_counter()
        deadline = start + (self._slice / 10 if self.urgent else self._slice)
        self.ingest.slices += 1
        try:
            while True:
                if not self._backlog:
                    # A bounded read keeps one poll well inside the slice.
                    self._backlog.extend(self.subscriber.poll(0, max_messages=32))
                    if self._membership is not None:
                        self._follow_membership(self._membership)
                    if not self._backlog:
                        return self._input_pending()
                if self._apply_until(deadline):
                    return True
        finally:
            took = time.perf_counter() - start
            if took > self.ingest.longest_slice_seconds:
                self.ingest.longest_slice_seconds = took

    def _apply_until(self, deadline: float) -> bool:
        """Apply backlog items until it is empty (False) or the slice is used up (True)."""
        backlog = self._backlog
        clock = time.perf_counter
        while backlog:
            self._apply(backlog.popleft())
            if clock() >= deadline:
                return True
        return False

    def _apply(self, item: Item) -> None:
        self.ingest.items += 1
        try:
            self.index.handle(item)
        except Exception:
            self.ingest.errors += 1
            log.exception("could not apply %r", item)
        if isinstance(item, Delivery):
            self.ingest.deliveries += 1
            self._lag[item.source] = max(0.0, time.time() - item.batch.ts)
            self._counts.pop(item.source.instance, None)
        elif isinstance(item, Restarted):
            self._counts.pop(item.source.instance, None)
        for hook in self.on_item:
            self._call_hook(hook, item)

    def _call_hook(self, hook: Callable[[Any], None], arg: object) -> None:
        # A failing observer must not stop ingest for everyone else.
        try:
            hook(arg)
        except Exception:
            self.ingest.hook_errors += 1
            log.exception("hook %r failed", hook)

    def _sockets(self) -> list[zmq.Socket[bytes]]:
        return self.subscriber.sockets()

    def _input_pending(self) -> bool:
        """Whether any socket still holds a message; reading EVENTS re-arms its fd's edge."""
        for sock in self._sockets():
            try:
                events = sock.getsockopt(zmq.EVENTS)
            except zmq.ZMQError:
                continue
            if isinstance(events, int) and events & zmq.POLLIN:
                return True
        return False

    async def _wait_ready(self) -> None:
        """Sleep until a socket may have input, the idle timeout passes, or membership
        changes. Readers are registered for this wait only."""
        loop = asyncio.get_running_loop()
        wait = self._wait = _Wait(loop.create_future())
        for sock in self._sockets():
            fd = sock.getsockopt(zmq.FD)
            assert isinstance(fd, int)
            loop.add_reader(fd, _resolve, wait.future)
            wait.fds.append(fd)
        timer = loop.call_later(self._idle_wait, _resolve, wait.future)
        self.ingest.waits += 1
        try:
            await wait.future
        finally:
            timer.cancel()
            self._interrupt_wait()

    def _interrupt_wait(self) -> None:
        wait, self._wait = self._wait, None
        if wait is None or self._loop is None:
            return
        for fd in wait.fds:
            self._loop.remove_reader(fd)
        _resolve(wait.future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
