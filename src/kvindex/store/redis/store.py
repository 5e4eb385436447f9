"""`--store redis://HOST:PORT/DB`: one fleet state shared by several `serve` replicas.

    redis://HOST:PORT/DB[?ingest=all|none|NAME,...][&buffer=N][&compact=SECONDS]

Every replica answers for the whole fleet; `ingest` says which instances it subscribes to
itself (default `all`: replicas ingesting the same instance append each batch once).
Instances given to any replica (flags, config, POST /v1/instances) are registered in
Redis for all of them; an instance another replica removes is removed everywhere.

How (the key layout is in keys.py):
- each publisher has a shared, ordered log (a Redis Stream) of the batches as vLLM sent
  them, plus restart and lost markers. The replica ingesting it appends what it applied,
  through a Lua script that only appends the next seq, so the log stays gap-free and
  duplicate-free whoever appends;
- every replica reads all logs and applies the batches of the instances it does not
  ingest (`SharedSubscriber`), so all serve the same state from memory;
- logs are compacted into per-publisher snapshots by one replica at a time, so a replica
  starting (or restarting after kill -9) loads snapshot + log tail, and its Subscriber
  resumes each publisher it ingests from the log's checkpoint, like the SQLite store;
- all Redis traffic is in a worker process (worker.py), fed over its WorkerLink (bounded,
  supervised: see kvindex.store.link): `record` never blocks the service, a Redis outage
  costs no lookup, and a worker that dies is started again where the service stands.
  While Redis is away the worker queues (bounded) and retries with backoff; once it is
  back, the queue drains and any seqs dropped past the bound are fetched again from the
  publisher's replay buffer.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Iterable
from dataclasses import replace

import msgspec
import redis

from kvindex.index import FleetIndex
from kvindex.runtime import MembershipFeed, StoreHealth
from kvindex.store.base import LoadResult, SharedStore, StoreError
from kvindex.store.link import WorkerCommand, WorkerLink, WorkerStore
from kvindex.store.mirror import Mirror
from kvindex.store.protocol import (
    SaveInstance,
)
from kvindex.store.redis.feed import SharedSubscriber
from kvindex.store.redis.layout import Cursor, RedisConfig, render_id, tag
from kvindex.store.redis.layout import client as redis_client
from kvindex.store.redis.load import (
    advance_tail,
    load_source,
    read_registry,
    read_source,
    snapshot_into_mirror,
)
from kvindex.store.rows import BlockRow
from kvindex.store.snapshot import mirror_rows
from kvindex.subscriber.messages import Item, SourceKey
from kvindex.subscriber.spec import InstanceSpec
from kvindex.subscriber.state import Checkpoint

__all__ = ["RedisStore", "current_rows"]


class RedisStore(WorkerStore):
    """The service's side: load, hand applied items to the worker, feed the Fleet."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.config = RedisConfig.parse(url)
        self._subscriber: SharedSubscriber | None = None  # made by load(), for the Fleet
        self._cursors: dict[SourceKey, Cursor] = {}
        self._ctl = "0-0"
        self._specs: list[InstanceSpec] = []
        self._link = WorkerLink("the Redis worker")
        self._base = ""
        # Names the control entries this service's worker writes (instances added and
        # removed here): its reader does not hand them back as news (see REGISTER).
        self.replica = secrets.token_hex(8)

    @property
    def url(self) -> str:
        return self._url

    # -- start ------------------------------------------------------------------------

    def connect(self) -> redis.Redis:
        """A client, once Redis answered; a one-line StoreError if it does not."""
        client = redis_client(self.config.url, socket_connect_timeout=3, socket_timeout=30)
        try:
            client.ping()
        except redis.RedisError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StoreError(f"cannot reach Redis at {self.config.where}: {reason}") from None
        return client

    def load(self, index: FleetIndex) -> LoadResult:
        """Every registered publisher's snapshot and log tail into `index`."""
        started = time.monotonic()
        client = self.connect()
        try:
            registry = read_registry(client)
            rows = batches = 0
            for source in registry.sources():
                cursor, n_rows, n_batches = load_source(index, client, source)
                self._cursors[source] = cursor
                rows, batches = rows + n_rows, batches + n_batches
        except redis.RedisError as exc:
            raise StoreError(f"cannot load from Redis at {self.config.where}: {exc}") from None
        finally:
            client.close()
        self._ctl = render_id(registry.ctl_pos)
        checkpoints = {s: c.checkpoint() for s, c in self._cursors.items()}
        self._subscriber = SharedSubscriber(
            self.config.ingest, self._link.post, checkpoints, self._cursors
        )
        return LoadResult(
            checkpoints, dict(registry.specs), rows, batches, time.monotonic() - started
        )

    @property
    def subscriber(self) -> SharedSubscriber:
        if self._subscriber is None:
            raise StoreError("the Redis store must be loaded before its Subscriber is used")
        return self._subscriber

    @property
    def membership(self) -> MembershipFeed:
        return self.subscriber

    def share(self, specs: Iterable[InstanceSpec]) -> None:
        """Register these instances for the other replicas, once the worker runs."""
        self._specs = list(specs)

    def shared(self) -> SharedStore:
        return self

    def start(self) -> None:
        self._base = self._link.open(pulls=("feed",))
        if self._subscriber is not None:
            self._subscriber.connect_feed(self._link.sockets["feed"])
        self._link.start(self._command)
        for spec in self._specs:
            self._link.post(SaveInstance(spec.name, spec.render()))

    def _command(self, restarted: bool) -> WorkerCommand:
        """The worker's command; started again, it resumes where the service stands now
        (each log from the last entry applied, the appends from where each log stands)."""
        base = self._base
        served = {tag(s): render_id(c.pos) for s, c in self._cursors.items()}
        mine = {tag(s): [c.next_seq, c.digest] for s, c in self._cursors.items()}
        ctl = self._ctl
        if restarted and self._subscriber is not None:
            served = {tag(s): render_id(p) for s, p in self._subscriber.positions().items()}
            mine = {}
            if self._subscriber.ctl_pos is not None:
                ctl = render_id(self._subscriber.ctl_pos)
        config = {
            "url": self.config.url,
            "ingest": self.config.ingest.render(),
            "buffer": self.config.buffer,
            "compact": self.config.compact,
            "inbox": f"{base}/in",
            "outbox": f"{base}/feed",
            "acks": f"{base}/acks",
            "parent": os.getpid(),
            "served": served,
            "mine": mine,
            "ctl": ctl,
            "replica": self.replica,
        }
        argv = [sys.executable, "-m", "kvindex.store.redis"]
        return WorkerCommand(argv, stdin=msgspec.msgpack.encode(config))

    # -- the hot path: one non-blocking send per item this replica ingests ---------------

    def record(self, item: Item) -> None:
        if self.config.ingest.ingests(item.source.instance):
            super().record(item)
        # else: another replica's batch, read from its log: nothing to append

    def record_batches(
        self, source: SourceKey, first_seq: int, count: int, packed: bytes | memoryview
    ) -> None:
        if self.config.ingest.ingests(source.instance):
            super().record_batches(source, first_seq, count, packed)

    # -- control: sync, compact, close come from WorkerStore ----------------------------

    def health(self) -> StoreHealth:
        """The link's health, with the worker's own counters (Redis reachable, outages,
        its queue, what it appended, read and compacted) as `detail`."""
        health = self._link.health(self.url)
        worker = self._subscriber.worker_stats if self._subscriber is not None else {}
        if worker and not worker.get("connected", True) and health.up:
            reason = f"Redis is unreachable: {worker.get('error', '')}"
            return replace(health, up=False, reason=reason, detail=dict(worker))
        return replace(health, detail=dict(worker))


def current_rows(url: str) -> tuple[list[BlockRow], LoadResult]:
    """Every block the store holds now (each publisher's snapshot with its log tail applied)
    and its checkpoints: what `kvindex export` and `kvindex stats` read, without a service
    and without writing anything."""
    store = RedisStore(url)
    client = store.connect()
    out: list[BlockRow] = []
    checkpoints: dict[SourceKey, Checkpoint] = {}
    batches = 0
    try:
        registry = read_registry(client)
        for source in registry.sources():
            state = read_source(client, source)
            mirror = Mirror()
            snapshot_into_mirror(mirror, source, state)
            batches += advance_tail(mirror, source, state.cursor, state.entries)
            out.extend(mirror_rows(mirror))
            checkpoints[source] = state.cursor.checkpoint()
    except redis.RedisError as exc:
        raise StoreError(f"cannot read Redis at {store.config.where}: {exc}") from None
    finally:
        client.close()
    return out, LoadResult(checkpoints, dict(registry.specs), len(out), batches)
