"""`SharedSubscriber`: the Fleet's Subscriber when the store is Redis.

It follows the instances this replica ingests like any Subscriber, and yields the
batches of every other instance of the fleet as the worker reads them from their shared
logs (forwarded over a local ZMQ socket the Fleet's ingest task waits on with the rest):
`Delivery`, `Restarted` and `Lost` items, applied by the Fleet exactly like its own. So
every replica holds the whole fleet's state, and answers lookups from memory.

For those remote instances, status and counters are what their ingesting replica last
published (a replica that stopped publishing for 5 s makes them `down`), and `last_seq`
and the lost count are those of the log this replica has applied, so they always agree
with the blocks it serves.

Changes of the fleet's membership (instances added or removed by another replica) are
handed to the Fleet as `MembershipChange`s (it is the `membership` feed the Fleet takes
them from after each read); the feed is not read further until the Fleet took them, so
an instance's first batch never comes before the instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

from kvindex.runtime import MembershipChange
from kvindex.store.protocol import StatusReport
from kvindex.store.redis.layout import ZERO, Cursor, IngestPolicy, StreamId, parse_id, tag, unpack
from kvindex.store.redis.load import snapshot_batches
from kvindex.subscriber import (
    Checkpoint,
    DecodeFailed,
    Delivery,
    InstanceSpec,
    Item,
    Lost,
    Restarted,
    SourceKey,
    SourceStats,
    SpecError,
    Status,
    Subscriber,
)
from kvindex.wire import BatchDecoder, WireError

log = logging.getLogger(__name__)

STATUS_EVERY = 0.5
_STAT_FIELDS = {f.name for f in fields(SourceStats)} - {"extra"}


@dataclass(slots=True)
class Remote:
    """What this replica applied of one publisher it does not ingest."""

    next_seq: int = 0
    lost: int = 0
    last_seq: int | None = None
    delivered: int = 0
    decode_errors: int = 0
    pos: StreamId = ZERO  # the last log entry applied

    @classmethod
    def at(cls, cursor: Cursor | None) -> Remote:
        if cursor is None:
            return cls()
        return cls(cursor.next_seq, cursor.lost, cursor.last_seq, pos=cursor.pos)


class SharedSubscriber(Subscriber):
    """A Subscriber for the instances this replica ingests, plus the shared logs of the
    others (see the module's doc)."""

    def __init__(
        self,
        ingest: IngestPolicy,
        send: Callable[[StatusReport], None],
        resume: Mapping[SourceKey, Checkpoint],
        cursors: Mapping[SourceKey, Cursor],
    ) -> None:
        super().__init__(resume=resume, keep_payload=True)
        self.ingest = ingest
        self.worker_stats: dict[str, Any] = {}
        self._changes: list[MembershipChange] = []
        self._send = send
        self._cursors = dict(cursors)
        self._remote: dict[SourceKey, Remote] = {}
        self._remote_specs: dict[str, InstanceSpec] = {}
        self._published: dict[str, list[Any]] = {}
        self._feed: zmq.Socket[bytes] | None = None
        self._decoder = BatchDecoder()
        self._status_at = 0.0
        self.ctl_pos: StreamId | None = None  # the last membership change taken

    def positions(self) -> dict[SourceKey, StreamId]:
        """Where this replica stands in each publisher's log: the last entry applied of
        those it does not ingest, the start of those it does (it applies their batches
        from its own Subscriber). What a worker started again resumes forwarding from."""
        remote = dict(self._remote)
        return {s: remote[s].pos if s in remote else ZERO for s in self.sources()}

    def connect_feed(self, sock: zmq.Socket[bytes]) -> None:
        """The worker's socket of other replicas' entries: `poll` wakes on it too (else a
        replica that ingests nothing took it only once per idle wait, and one membership
        change per wait: far behind under churn)."""
        self._feed = sock
        self._poller.register(sock, zmq.POLLIN)

    # -- membership ---------------------------------------------------------------------

    def membership_changes(self) -> list[MembershipChange]:
        """What other replicas added or removed since the last call (see the module)."""
        changes, self._changes = self._changes, []
        return changes

    def add_instance(self, spec: InstanceSpec) -> list[Item]:
        if self.ingest.ingests(spec.name):
            return super().add_instance(spec)
        if spec.name in self._remote_specs:
            raise ValueError(f"instance {spec.name!r} is already followed")
        self._remote_specs[spec.name] = spec
        for source_spec in spec.sources():
            source = source_spec.source
            self._remote[source] = Remote.at(self._cursors.pop(source, None))
        return []

    def remove_instance(self, name: str) -> None:
        if self._remote_specs.pop(name, None) is None:
            super().remove_instance(name)
            return
        self._remote = {k: v for k, v in self._remote.items() if k.instance != name}

    def follows(self, name: str) -> bool:
        return name in self._remote_specs or super().follows(name)

    def sources(self) -> list[SourceKey]:
        return [*super().sources(), *self._remote]

    # -- views ----------------------------------------------------------------------------

    def status(self, source: SourceKey) -> Status:
        remote = self._remote.get(source)
        if remote is None:
            return super().status(source)
        published = self._published.get(tag(source))
        if published is None:
            status = Status.INCOMPLETE if remote.lost else Status.CONNECTING
        elif not published[0]:
            status = Status.DOWN
        else:
            status = Status(published[1].get("status", Status.CONNECTING))
        if status is Status.LIVE and remote.lost:
            status = Status.INCOMPLETE
        return status

    def stats(self, source: SourceKey) -> SourceStats:
        remote = self._remote.get(source)
        if remote is None:
            return super().stats(source)
        published = self._published.get(tag(source))
        values = {} if published is None else published[1]
        stats = SourceStats(**{k: v for k, v in values.items() if k in _STAT_FIELDS})
        stats.last_seq = remote.last_seq
        stats.lost_since_restart = remote.lost
        stats.lost_batches = max(stats.lost_batches, remote.lost)
        return stats

    def checkpoint(self, source: SourceKey) -> Checkpoint:
        remote = self._remote.get(source)
        if remote is None:
            return super().checkpoint(source)
        return Checkpoint(remote.next_seq, None, remote.lost)

    # -- input ----------------------------------------------------------------------------

    def poll(self, timeout: float | None = 0.1, max_messages: int = 512) -> list[Item]:
        items = super().poll(timeout, max_messages)
        items.extend(self._read_feed(max_messages))
        self._publish_status()
        return items

    def sockets(self) -> list[zmq.Socket[bytes]]:
        socks = super().sockets()
        if self._feed is not None:
            socks.append(self._feed)
        return socks

    def _read_feed(self, limit: int) -> list[Item]:
        items: list[Item] = []
        feed = self._feed
        # After a membership change nothing more is read until the Fleet took it.
        while feed is not None and not self._changes and len(items) < limit:
            try:
                frames = feed.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._take_feed(unpack(frames[0]), frames[1:], items)
        return items

    def _take_feed(self, header: list[Any], rest: list[bytes], items: list[Item]) -> None:
        kind = header[0]
        if kind in ("b", "l", "r"):
            source = SourceKey(header[1], header[2])
            remote = self._remote.get(source)
            where = parse_id(header[-1])
            if remote is not None and where > remote.pos:  # else forwarded twice
                remote.pos = where
                items.extend(self._entry(kind, source, remote, header, rest))
        elif kind == "z":
            source = SourceKey(header[1], header[2])
            remote = self._remote.get(source)
            if remote is not None:
                items.extend(self._reload(source, remote, header, rest))
        elif kind in ("a", "x"):
            self.ctl_pos = parse_id(header[-1])
            if not header[-2]:  # else this replica's own change: applied already
                self._membership(kind, header[1], header[2] if kind == "a" else "")
        elif kind == "S":
            self._published = header[1]
        elif kind == "W":
            self.worker_stats = header[1]

    def _entry(
        self, kind: str, source: SourceKey, remote: Remote, header: list[Any], rest: list[bytes]
    ) -> Iterator[Item]:
        if kind == "b":
            seq, payload = header[3], rest[0]
            remote.next_seq, remote.last_seq = seq + 1, seq
            remote.delivered += 1
            try:
                batch = self._decoder.decode(payload)
            except WireError as exc:
                remote.decode_errors += 1
                yield DecodeFailed(source, seq, str(exc))
                return
            yield Delivery(source, seq, batch, False, len(payload))
        elif kind == "r":
            remote.next_seq, remote.lost = 0, 0
            yield Restarted(source, reason="restart in the shared log")
        elif kind == "l":
            first, last = header[3], header[4]
            remote.next_seq = last + 1
            remote.lost += last - first + 1
            yield Lost(source, first, last, "lost in the shared log")

    def _reload(
        self, source: SourceKey, remote: Remote, header: list[Any], rest: list[bytes]
    ) -> Iterator[Item]:
        """The worker sent a publisher's snapshot: start it over from there."""
        cursor = Cursor.unpack(header[3])
        remote.next_seq, remote.lost, remote.last_seq = (
            cursor.next_seq,
            cursor.lost,
            cursor.last_seq,
        )
        remote.pos = cursor.pos
        yield Restarted(source, reason="reloaded from the shared snapshot")
        seq = cursor.last_seq or 0
        for batch in snapshot_batches(source, msgspec.msgpack.decode(rest[0])):
            yield Delivery(source, seq, batch)

    def _membership(self, op: str, name: str, spec: str) -> None:
        if op == "x":
            self._changes.append(MembershipChange(name, None))
            return
        try:
            self._changes.append(MembershipChange(name, InstanceSpec.parse(spec)))
        except SpecError as exc:
            log.warning("could not follow the fleet change a %s: %s", name, exc)

    def _publish_status(self) -> None:
        """Tell the other replicas how the publishers this one ingests are doing."""
        now = time.monotonic()
        if now - self._status_at < STATUS_EVERY:
            return
        self._status_at = now
        local = Subscriber.sources(self)
        report = {
            tag(s): _published(Subscriber.stats(self, s), Subscriber.status(self, s)) for s in local
        }
        if report:
            self._send(StatusReport(report))


def _published(stats: SourceStats, status: Status) -> dict[str, Any]:
    values = {k: getattr(stats, k) for k in _STAT_FIELDS}
    values["status"] = status.value
    return values
