"""The Redis store's worker process: all of the store's Redis traffic, off the service.

`python -m kvindex.store.redis` (its `WorkerConfig` as msgpack on stdin). One thread, one loop:
take what the service sent (items to append, instances to register or remove, status to
publish, sync requests), append it (see append.py), read every log once (see
reader.py), compact now and then (see compact.py), and report. Being a separate
process, none of this ever holds the service's GIL while a lookup waits.

When Redis goes away the loop keeps taking the service's items into the bounded queue and
tries again with a growing pause (0.1 s to 2 s); nothing else changes, so once Redis is
back the queue drains, gaps are refilled from the publishers, and reading resumes from
where it stopped. The service keeps answering from memory all along.

It tells the service up to which group (see kvindex.store.protocol) everything is in
Redis; the service keeps the rest and hands it to the next worker if this one dies. It
never takes SIGINT (the service stops it), and stops when asked or when its service is
gone.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import redis
import zmq

from kvindex.store.link import PIPE_GROUPS
from kvindex.store.mirror import Mirror
from kvindex.store.protocol import (
    AppliedBatch,
    AppliedBatches,
    LostMark,
    Message,
    RemoveInstance,
    RestartMark,
    SaveInstance,
    StatusReport,
    WorkerReport,
    decode_frames,
    encode_report,
)
from kvindex.store.redis.append import Appender
from kvindex.store.redis.compact import Compactor
from kvindex.store.redis.layout import (
    CTL,
    INSTANCES,
    REGISTER,
    REMOVE,
    RESTORE_CP,
    SENTINEL_SCHEME,
    STATUS,
    Cursor,
    IngestPolicy,
    cp_key,
    log_key,
    pack,
    parse_id,
    snap_key,
    sources_of,
    tag,
    untag,
)
from kvindex.store.redis.layout import client as redis_client
from kvindex.store.redis.reader import SharedLogReader
from kvindex.subscriber.messages import SourceKey

log = logging.getLogger("kvindex.store.redis")

REPORT_EVERY = 0.25
IDLE_BLOCK_MS = 50


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    url: str
    ingest: str
    buffer: int
    compact: float
    inbox: str
    outbox: str
    acks: str
    parent: int
    served: dict[str, str]  # tag -> the stream id the service loaded up to
    mine: dict[str, list[Any]]  # tag -> [next seq, digest] the service's Subscriber resumes at
    ctl: str
    replica: str = ""  # this service's id in the control entries it writes (see REGISTER)


class RedisReachability:
    """Whether Redis answers, and when to try again if it does not."""

    def __init__(self, max_pause: float = 2.0) -> None:
        self.max_pause = max_pause
        self.up = True
        self.came_back = False  # set when Redis answers again (the worker checks what it lost)
        self.pause = 0.1
        self.retry_at = 0.0
        self.outages = 0
        self.error = ""

    def down(self, exc: Exception) -> None:
        if self.up:
            self.outages += 1
            log.warning("Redis went away (%s); retrying", exc)
        self.up = False
        self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.retry_at = time.monotonic() + self.pause
        self.pause = min(self.pause * 2, self.max_pause)

    def ready(self, client: redis.Redis) -> bool:
        if self.up:
            return True
        if time.monotonic() < self.retry_at:
            return False
        try:
            client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.down(exc)
            return False
        log.warning("Redis is back")
        self.up, self.pause, self.error = True, 0.1, ""
        self.came_back = True
        return True


class Worker:
    def __init__(self, config: WorkerConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.config = config
        self.client = redis_client(
            config.url, socket_timeout=10, socket_connect_timeout=2, health_check_interval=5
        )
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.RCVHWM, PIPE_GROUPS)
        self.inbox.connect(config.inbox)
        self.outbox = ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(config.outbox)
        self.acks = ctx.socket(zmq.PUSH)
        self.acks.setsockopt(zmq.LINGER, 1000)
        self.acks.connect(config.acks)
        self.mirror = Mirror()
        policy = IngestPolicy.parse(config.ingest)
        self.reader = SharedLogReader(self.mirror, policy, self._forward, replica=config.replica)
        self.appender = Appender(config.buffer, self.reader.spec)
        for key, (next_seq, digest) in config.mine.items():
            self.appender.mine[untag(key)] = (next_seq, "" if digest is None else str(digest))
        self.compactor = Compactor(self.mirror, self.reader.cursors, config.compact)
        # Behind Sentinel a new master is there the moment it is promoted, and asking the
        # Sentinels is cheap: try every 0.5 s at most rather than 2 s.
        sentinel = config.url.startswith(SENTINEL_SCHEME + "://")
        self.link = RedisReachability(0.5 if sentinel else 2.0)
        self.loaded = False
        self.waiting: list[tuple[str, int]] = []  # sync/compact/stop requests
        self.taken = 0  # the last group taken from the service
        self.committed = 0  # the last group all of whose items are in Redis
        self.said_error = ""  # what the service was last told about Redis
        self.stopping = False
        self.status: dict[str, Any] = {}
        self.membership: list[SaveInstance | RemoveInstance] = []  # not yet in Redis
        self.beat = 0
        self.reported = 0.0
        self.refills = 0  # times Redis lacked what this replica holds and was written back
        self.refilled_sources = 0
        self._unregistered_seen = 0

    def _forward(self, frames: list[bytes]) -> None:
        self.outbox.send_multipart(frames, copy=False)

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        while True:
            self._take(self._drain())
            if self.stopping or os.getppid() != self.config.parent:
                self._finish()
                return
            if self.link.ready(self.client):
                try:
                    self._work()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self.link.down(exc)
            else:
                self._wait_inbox(self.link.retry_at - time.monotonic())
            self._report_stats()
            if self._reachability() != self.said_error:
                self._send_report([])  # Redis went away or came back: the service says so

    def _work(self) -> None:
        if not self.loaded:
            served = {untag(k): parse_id(v) for k, v in self.config.served.items()}
            self.reader.load(self.client, served, parse_id(self.config.ctl))
            self._resume_appends()
            self.loaded = True
            self.link.came_back = False
        elif self.link.came_back or self.appender.stats.unregistered > self._unregistered_seen:
            self.link.came_back = False
            self._unregistered_seen = self.appender.stats.unregistered
            self._refill()
        self._apply_membership()
        self._publish_status()
        self.appender.flush(self.client)
        self._commit()
        self._answer(("sync",))
        block = self._block_ms()
        if self.reader.step(self.client, block):
            # The mirror holds no reference cycles: what it keeps need never be scanned by
            # the cyclic GC again (a fifth of the mirror's time otherwise).
            gc.freeze()
        self.reader.check_trimmed(self.client)
        if self.compactor.due() or any(k == "compact" for k, _ in self.waiting):
            self.compactor.compact(self.client)
            self._answer(("compact",))

    def _block_ms(self) -> int | None:
        """How long the next read of the logs may wait: not at all with work queued
        (but lost ranges held back: until the first may go, at most the idle wait)."""
        if self._inbox_ready():
            return None
        if not self.appender.queue:
            return IDLE_BLOCK_MS
        held = self.appender.held_for()
        return None if held is None else max(1, min(IDLE_BLOCK_MS, int(held * 1000)))

    def _commit(self) -> None:
        """Tell the service what is in Redis now (everything taken, once the queue is
        empty)."""
        if not self.appender.queue and self.committed < self.taken:
            self.committed = self.taken
            self._send_report([])

    def _resume_appends(self) -> None:
        """Where this replica stands in each log it appends to, if the service did not
        say (a worker started again after a crash): where the log stands. Items the
        service hands over again are then skipped up to there, and appended from there."""
        for source, cursor in self.reader.cursors.items():
            if source not in self.appender.mine and self.reader.policy.ingests(source.instance):
                digest = cursor.digest
                self.appender.mine[source] = (
                    cursor.next_seq,
                    "" if digest is None else str(digest),
                )

    def _answer(self, kinds: tuple[str, ...]) -> None:
        if self.appender.queue:
            return
        done = [w for w in self.waiting if w[0] in kinds]
        for wait in done:
            self.waiting.remove(wait)
        if done:
            self._send_report([token for _, token in done if token])

    def _reachability(self) -> str:
        return "" if self.link.up else f"Redis is unreachable: {self.link.error}"

    def _send_report(self, done: list[int]) -> None:
        self.said_error = self._reachability()
        self.acks.send(encode_report(WorkerReport(self.committed, done, self.said_error)))

    def _finish(self) -> None:
        """Stop: flush and compact if Redis lets us within a few seconds."""
        deadline = time.monotonic() + 5
        self.appender.lost_hold = 0.0  # nothing waits any more
        while time.monotonic() < deadline:
            if self.link.ready(self.client):
                try:
                    if not self.loaded:
                        break
                    self._apply_membership()
                    self.appender.flush(self.client)
                    while self.reader.step(self.client, None) and time.monotonic() < deadline:
                        pass
                    self.compactor.compact(self.client)
                    self.compactor.release(self.client)
                    self._commit()
                    self._answer(("sync", "compact", "stop"))
                    break
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self.link.down(exc)
            time.sleep(0.05)

    # -- the service's messages ----------------------------------------------------------

    def _inbox_ready(self) -> bool:
        return bool(self.inbox.poll(0))

    def _wait_inbox(self, seconds: float) -> None:
        self.inbox.poll(max(1, int(seconds * 1000)))

    def _drain(self) -> list[Message]:
        """What the service sent, bounded: while Redis answers, no more than the queue has
        room for (the rest waits in the socket); while it is away, everything, so the
        queue's bound drops batches rather than the service's memory growing."""
        room = self.config.buffer - len(self.appender.queue) if self.link.up else 20_000
        out: list[Message] = []
        taken = 0  # batches counted one by one (an AppliedBatches holds many)
        while taken < min(20_000, max(room, 100)):
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
                group = decode_frames([frame.buffer for frame in frames])
            except zmq.Again:
                break
            if group.id > self.taken:  # not one sent again after a restart of this worker
                out.extend(group.messages)
                self.taken = group.id
                taken += sum(
                    len(m.payloads) if isinstance(m, AppliedBatches) else 1 for m in group.messages
                )
        return out

    def _take(self, messages: list[Message]) -> None:
        for message in messages:
            if isinstance(message, AppliedBatch):
                source = SourceKey(message.instance, message.rank)
                self.appender.batch(source, message.seq, message.payload)
            elif isinstance(message, AppliedBatches):
                source = SourceKey(message.instance, message.rank)
                for seq, payload in enumerate(message.payloads, message.first_seq):
                    self.appender.batch(source, seq, payload)
            elif isinstance(message, LostMark):
                source = SourceKey(message.instance, message.rank)
                self.appender.lost(source, message.first, message.last)
            elif isinstance(message, RestartMark):
                self.appender.restart(SourceKey(message.instance, message.rank))
            elif isinstance(message, StatusReport):
                self.status.update(message.report)
            elif isinstance(message, SaveInstance | RemoveInstance):
                if isinstance(message, RemoveInstance):
                    # What is queued of it goes with it now: the items that follow are an
                    # instance of that name added again (registered before they are sent).
                    self.appender.forget(message.name)
                self.membership.append(message)
            elif message.kind == "stop":
                self.waiting.append((message.kind, message.token))
                self.stopping = True
            else:
                self.waiting.append((message.kind, message.token))

    # -- to Redis -----------------------------------------------------------------------

    def _apply_membership(self) -> None:
        """Registrations and removals, before any append (an instance's first batch needs
        it registered). One that fails stays first in line for the next try."""
        while self.membership:
            change = self.membership[0]
            if isinstance(change, SaveInstance):
                self._register(change.name, change.spec)
            else:
                self._remove(change.name)
            self.membership.pop(0)

    def _refill(self) -> None:
        """Redis answers again, or refused an append as unregistered: if it lacks what this
        replica holds (it restarted empty, was flushed, or a failover lost the writes
        asynchronous replication had not carried), write it back: the fleet registered
        again, each publisher's snapshot from the mirror and its checkpoint, and appends
        resumed from there (the seqs past it that the mirror had not read yet are fetched
        again from the publisher's replay buffer, as after any gap: see Appender)."""
        registered = {n.decode() for n in cast(list[bytes], self.client.hkeys(INSTANCES))}
        unknown = [name for name in self.reader.specs if name not in registered]
        behind = []
        for source, cursor in self.reader.cursors.items():
            stands = cast(bytes | None, self.client.hget(cp_key(source), "n"))
            if cursor.next_seq > (int(stands) if stands else 0):
                behind.append(source)
        if not unknown and not behind:
            return
        log.warning(
            "Redis lacks %d instance(s) and %d publisher log(s) this replica holds (restarted "
            "empty, flushed, or a failover lost writes): writing them back",
            len(unknown),
            len(behind),
        )
        for name in unknown:
            self._register(name, self.reader.specs[name])
        written = self.compactor.rewrite(self.client, behind)
        for source in written:
            restore_checkpoint(self.client, source, self.reader.cursors[source])
        self.refills += 1
        self.refilled_sources += len(written)

    def _publish_status(self) -> None:
        if not self.status:
            return
        self.beat += 1
        mapping: dict[Any, Any] = {k: pack([self.beat, v]) for k, v in self.status.items()}
        self.client.hset(STATUS, mapping=mapping)
        self.status = {}

    def _register(self, name: str, spec: str) -> None:
        """Register an instance (or its changed spec) for every replica (see
        `register_instance`); this replica stops appending for the publishers dropped."""
        for source in register_instance(self.client, name, spec, self.config.replica):
            self.appender.forget_source(source)

    def _remove(self, name: str) -> None:
        spec = cast(bytes | None, self.client.hget(INSTANCES, name))
        sources = sources_of(spec.decode()) if spec else [SourceKey(name)]
        keys = [INSTANCES, CTL, STATUS, *_keys_of(sources)]
        args = [name, self.config.replica, *(tag(s) for s in sources)]
        self.client.eval(REMOVE, len(keys), *keys, *args)

    def _report_stats(self) -> None:
        now = time.monotonic()
        if now - self.reported < REPORT_EVERY:
            return
        self.reported = now
        if self.link.up and self.loaded:
            try:
                self._forward([pack(["S", self.reader.statuses(self.client)])])
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self.link.down(exc)
        self._forward([pack(["W", self.stats()])])

    def stats(self) -> dict[str, Any]:
        a, r = self.appender.stats, self.reader.stats
        return {
            "connected": self.link.up,
            "outages": self.link.outages,
            "error": self.link.error,
            "backlog": len(self.appender.queue),
            "appended": a.appended,
            "dropped_while_away": a.dropped,
            "gap_fills": a.gap_fills,
            "refetched_batches": a.refetched,
            "lost_by_store": a.lost,
            "unregistered_appends": a.unregistered,
            "log_entries_read": r.entries,
            "forwarded": r.forwarded,
            "resyncs": r.resyncs,
            "compactions": self.compactor.compactions,
            "refills": self.refills,
            "refilled_publishers": self.refilled_sources,
            "ingest": self.config.ingest,
        }


def restore_checkpoint(client: redis.Redis, source: SourceKey, cursor: Cursor) -> None:
    """Put back a publisher's checkpoint as `cursor` stands, unless the log's stands
    there or further already (RESTORE_CP never moves one back)."""
    digest = "" if cursor.digest is None else str(cursor.digest)
    args = [str(cursor.next_seq), digest, str(cursor.lost)]
    client.eval(RESTORE_CP, 1, cp_key(source), *args)


def register_instance(client: redis.Redis, name: str, spec: str, by: str) -> list[SourceKey]:
    """Register an instance (or its changed spec) in Redis for every replica, the change
    named as `by`'s; the keys of the publishers a changed spec no longer has (fewer DP
    ranks, other ranks) go with the change. Returns those publishers."""
    while True:
        old = cast(bytes | None, client.hget(INSTANCES, name))
        old_spec = old.decode() if old else ""
        kept = set(sources_of(spec))
        dropped = [s for s in sources_of(old_spec) if s not in kept] if old_spec else []
        keys = [INSTANCES, CTL, STATUS, *_keys_of(dropped)]
        args = [name, spec, by, old_spec, *(tag(s) for s in dropped)]
        if client.eval(REGISTER, len(keys), *keys, *args) != -1:
            return dropped  # else another replica changed it between the read and the script


def _keys_of(sources: list[SourceKey]) -> list[str]:
    """Each publisher's keys: checkpoint, log, snapshot."""
    return [key for s in sources for key in (cp_key(s), log_key(s), snap_key(s))]


def worker_main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops it (see the module)
    logging.basicConfig(level=logging.WARNING, format="kvindex store: %(levelname)s %(message)s")
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerConfig)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    worker = Worker(config, ctx)
    worker._send_report([])  # here: the service may hand groups over
    code = 0
    try:
        worker.run()
    except Exception as exc:  # one line for the operator; the service restarts it
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        why = f"{type(exc).__name__}: {reason}"
        worker.acks.send(encode_report(WorkerReport(worker.committed, [], why)))
        log.error("the Redis worker failed: %s", why)
        code = 1
    finally:
        for sock in (worker.inbox, worker.outbox, worker.acks):
            sock.close()
    sys.exit(code)
