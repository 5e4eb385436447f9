"""Following the shared logs: the worker's mirror, and what the service must apply.

The reader XREADs the control stream and every publisher's log in one call. Each entry
moves the mirror (which the compactor snapshots from) and, for a publisher this replica
does not ingest itself, is forwarded to the service, which applies it to the index it
serves. A publisher this replica does ingest is applied by the service from its own
Subscriber, so its entries (its own appends coming back, or another replica's duplicates)
are never forwarded: nothing is applied twice.

Positions: the service loaded each log up to some entry before this process started, and
this process loads its mirror a little later, possibly further. Each log is read from the
earlier of the two; an entry moves the mirror only past the mirror's position and goes to
the service only past the service's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from kvindex.store.mirror import Mirror
from kvindex.store.redis.layout import (
    CTL,
    STATUS,
    ZERO,
    Cursor,
    Entry,
    Fields,
    IngestPolicy,
    RawEntry,
    StreamId,
    log_key,
    pack,
    parse_entry,
    parse_id,
    render_id,
    sources_of,
    unpack,
)
from kvindex.store.redis.load import (
    advance,
    continues,
    covered,
    read_registry,
    read_source,
    snapshot_into_mirror,
    trimmed_past,
)
from kvindex.subscriber.messages import SourceKey
from kvindex.subscriber.spec import InstanceSpec

log = logging.getLogger(__name__)

Forward = Callable[[list[bytes]], None]
STALE = 5.0  # seconds without news from a publisher's ingester: nobody follows it
TRIM_CHECK = 5.0


@dataclass(slots=True)
class ReaderStats:
    entries: int = 0
    forwarded: int = 0
    resyncs: int = 0


@dataclass
class SharedLogReader:
    mirror: Mirror
    policy: IngestPolicy
    forward: Forward
    specs: dict[str, str] = field(default_factory=dict)
    cursors: dict[SourceKey, Cursor] = field(default_factory=dict)  # the mirror's
    served: dict[SourceKey, StreamId] = field(default_factory=dict)  # the service's
    read_at: dict[SourceKey, StreamId] = field(default_factory=dict)
    ctl_pos: StreamId = ZERO
    replica: str = ""  # this service's id: its own control entries are not news to it
    stats: ReaderStats = field(default_factory=ReaderStats)
    _status_seen: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    _trim_checked: float = 0.0

    # -- start ------------------------------------------------------------------------

    def load(self, client: redis.Redis, served: dict[SourceKey, StreamId], ctl: StreamId) -> None:
        """Load the mirror; start each log at the earlier of the service's and the mirror's
        positions, and the control stream where the service's registry read stood."""
        registry = read_registry(client)
        self.served = dict(served)
        for name, spec in registry.specs.items():
            sources = sources_of(spec)
            if sources and all(s in served for s in sources):
                self.specs[name] = spec
                for source in sources:
                    self._load_mirror(client, source)
        # Instances registered after the service loaded come from the control stream (read
        # from where the service's registry stood), once the service is told about them;
        # those removed since, too.
        self.ctl_pos = ctl

    def _load_mirror(self, client: redis.Redis, source: SourceKey) -> None:
        state = read_source(client, source)
        snapshot_into_mirror(self.mirror, source, state)
        cursor = state.cursor
        self.cursors[source] = cursor
        self.read_at[source] = min(cursor.pos, self.served[source])
        self._catch_up(client, source, state.entries)

    def _resync(self, client: redis.Redis, source: SourceKey) -> None:
        """(Re)load one publisher from its snapshot, in the mirror and, for a publisher
        the service does not ingest, in the service too."""
        state = read_source(client, source)
        self.mirror.drop(source)  # the snapshot says it all: nothing of it to write back
        snapshot_into_mirror(self.mirror, source, state)
        snap = state.cursor
        self.cursors[source] = Cursor(
            snap.pos, snap.next_seq, snap.digest, snap.lost, snap.last_seq
        )
        self.read_at[source] = snap.pos
        if not self.policy.ingests(source.instance):
            if len(state.fields) > (b"" in state.fields) or source in self.served:
                header = pack(["z", source.instance, source.rank, snap.pack()])  # pos inside
                self.forward([header, pack(state.fields)])
            self.served[source] = snap.pos
        self.stats.resyncs += 1
        self._catch_up(client, source, state.entries, resynced=True)

    # -- following ----------------------------------------------------------------------

    def step(self, client: redis.Redis, block_ms: int | None) -> int:
        """One XREAD over everything; returns the number of entries read."""
        keys = [CTL, *(log_key(s) for s in self.read_at)]
        ids = [render_id(self.ctl_pos), *(render_id(p) for p in self.read_at.values())]
        sources = list(self.read_at)
        streams: dict[Any, Any] = dict(zip(keys, ids, strict=True))
        reply = cast(
            list[tuple[bytes, list[RawEntry]]] | None,
            client.xread(streams, count=1000, block=block_ms),
        )
        count = 0
        by_key = {k.decode(): v for k, v in reply or []}
        ctl = by_key.pop(CTL, [])
        for key, entries in by_key.items():
            source = sources[keys.index(key) - 1]
            if source in self.read_at:
                self._catch_up(client, source, [parse_entry(i, f) for i, f in entries])
                count += len(entries)
        for entry_id, fields in ctl:
            self._control(client, parse_id(entry_id), fields)
            count += 1
        return count

    def _catch_up(
        self, client: redis.Redis, source: SourceKey, entries: list[Entry], resynced: bool = False
    ) -> None:
        cursor = self.cursors[source]
        served = self.served.get(source, ZERO)
        forward = not self.policy.ingests(source.instance)
        for entry in entries:
            self.stats.entries += 1
            if entry.id > cursor.pos:
                if covered(cursor, entry):  # logged again after a failover: held already
                    cursor.pos = self.read_at[source] = entry.id
                    if forward and entry.id > served:
                        self.served[source] = entry.id  # the service holds it too
                    continue
                if not continues(cursor, entry):
                    if not resynced:
                        self._say_rewritten(source, cursor, entry)
                        self._resync(client, source)
                        return  # the snapshot's own log tail, read by _resync, is the rest
                    log.warning("the log of %r skips seqs past its snapshot", source)
                advance(self.mirror, source, cursor, entry)
            if forward and entry.id > served:
                self.forward(_entry_frames(source, entry))
                self.served[source] = entry.id
                self.stats.forwarded += 1
            self.read_at[source] = entry.id

    @staticmethod
    def _say_rewritten(source: SourceKey, cursor: Cursor, entry: Entry) -> None:
        log.warning(
            "the log of %r goes on at seq %d, not at %d where this replica stands (a "
            "failover rewrote it): reloading it from its snapshot",
            source,
            entry.seq,
            cursor.next_seq,
        )

    def _control(self, client: redis.Redis, entry_id: StreamId, fields: dict[bytes, bytes]) -> None:
        self.ctl_pos = entry_id
        op, name = fields.get(b"op", b"").decode(), fields.get(b"name", b"").decode()
        # The service made this change itself (and may have undone it since): it must
        # not apply it again; it still learns where the control stream stands.
        mine = bool(self.replica) and fields.get(b"by", b"").decode() == self.replica
        if op == "a":
            spec = fields.get(b"spec", b"").decode()
            old = self.specs.get(name)
            self.specs[name] = spec
            self.forward([pack(["a", name, spec, mine, render_id(entry_id)])])
            for source in sources_of(spec):
                if old is None or source not in self.cursors:
                    self.served.pop(source, None)
                    self._resync(client, source)
        elif op == "x" and name in self.specs:
            del self.specs[name]
            self.mirror.remove_instance(name)
            for source in [s for s in self.cursors if s.instance == name]:
                del self.cursors[source], self.read_at[source]
                self.served.pop(source, None)
            self.forward([pack(["x", name, mine, render_id(entry_id)])])

    def spec(self, name: str) -> InstanceSpec | None:
        text = self.specs.get(name)
        return None if text is None else InstanceSpec.parse(text)

    # -- upkeep -------------------------------------------------------------------------

    def check_trimmed(self, client: redis.Redis) -> None:
        """Reload a log this reader fell so far behind on that entries it had not read
        were trimmed (it would otherwise miss them silently)."""
        now = time.monotonic()
        if now - self._trim_checked < TRIM_CHECK:
            return
        self._trim_checked = now
        for source, pos in list(self.read_at.items()):
            if trimmed_past(client, source, pos):
                log.warning("fell behind the log of %r: reloading it from its snapshot", source)
                self._resync(client, source)

    def statuses(self, client: redis.Redis) -> dict[str, Any]:
        """What each publisher's ingester last said, and whether it said it lately."""
        now = time.monotonic()
        out: dict[str, Any] = {}
        raw = cast(Fields, client.hgetall(STATUS))
        for key, value in raw.items():
            name = key.decode()
            seen = self._status_seen.get(name)
            if seen is None or seen[0] != value:
                seen = self._status_seen[name] = (value, now)
            beat_stats = unpack(value)
            out[name] = [now - seen[1] < STALE, beat_stats[1]]
        return out


def _entry_frames(source: SourceKey, entry: Entry) -> list[bytes]:
    """An entry for the service; its id comes last, so that the service knows where it
    stands (and skips what a worker started again after a crash forwards twice)."""
    where = render_id(entry.id)
    if entry.kind == "b":
        return [pack(["b", source.instance, source.rank, entry.seq, where]), entry.payload]
    if entry.kind == "l":
        return [pack(["l", source.instance, source.rank, entry.seq, entry.last, where])]
    return [pack(["r", source.instance, source.rank, where])]
