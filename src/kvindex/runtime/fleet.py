"""`Fleet`: the fleet followed, its index, and the views every face renders.

Ingest runs on worker threads (`kvindex.runtime.ingest`), each following a share of the
instances with its own Subscriber and applying batches to the shared index as they came;
the HTTP server's event loop only reads (views, lookups). With the compiled index the two
run on separate cores: applies release the GIL and take the index's write lock per batch,
lookups take its read lock, so a lookup never waits for more than one batch and never sees
half of one.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Protocol

import msgspec
import zmq

from kvindex.index import CacheStats, FleetIndex, LookupRow, json_answerer
from kvindex.index.base import AnswerSlot
from kvindex.index.multimodal import MMFeature, MMKey
from kvindex.index.sharded import ShardedIndex
from kvindex.index.sharing import Sharing, sharing
from kvindex.runtime.approximate import ApproximateCaches
from kvindex.runtime.discovery import DEFAULT_INTERVAL, Discovery
from kvindex.runtime.finders.reconcile import FoundBy
from kvindex.runtime.ingest import (
    IndexGuard,
    IngestCounters,
    IngestWorker,
    c_ingest_wanted,
    default_workers,
)
from kvindex.runtime.views import (
    FleetSummary,
    InstanceMatch,
    InstanceView,
    LookupAnswer,
    RankLoad,
    RankMatch,
    RankView,
    worst_status,
)
from kvindex.subscriber import (
    DEFAULT_SUB_HWM,
    Applied,
    CapacityError,
    Checkpoint,
    Connection,
    DecodeFailed,
    Delivery,
    InstanceSpec,
    Item,
    Notice,
    ReplayPolicy,
    Restarted,
    SourceKey,
    SourceStats,
    Status,
    Subscriber,
    Unreachable,
    need_of_instances,
)
from kvindex.subscriber.engine_load import LoadFollower
from kvindex.wire import AllBlocksCleared, BlockHash, EventBatch
from kvindex.wire.tiers import tier_counts

__all__ = [
    "DuplicateInstance",
    "Fleet",
    "IngestStats",
    "MembershipChange",
    "MembershipFeed",
    "UnknownInstance",
]

log = logging.getLogger(__name__)

IDLE_GRACE = 60.0  # seconds an engine's KV usage reads 0 with blocks held before it is said

ItemHook = Callable[[Item], None]
RemoveHook = Callable[[str], None]
# Consecutive batches of one publisher the C path applied (the seq of the first, how many,
# their payloads packed as one msgpack array of bin): what a persistent store logs of them,
# in bulk (see Fleet.record_into). The C path's are a read-only memoryview of the buffer C
# kept them in (`Applied.packed`): a hook that keeps them keeps that buffer.
BatchesHook = Callable[[SourceKey, int, int, bytes | memoryview], None]


_STATUS_JSON = {status: msgspec.json.encode(status) for status in Status}
# How a lookup answer reads an instance's status: its subscriber's method, and its ranks.
StatusReader = tuple[Callable[[SourceKey], Status], list[SourceKey]]


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


IngestStats = IngestCounters  # how ingest is doing, over all workers


def _total(parts: Iterable[IngestCounters]) -> IngestCounters:
    total = IngestCounters()
    for part in parts:
        for f in fields(IngestCounters):
            mine, theirs = getattr(total, f.name), getattr(part, f.name)
            merged = max(mine, theirs) if f.name == "longest_slice_seconds" else mine + theirs
            setattr(total, f.name, merged)
    return total


def _shards_of(index: object) -> list[Any] | None:
    """The shards a worker each applies into, if `index` is sharded."""
    return index.shards if isinstance(index, ShardedIndex) else None


def _workers_for_shards(shards: int, workers: int | None) -> int:
    """The ingest workers of an index in `shards`: as many as asked (default: one per
    shard), at least one per shard (a shard no worker applies into would hold nothing)."""
    if workers is None:
        return shards
    if workers < shards:
        raise ValueError(
            f"{shards} index shards take {shards} ingest workers at least, not {workers}"
        )
    return workers


def _no_ranks_status(spec: InstanceSpec | None) -> Status:
    """The status of an instance with no publisher: an engine without events is `live`
    (what was routed there is known), one named by its URL not found yet `connecting`."""
    return Status.LIVE if spec is not None and spec.events_none else Status.CONNECTING


class Fleet:
    """Follows a set of vLLM instances and keeps their exact state.

    `start()` starts the ingest threads, `stop()` stops them and closes every socket.
    `on_item` hooks see every item after the index applied it; a store persists from
    `record_into`'s hooks, which see the same, the C path's batches in bulk; `on_add` and
    `on_remove` hooks see every instance added or removed here at runtime (not those a
    `membership` feed reports: they were made elsewhere). Hooks run one at a time,
    whichever thread calls them.
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
        ingest_workers: int | None = None,
        sub_hwm: int | None = None,
        discovery_interval: float = DEFAULT_INTERVAL,
    ) -> None:
        """`ingest_workers`: threads that read and apply (default: one per core with the
        compiled index). `sub_hwm`: live messages each SUB socket queues before ZMQ drops
        new ones (default: DEFAULT_SUB_HWM, 100,000). `discovery_interval`: seconds
        between two reads of a well engine's `/server_info` (engines named by URL; 0:
        only on a restart or link trouble). `slice_seconds` and `keep_payload`
        are no longer needed: ingest has its own threads, and always hands the hooks the
        payloads as they came.

        Raises `CapacityError` (before opening anything) if `instances` need more sockets
        or file descriptors than this process may open."""
        del slice_seconds, keep_payload
        # `index` and `resume` come from a store's warm start: the state as persisted, and
        # where each publisher's stream continues. A shared store brings its own
        # `subscriber`, which also yields the batches other replicas ingest, and the
        # `membership` feed of the instances they add and remove: one worker follows all.
        self.index = index if index is not None else FleetIndex(rate_window=rate_window)
        self._guard = IndexGuard(self.index)
        self._membership = membership
        self._init_hooks()
        self._shards = _shards_of(self.index)
        if self._shards is not None:  # worker i applies into shard i % shards
            if subscriber is not None:
                raise ValueError("a shared store's replica has one ingest worker: no shards")
            ingest_workers = _workers_for_shards(len(self._shards), ingest_workers)
        subscribers = self._subscribers(subscriber, policy, resume, ingest_workers, sub_hwm)
        self._workers = [self._worker(i, sub, idle_wait) for i, sub in enumerate(subscribers)]
        self._init_members(discovery_interval)
        self._init_answer_caches()
        self._add_first(list(instances))

    def _init_hooks(self) -> None:
        # Hooks that see every item, each batch as one: the C path is off while any is set.
        self.on_item: list[ItemHook] = []
        # A store's: every item but the ordinary batches C applied, which go to its
        # batches hook in bulk (`record_into`).
        self._record_items: list[ItemHook] = []
        self._record_batches: list[BatchesHook] = []
        self.on_read: list[Callable[[], None]] = []  # after each read's items are applied
        self.on_remove: list[RemoveHook] = []
        self.on_add: list[Callable[[InstanceSpec], None]] = []  # runtime additions only
        self._hook_lock = threading.Lock()
        self.hook_errors = 0
        # Kept for the HTTP layer's lookup priority; ingest no longer shares its loop.
        self.urgent = 0

    @staticmethod
    def _subscribers(
        shared: Subscriber | None,
        policy: ReplayPolicy | None,
        resume: Mapping[SourceKey, Checkpoint] | None,
        ingest_workers: int | None,
        sub_hwm: int | None,
    ) -> list[Subscriber]:
        """One per ingest worker; a shared store's own Subscriber alone."""
        if shared is not None:
            return [shared]
        count = ingest_workers if ingest_workers is not None else default_workers()
        hwm = DEFAULT_SUB_HWM if sub_hwm is None else sub_hwm
        return [
            Subscriber(policy=policy, resume=resume, decode=False, rcvhwm=hwm)
            for _ in range(max(1, count))
        ]

    def _worker(self, i: int, sub: Subscriber, idle_wait: float) -> IngestWorker:
        index, guard = self.index, self._guard
        if self._shards is not None:
            index = self._shards[i % len(self._shards)]
            guard = IndexGuard(index)
        return IngestWorker(
            f"kvindex-ingest-{i}",
            sub,
            index,
            guard,
            self._on_item,
            after_read=self._follow_membership if self._membership is not None else None,
            after_apply=self._after_apply,
            idle_wait=idle_wait,
            in_c=self._in_c if c_ingest_wanted() else None,
            on_applied=self._applied_in_c,
            keep_payloads=lambda: bool(self._record_batches),
        )

    def _init_members(self, discovery_interval: float) -> None:
        """The instances followed. They change on the owning worker's thread (an add or a
        remove is one step there) while views read them on the event loop: `_members`
        keeps the two apart (held briefly, never while waiting for another thread), and a
        name being added or removed is in `_changing` meanwhile (a second change of it is
        refused at once)."""
        self._specs: dict[str, InstanceSpec] = {}
        self._ranks: dict[str, list[SourceKey]] = {}
        self._owner: dict[str, IngestWorker] = {}
        self._changing: set[str] = set()
        self._members = threading.RLock()
        # Per instance, valid until it changes: `_on_item` drops them and bumps the
        # instance's epoch, so counts computed across a change are not kept.
        self._counts: dict[str, _Counts] = {}
        self._counts_epoch: dict[str, int] = {}
        self._counts_lock = threading.Lock()
        # Engines named by their URL (SGLang): their publishers read from /server_info, and
        # read again when they restart or their link goes down (see runtime/discovery.py).
        self.discovery = Discovery(self._rediscovered, interval=discovery_interval)
        self.load = LoadFollower()  # SGLang's load streams, on a thread of their own
        # Engines without events (`events=none`): what the router sent there (approximate)
        self.approximate = ApproximateCaches()
        # How engines found by --discover were found (set by runtime.finders.Reconciler)
        self.found: dict[str, FoundBy] = {}
        # DP ranks whose engine says it sleeps, their blocks marked gone (sleep_state)
        self._asleep: dict[SourceKey, int | None] = {}  # -> the seq applied when it slept
        self.sleep_resets = 0
        # Ranks whose KV usage reads 0 while the index holds GPU blocks for them (usage_state)
        self.idle_grace = IDLE_GRACE
        self._idle_since: dict[SourceKey, float] = {}
        self._idle_said: set[SourceKey] = set()
        self.idle_with_blocks = 0
        self.add_link_hook(self._link_trouble)

    def _init_answer_caches(self) -> None:
        # What lookup_json derives from the instances, each kept until what it comes from
        # moves: (index layout, specs version, slots) and (changes, slots, statuses).
        self._specs_version = 0
        self._slots: tuple[object, int, list[AnswerSlot]] | None = None
        self._statuses: tuple[int, object, list[bytes]] | None = None
        self._status_readers: tuple[object, list[StatusReader]] | None = None

    def _add_first(self, specs: list[InstanceSpec]) -> None:
        """All or none: a fleet that does not fit is refused before its first socket."""
        what = f"instance {specs[0].name!r}" if len(specs) == 1 else f"{len(specs)} instances"
        self.subscriber.budget.check(need_of_instances(specs), what)
        for spec in specs:
            self.add_instance(spec)

    @property
    def subscriber(self) -> Subscriber:
        """The first worker's Subscriber (the only one, with a shared store)."""
        return self._workers[0].subscriber

    def add_link_hook(self, hook: Callable[..., None]) -> None:
        """Have `hook` see every worker's link and replay-fault notices (see
        Subscriber.link_hooks)."""
        for worker in self._workers:
            worker.subscriber.link_hooks.append(hook)

    # -- membership --------------------------------------------------------------------

    @property
    def specs(self) -> dict[str, InstanceSpec]:
        """The instances followed, by name (read-only: use add/remove_instance). Ingest
        threads change it meanwhile: one `get` is safe, a Python loop over it is not
        (iterate `list(specs.items())`, or use `models()` / `instance_views()`)."""
        return self._specs

    def has_instance(self, name: str) -> bool:
        return name in self._specs

    def add_instance(self, spec: InstanceSpec) -> None:
        """Follow a new instance now, all its DP ranks or nothing: raises DuplicateInstance
        if the name is taken, CapacityError if its sockets don't fit (nothing is opened
        then, and the instances followed go on)."""
        self._add(spec)
        for hook in list(self.on_add):
            self._call_hook(hook, spec)

    def remove_instance(self, name: str) -> None:
        """Stop following an instance and forget its state; raises UnknownInstance."""
        self._remove(name)
        for hook in list(self.on_remove):
            self._call_hook(hook, name)

    def _add(self, spec: InstanceSpec) -> None:
        """One step on the owning worker's thread: sockets opened, then the instance
        published to the views (under `_members`), then its first items applied."""
        name = spec.name
        with self._members:
            if name in self._specs or name in self._changing:
                raise DuplicateInstance(f"instance {name!r} already exists")
            worker = self._worker_for(name)
            self._changing.add(name)
        try:
            # Whole or not at all: what it needs (KV-event and load sockets) is checked
            # first; the load stream's sockets are reserved (CapacityError: nothing opened
            # yet), then the KV-event ones on the worker's own thread: its sockets are
            # made there.
            self.subscriber.budget.check(need_of_instances([spec]), f"instance {name!r}")
            self.load.follow(spec)
            try:
                worker.call(lambda: self._start_following(worker, spec))
            except BaseException:
                self.load.forget(name)
                raise
        except BaseException:
            if isinstance(self.index, ShardedIndex):
                self.index.unplace(name)  # placed by _worker_for: not to count as held
            raise
        finally:
            with self._members:
                self._changing.discard(name)

    def _worker_for(self, name: str) -> IngestWorker:
        """The worker a new instance goes to: of the workers that may (a sharded index's:
        its shard's, worker i applying into shard i % shards), the one following the
        fewest publishers."""
        workers = self._workers
        if isinstance(self.index, ShardedIndex):
            shards = len(self.index.shards)
            workers = workers[self.index.place(name) :: shards]
        return min(workers, key=lambda w: len(w.subscriber.sources()))

    def _start_following(self, worker: IngestWorker, spec: InstanceSpec) -> None:
        with self._members:
            items = worker.subscriber.add_instance(spec)
            self._publish(worker, spec)
        # Its /server_info is read again by whoever subscribes to it: not by a replica
        # that only applies another one's log of it (that one re-registers it when it moves).
        if spec.discover is not None and spec.name in worker.subscriber.instances:
            self.discovery.track(spec)
        for item in items:  # a replay from 0 for a late join, applied here
            worker.apply(item)

    def _publish(self, worker: IngestWorker, spec: InstanceSpec) -> None:
        """What the views read of an instance (under `_members`)."""
        self._specs[spec.name] = spec
        if spec.events_none:
            self.approximate.configure(spec.name, spec.pool_blocks, spec.approx_ttl)
        self._ranks[spec.name] = [source.source for source in spec.sources()]
        self._owner[spec.name] = worker
        self._specs_version += 1
        self._drop_counts(spec.name)

    def _remove(self, name: str) -> None:
        """One step on the owning worker's thread. If the worker does not run it
        (WorkerUnavailable), the instance stays as it was, whole."""
        with self._members:
            worker = self._owner.get(name)
            if worker is None or name in self._changing:
                raise UnknownInstance(name)
            self._changing.add(name)
        try:
            worker.call(lambda: self._stop_following(worker, name))
        finally:
            with self._members:
                self._changing.discard(name)

    def _stop_following(self, worker: IngestWorker, name: str) -> None:
        with self._members:
            del self._specs[name], self._ranks[name], self._owner[name]
            self._specs_version += 1
            worker.subscriber.remove_instance(name)
            worker.lag = {k: v for k, v in worker.lag.items() if k.instance != name}
            self._asleep = {k: v for k, v in self._asleep.items() if k.instance != name}
        self.discovery.forget(name)
        self.load.forget(name)
        self.approximate.forget(name)
        self.found.pop(name, None)
        with self._guard():
            self.index.remove_instance(name)
        self._drop_counts(name)

    def _rediscovered(self, spec: InstanceSpec) -> None:
        """An engine named by its URL publishes elsewhere now (or was found at last): follow
        its new publishers in the old ones' place. From the discovery thread."""
        with self._members:
            worker = self._owner.get(spec.name)
            if worker is None or self._specs.get(spec.name) == spec:
                return
        worker.call(lambda: self._swap(worker, spec))

    def _swap(self, worker: IngestWorker, spec: InstanceSpec) -> None:
        """On the owning worker's thread: the engine's publishers changed. A rank whose
        publisher is the same goes on untouched (its blocks stay indexed); a rank gone or
        moved is dropped with what was known of it (the store forgets it too: hooks see a
        `Restarted` for it); new ranks are followed. When no rank stays (the engine
        restarted on other ports), the instance is dropped whole and saved again, as a
        store and the replicas sharing it expect of a restarted engine."""
        name = spec.name
        with self._members:
            old = self._specs.get(name)
            if old is None or self._owner.get(name) is not worker:
                return  # removed meanwhile (and maybe added again, elsewhere)
            before = self._ranks.get(name, [])
            if name in worker.subscriber.instances:
                items, closed = worker.subscriber.change_instance(spec)
            else:  # an earlier change failed midway: nothing of it is followed
                items, closed = worker.subscriber.add_instance(spec), list(before)
            kept = [source for source in before if source not in closed]
            with self._guard():
                if kept:
                    for source in closed:
                        self.index.drop_source(source)
                else:
                    self.index.remove_instance(name)
            worker.lag = {k: v for k, v in worker.lag.items() if k not in closed}
            self._publish(worker, spec)
            self._follow_load(old, spec)
        if kept:
            why = "the engine no longer publishes there (/server_info changed)"
            for source in closed:
                for item_hook in [*self.on_item, *self._record_items]:
                    self._call_hook(item_hook, Restarted(source, reason=why))
        elif before:  # what a store kept of the old publishers is gone with them
            for remove_hook in list(self.on_remove):
                self._call_hook(remove_hook, name)
            for add_hook in list(self.on_add):
                self._call_hook(add_hook, spec)
        for item in items:
            worker.apply(item)

    def _follow_load(self, old: InstanceSpec, spec: InstanceSpec) -> None:
        """The new load stream, if it changed (an unchanged one keeps its readings)."""
        if (old.load_sources(), old.load_topic) == (spec.load_sources(), spec.load_topic):
            return
        try:
            self.load.follow(spec)
        except CapacityError as exc:  # the KV-event ranks matter more: they go on
            log.warning("%s: its load stream is not followed: %s", spec.name, exc)
            self.load.forget(spec.name)

    # -- engines asleep -----------------------------------------------------------------

    def sleep_state(self, instance: str, rank: int, awake: bool) -> None:
        """What an engine's `/metrics` says of one DP rank's sleep (the scraper's
        `on_sleep`). Asleep: vLLM discarded its KV cache, and the `AllBlocksCleared` it
        queued goes out only when it runs a step again, so its blocks are marked gone now
        (the same clear, applied at the rank's current seq: the index then holds what the
        engine will say it holds), once per sleep, counted and said in the log; the rank
        shows `asleep` until it sends a batch again or says it is awake."""
        source = SourceKey(instance, rank)
        spec = self._specs.get(instance)
        if spec is not None and spec.events_none:  # what was routed there is gone too
            if not awake and self.approximate.clear(instance):
                log.warning("%r: the engine sleeps: the blocks routed there are gone", instance)
            return
        if awake:
            self._asleep.pop(source, None)
            return
        with self._members:
            worker = self._owner.get(instance)
            if worker is None or source in self._asleep or source not in self._ranks[instance]:
                return
            self._asleep[source] = self.index.source_state(source)[0]
        worker.call(lambda: self._clear_asleep(source))
        self.sleep_resets += 1
        log.warning("%r: the engine sleeps (vllm:engine_sleep_state): its blocks are gone", source)

    def pool_state(self, instance: str, rank: int, blocks: int) -> None:
        """What an engine's `/metrics` says of its GPU pool (the scraper's `on_pool`): the
        bound of an events=none engine's approximate cache, unless its spec gives one."""
        spec = self._specs.get(instance)
        if spec is not None and spec.events_none and spec.gpu_blocks is None and rank == 0:
            self.approximate.configure(instance, blocks, spec.approx_ttl)

    def usage_state(self, instance: str, rank: int, kv_usage: float) -> None:
        """What an engine's `/metrics` says of one DP rank's KV-cache usage (the scraper's
        `on_usage`). A rank that reads 0 for longer than `idle_grace` seconds while the
        index holds GPU blocks for it is counted (`idle_with_blocks`) and said once in the
        log, and its blocks are kept: vLLM's usage counts the blocks running requests
        hold, an idle engine's prefix cache sits in its free queue (docs/discovery.md)."""
        source = SourceKey(instance, rank)
        if kv_usage > 0 or source in self._asleep:
            self._idle_since.pop(source, None)
            self._idle_said.discard(source)
            return
        now = time.monotonic()
        since = self._idle_since.setdefault(source, now)
        if source in self._idle_said or now - since < self.idle_grace:
            return
        gpu = tier_counts(self.index.blocks_by_medium(instance)).get("gpu", 0)
        if not gpu:
            return
        self._idle_said.add(source)
        self.idle_with_blocks += 1
        log.warning(
            "%r: its KV usage reads 0 for %.0f s while kvindex holds %d GPU blocks for it: "
            "kept (an idle engine's prefix cache sits in its free queue)",
            source,
            now - since,
            gpu,
        )

    def _clear_asleep(self, source: SourceKey) -> None:
        """On the owning worker's thread: the rank's blocks cleared, its seq kept."""
        if source not in self.index.sources(source.instance):
            return  # nothing applied yet: nothing held
        seq, ts = self.index.source_state(source)
        with self._guard():
            self.index.apply(source, EventBatch(ts or time.time(), [AllBlocksCleared()]), seq)
        self._drop_counts(source.instance)

    def _asleep_or(self, source: SourceKey, status: Status) -> Status:
        """A live rank marked asleep shows `asleep` until a batch past the one it slept at
        is applied (it works again: the queued clear, then its new blocks)."""
        if source not in self._asleep:
            return status
        if self.index.source_state(source)[0] != self._asleep.get(source, None):
            self._asleep.pop(source, None)
            return status
        return Status.ASLEEP if status is Status.LIVE else status

    def _link_trouble(self, notice: Notice) -> None:
        if isinstance(notice, Unreachable):  # its publishers may have moved
            self.discovery.reread(notice.source.instance, f"can't follow rank {notice.source.rank}")

    def record_into(self, record: ItemHook, record_batches: BatchesHook) -> None:
        """A persistent store: `record` sees every item in order, except the ordinary
        batches the C path applied, which `record_batches` gets in bulk instead (a
        publisher's consecutive batches of one read, their payloads packed: one call, not
        one per batch; see `BatchesHook`), before the items of that read. Per publisher the
        store sees everything in the order the index applied it, as with `on_item`; the C
        path stays on. Set before the Fleet starts."""
        self._record_items.append(record)
        self._record_batches.append(record_batches)

    def _in_c(self) -> bool:
        """Whether ordinary batches may skip Python: not while an item hook must see every
        one (a store takes them in bulk: `record_into`)."""
        return not self.on_item

    def _applied_in_c(self, done: Applied) -> None:
        """The C path applied batches of `done.source` (on an ingest thread): what
        `_on_item` does for a Delivery: the cached counts dropped and the epoch bumped, so
        counts a reader computed before these batches are not stored after them; and a
        store's batches hook gets them, if they were kept for it (`Applied.packed`)."""
        self._drop_counts(done.source.instance)
        packed, count = done.packed, done.batches
        if packed is not None and count:
            first = done.last_seq - count + 1
            for hook in self._record_batches:
                self._call_hook(partial(hook, done.source, first, count, packed), None)

    def _after_apply(self) -> None:
        """After each read an ingest worker applied (on its thread): the `on_read` hooks
        (a store hands over what was recorded)."""
        for hook in self.on_read:
            self._call_hook(hook, None)

    def _follow_membership(self) -> None:
        """Apply the changes made elsewhere (no hooks: they are not this replica's news).
        On the worker's thread, after each read of the shared Subscriber, before its items
        (the feed holds back what follows a change until the change is taken)."""
        assert self._membership is not None
        for change in self._membership.membership_changes():
            try:
                if change.spec is None:
                    if self.has_instance(change.name):
                        self._remove(change.name)
                elif not self.has_instance(change.name):
                    self._add(change.spec)
            except (ValueError, KeyError, zmq.ZMQError) as exc:  # CapacityError too
                log.warning("could not follow the fleet change of %s: %s", change.name, exc)

    # -- views -------------------------------------------------------------------------

    def status(self, name: str) -> Status:
        """The worst status among the instance's DP ranks (cheap: no block counting)."""
        with self._members:
            ranks = self._ranks.get(name)
            worker = self._owner.get(name)
            if ranks is None or worker is None:
                raise UnknownInstance(name)
            status_of = worker.subscriber.status
            default = _no_ranks_status(self._specs.get(name))
            statuses = (self._asleep_or(source, status_of(source)) for source in ranks)
            return worst_status(statuses, default)

    def instance_views(self) -> list[InstanceView]:
        """Every instance followed now (one removed while this runs is left out)."""
        views = []
        for name in sorted(self._specs):
            try:
                views.append(self.instance_view(name))
            except UnknownInstance:
                continue
        return views

    def instance_view(self, name: str) -> InstanceView:
        with self._members:
            spec = self._specs.get(name)
            if spec is None:
                raise UnknownInstance(name)
            ranks = [self._rank_view(source) for source in self._ranks[name]]
        if spec.events_none:  # no publisher: rank 0 as routed to, with its load stream's
            source = SourceKey(name, 0)
            load = self._load_of(source)
            ranks = [RankView(0, Status.LIVE, None, 0, 0, 0, 0, 0, 0, 0, None, None, load=load)]
        counts = self._counts_of(name)
        stats = counts.stats
        return InstanceView(
            spec=spec,
            status=worst_status((r.status for r in ranks), _no_ranks_status(spec)),
            ranks=ranks,
            blocks=stats.active,
            blocks_by_medium=dict(counts.by_medium),
            stored=stats.stored,
            removed=stats.removed,
            clears=stats.clears,
            batches=stats.batches,
            discovery=self.discovery.view(name),
            unplaced=stats.unplaced,
            unrecognised_keys=stats.unrecognised_keys,
            namespace_kept=stats.namespace_kept,
            namespace_moved=stats.namespace_moved,
            found=self.found.get(name),
            approximate_cache=self.approximate.stats(name) if spec.events_none else None,
        )

    def source_stats(self, source: SourceKey) -> SourceStats:
        """A publisher's counters, from the Subscriber that follows it (KeyError: none)."""
        return self._owner[source.instance].subscriber.stats(source)

    def _rank_view(self, source: SourceKey) -> RankView:
        worker = self._owner[source.instance]
        stats: SourceStats = worker.subscriber.stats(source)
        # The last seq the *index* applied: what the blocks and lookups answered next
        # reflect (the Subscriber may have delivered more into the backlog already).
        applied_seq, _ = self.index.source_state(source)
        return RankView(
            rank=source.rank,
            status=self._asleep_or(source, worker.subscriber.status(source)),
            last_seq=applied_seq if applied_seq is not None else stats.last_seq,
            gaps=stats.gaps,
            received=stats.received,
            delivered=stats.delivered,
            replayed_batches=stats.replayed_batches,
            lost_batches=stats.lost_batches,
            decode_errors=stats.decode_errors,
            publisher_restarts=stats.publisher_restarts,
            last_batch_ts=stats.last_ts,
            ingest_lag_seconds=worker.lag.get(source),
            problem=stats.problem,
            malformed_messages=stats.malformed_messages,
            handshake_failures=stats.handshake_failures,
            replay_failures=stats.replay_failures,
            replay_refusals=stats.replay_refusals,
            load=self._load_of(source),
        )

    def _load_of(self, source: SourceKey) -> RankLoad | None:
        state = self.load.state(source)
        if state is None or state.reading is None:
            return None
        stat = state.reading.stat
        return RankLoad(
            running_requests=stat.num_running_reqs,
            waiting_requests=stat.num_waiting_reqs,
            max_running_requests=stat.max_running_requests or None,
            kv_tokens_used=stat.num_tokens,
            kv_tokens_total=stat.max_total_num_tokens or None,
            kv_usage=stat.kv_usage,
            waiting_uncached_tokens=stat.num_waiting_uncached_tokens,
            age_seconds=state.reading.age,
            readings=state.readings,
            malformed=state.malformed,
        )

    def _counts_of(self, name: str) -> _Counts:
        # Distinct counts need a union over ranks and groups: O(blocks). They are kept until
        # the instance changes, so an idle fleet is scraped and listed for free.
        with self._counts_lock:
            counts = self._counts.get(name)
            epoch = self._counts_epoch.get(name, 0)
        if counts is None:
            with self._guard():
                counts = _Counts(self.index.cache_stats(name), self.index.blocks_by_medium(name))
            with self._counts_lock:  # kept only if nothing changed it meanwhile
                if self._counts_epoch.get(name, 0) == epoch:
                    self._counts[name] = counts
        return counts

    def _drop_counts(self, name: str) -> None:
        with self._counts_lock:
            self._counts.pop(name, None)
            self._counts_epoch[name] = self._counts_epoch.get(name, 0) + 1

    def summary(self, views: list[InstanceView] | None = None) -> FleetSummary:
        """Totals over the fleet (from `views` when the caller has them already)."""
        views = self.instance_views() if views is None else views
        with self._guard():
            entries = self.index.entries()
        return FleetSummary.of(views, entries=entries, backlog=self.backlog)

    def rates_per_minute(self) -> dict[str, float]:
        """Stores, removes and clears per minute over the index's rate window."""
        return self.index.rates.per_minute()

    def block_hashes(self, name: str, medium: str | None = None) -> set[BlockHash]:
        """Every distinct block hash the instance holds now (all ranks); raises
        UnknownInstance."""
        if not self.has_instance(name):
            raise UnknownInstance(name)
        with self._guard():
            return self.index.block_hashes(name, medium)

    def sharing(self, max_instances: int, max_nodes: int) -> Sharing:
        """Which instances hold the same blocks, and the hottest shared prefixes: over the
        `max_instances` largest instances, walking at most `max_nodes` tree nodes."""
        with self._guard():
            names = self.index.instances()
            if len(names) > max_instances:
                names = sorted(names, key=self.index.block_count, reverse=True)
                names = sorted(names[:max_instances])
            return sharing(self.index, instances=names, max_nodes=max_nodes)

    # -- lookups -----------------------------------------------------------------------

    def models(self) -> dict[str, list[str]]:
        """The models the instances serve (`model=` in their specs), each with its
        instances by name."""
        out: dict[str, list[str]] = {}
        with self._members:
            specs = sorted(self._specs.items())
        for name, spec in specs:
            if spec.model is not None:
                out.setdefault(spec.model, []).append(name)
        return out

    def serves(self, model: str) -> bool:
        """Whether any instance followed serves `model`."""
        return any(spec.model == model for spec in list(self._specs.values()))

    def lookup(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        model: str | None = None,
        *,
        mm_features: Sequence[MMFeature | Mapping[str, Any]] | None = None,
        extra_keys: Sequence[Sequence[MMKey] | None] | None = None,
    ) -> LookupAnswer:
        """Per instance, what the engine would reuse of the prompt, in whole blocks from
        its first token (the chains of the namespace its LoRA adapter and salt name); rows
        best first. With `model`, only the instances serving that model answer (none if no
        instance does: see `serves`). An image prompt's blocks match from its first image on
        only with its multimodal keys (`mm_features` or `extra_keys`:
        kvindex.index.multimodal)."""
        with self._guard():
            if mm_features or extra_keys:
                rows = self.index.lookup(
                    token_ids, lora_name, cache_salt, mm_features=mm_features, extra_keys=extra_keys
                )
            else:
                rows = self.index.lookup(token_ids, lora_name, cache_salt)
        return self._answer(rows, by_tokens=True, model=model)

    def lookup_local_hashes(
        self,
        hashes: Sequence[int],
        lora_name: str | None = None,
        model: str | None = None,
        block_size: int | None = None,
    ) -> LookupAnswer:
        """Per instance, what the engine would reuse of the prompt these Dynamo local
        block hashes stand for (`FleetIndex.lookup_local_hashes`; the peers'
        `/query_by_hash`). Raises LocalHashesOff where the index keeps none."""
        with self._guard():
            rows = self.index.lookup_local_hashes(hashes, lora_name, block_size)
        return self._answer(rows, by_tokens=True, model=model)

    def lookup_hashes(
        self, block_hashes: Sequence[BlockHash], model: str | None = None
    ) -> LookupAnswer:
        """Per instance, how many of these block hashes, from the first, it holds now."""
        with self._guard():
            rows = self.index.lookup_hashes(block_hashes)
        return self._answer(rows, by_tokens=False, model=model)

    def lookup_json(
        self,
        token_ids: Sequence[int] | bytes,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[bytes, bool]:
        """`lookup`'s answer encoded as JSON (what `/v1/lookup` sends), and whether it is a
        hit. The compiled index makes it in one step, without a Python object per instance;
        the pure index encodes `lookup`'s. `token_ids` may be uint32 bytes (the service's
        C body reader gives them so)."""
        core = json_answerer(self.index)
        if core is not None:
            slots, statuses = self.answer_slots()
            return core.lookup_json(token_ids, lora_name, cache_salt, slots, statuses)
        if isinstance(token_ids, bytes):
            token_ids = array("I", token_ids).tolist()
        answer = self.lookup(token_ids, lora_name, cache_salt)
        return msgspec.json.encode(answer), answer.hit

    def answer_slots(self) -> tuple[list[AnswerSlot], list[bytes]]:
        """The followed instances as the compiled answer wants them, and each one's status
        as JSON, of one membership (read apart, a worker could remove an instance between
        the two: its status then has no publisher to read)."""
        with self._members:
            slots = self._answer_slots()
            return slots, self._statuses_json(slots)

    def _answer_slots(self) -> list[AnswerSlot]:
        """The followed instances by name, as the compiled answer wants them: each DP rank
        of the spec (and any other rank the index knows) with its publisher's bit."""
        layout = self.index.layout()
        cached = self._slots
        if cached is not None and cached[0] is layout and cached[1] == self._specs_version:
            return cached[2]
        known = {name: dict(ranks) for name, ranks in layout}
        slots: list[AnswerSlot] = []
        for name in sorted(self._specs):
            bits = known.get(name, {})
            flat: list[int] = []
            for rank in sorted(set(self._specs[name].ranks()) | bits.keys()):
                flat += (rank, bits.get(rank, -1))
            slots.append((msgspec.json.encode(name), flat))
        self._slots = (layout, self._specs_version, slots)
        return slots

    def _statuses_json(self, slots: list[AnswerSlot]) -> list[bytes]:
        """Each slot's status as JSON, recomputed only when a worker may have changed one
        (then straight from each rank's subscriber: a busy fleet recomputes per lookup)."""
        changes = sum(worker.changes for worker in self._workers)
        cached = self._statuses
        if cached is not None and cached[0] == changes and cached[1] is slots:
            return cached[2]
        statuses = []
        for (status_of, sources), name in zip(
            self._status_sources(slots), sorted(self._specs), strict=True
        ):
            if len(sources) == 1:
                statuses.append(_STATUS_JSON[status_of(sources[0])])
            else:
                default = _no_ranks_status(self._specs.get(name))
                statuses.append(_STATUS_JSON[worst_status(map(status_of, sources), default)])
        self._statuses = (changes, slots, statuses)
        return statuses

    def _status_sources(self, slots: list[AnswerSlot]) -> list[StatusReader]:
        """Per slot (by name), the subscriber method that tells a rank's status, and the
        instance's ranks: kept with the slots."""
        cached = self._status_readers
        if cached is not None and cached[0] is slots:
            return cached[1]
        readers: list[StatusReader] = [
            (self._status_reader(self._owner[name].subscriber.status), self._ranks[name])
            for name in sorted(self._specs)
        ]
        self._status_readers = (slots, readers)
        return readers

    def _status_reader(
        self, status_of: Callable[[SourceKey], Status]
    ) -> Callable[[SourceKey], Status]:
        """A rank's status as lookups show it: its link's, or `asleep` (sleep_state)."""

        def read(source: SourceKey) -> Status:
            return self._asleep_or(source, status_of(source))

        return read

    def _answer(
        self, rows: list[LookupRow], by_tokens: bool, model: str | None = None
    ) -> LookupAnswer:
        """One row per followed instance (0 where it holds nothing yet), best first; `best`
        is never a `down` instance (its engine is unreachable). With `model`, only that
        model's instances."""
        found = {row.instance: row for row in rows}
        with self._members:  # the instances and their statuses of one membership
            out = [
                self._match(spec, found.get(name), by_tokens)
                for name, spec in self._specs.items()
                if model is None or spec.model == model
            ]
        out.sort(key=lambda r: (-r.matched_blocks, r.name))
        best = next((r.name for r in out if r.matched_blocks > 0 and r.status != Status.DOWN), None)
        return LookupAnswer(best, out)

    def _match(self, spec: InstanceSpec, row: LookupRow | None, by_tokens: bool) -> InstanceMatch:
        ranks = dict.fromkeys(spec.ranks(), 0)
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
            by_tier=row.by_tier if row is not None else {},
            by_group=row.by_group if row is not None else {},
        )

    # -- ingest ------------------------------------------------------------------------

    @property
    def ingest(self) -> IngestCounters:
        """How ingest is doing, over all workers."""
        total = _total(w.counters for w in self._workers)
        total.hook_errors += self.hook_errors
        return total

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def index_shards(self) -> int:
        """The index's shards, each applied into by its own workers (1: one index every
        worker applies into)."""
        return len(self._shards) if self._shards is not None else 1

    @property
    def running(self) -> bool:
        return all(w.running for w in self._workers)

    @property
    def backlog(self) -> int:
        """Items read from the sockets but not applied yet (ingest is behind if it grows)."""
        return sum(w.backlog for w in self._workers)

    @property
    def failure(self) -> str | None:
        """Why ingest stopped on its own (a bug): the service is then unhealthy."""
        return next((w.failure for w in self._workers if w.failure), None)

    async def start(self) -> None:
        """Start the ingest threads (and the discovery thread)."""
        for worker in self._workers:
            worker.start()
        self.discovery.start()
        self.load.start()

    async def stop(self) -> None:
        """Stop ingesting and close every socket."""
        self.close()

    def close(self) -> None:
        """Stop the ingest threads (if they run) and close their sockets."""
        self.discovery.stop()
        self.load.stop()
        for worker in self._workers:
            worker.stop()

    def step(self) -> bool:
        """Read and apply what every worker's sockets have now (a Fleet not started:
        tests step it by hand), and read the engines' /server_info that are due; True if
        anything was read."""
        found = self.discovery.step()
        loaded = self.load.step()
        return any([worker.step(0) for worker in self._workers]) or found or loaded

    def _on_item(self, item: Item) -> None:
        """After the index applied an item (on an ingest thread): the views' cached counts
        go, and the hooks see it, one at a time."""
        if isinstance(item, Delivery | DecodeFailed | Restarted):
            self._drop_counts(item.source.instance)
            if isinstance(item, Delivery):  # it works again: awake
                self._asleep.pop(item.source, None)
        if isinstance(item, Restarted) or (isinstance(item, Connection) and not item.connected):
            self.discovery.reread(item.instance, item.describe())
        for hook in self.on_item:
            self._call_hook(hook, item)
        for hook in self._record_items:
            self._call_hook(hook, item)

    def _call_hook(self, hook: Callable[..., None], arg: object) -> None:
        # A failing observer must not stop ingest for everyone else.
        with self._hook_lock:
            try:
                hook() if arg is None else hook(arg)
            except Exception:
                self.hook_errors += 1
                log.exception("hook %r failed", hook)
