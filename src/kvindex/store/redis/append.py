"""Appending what this replica applied to the shared logs: in order, once, gap-free.

Items arrive from the service in apply order and wait in a bounded queue. Each flush
sends runs of them, one publisher per APPEND script call, many calls per pipeline (one
round trip). The script appends only the next seq of each log, so a replay of the same
items (a retry after a lost reply, another replica ingesting the same publisher) changes
nothing, and it stops at a gap.

Where can a gap come from? While Redis is away the queue keeps filling; past its bound
new batches are dropped (restart and lost markers are kept: they are few and order
matters). Once Redis is back, the first item after a dropped run finds the log short of
it, and the missing seqs are fetched again from the publisher's replay buffer, exactly as
the Subscriber would catch up after a restart of the service. Only what the publisher no
longer holds becomes a `lost` entry, so the log is complete or says it is not.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from kvindex.store.redis.layout import APPEND, INSTANCES, cp_key, log_key
from kvindex.subscriber import (
    Delivery,
    InstanceSpec,
    Lost,
    ReplayPolicy,
    Restarted,
    SourceKey,
    Subscriber,
    Unverified,
    offset_endpoint,
)
from kvindex.subscriber.state import Checkpoint

log = logging.getLogger(__name__)

RUN = 200  # items per script call: a script blocks Redis while it runs
TAKE = 4_000  # items per pipeline
# A range this replica lost waits this long before it is logged (and what follows it of
# that publisher with it): another replica that has the real batches logs them first, and
# the lost mark then covers only what nobody had (else the mark won, and the real
# batches were skipped as duplicates: the replicas differed, and one from itself after a
# restart).
LOST_HOLD = 1.0


@dataclass(slots=True)
class Item:
    """One thing to append: kind b (a=seq, b=digest, prev=digest of the batch before),
    l (seqs a..b lost), r (a, b = where the replica stood when it saw the restart)."""

    source: SourceKey
    kind: str
    a: int
    b: str
    payload: bytes = b""
    prev: str = ""
    at: float = 0.0  # when a lost range was queued (see LOST_HOLD)

    def args(self) -> list[Any]:
        return [self.kind, self.a, self.b, self.prev, self.payload]


@dataclass(slots=True)
class AppendStats:
    appended: int = 0
    dropped: int = 0
    gap_fills: int = 0
    refetched: int = 0
    lost: int = 0
    unregistered: int = 0
    conflicts: int = 0  # batches another replica logged differently (see APPEND)


@dataclass
class Appender:
    """The queue of items to append and the replica's own position per publisher."""

    limit: int
    spec_of: Callable[[str], InstanceSpec | None]
    fill_timeout: float = 20.0
    queue: deque[Item] = field(default_factory=deque)
    mine: dict[SourceKey, tuple[int, str]] = field(default_factory=dict)
    short: set[SourceKey] = field(default_factory=set)  # batches dropped since the last flush
    diverged: set[SourceKey] = field(default_factory=set)  # see APPEND
    stats: AppendStats = field(default_factory=AppendStats)
    lost_hold: float = LOST_HOLD
    # Instances whose appends Redis refused as unregistered, said once until one lands.
    unregistered: set[str] = field(default_factory=set)

    # -- from the service ---------------------------------------------------------------

    def batch(self, source: SourceKey, seq: int, payload: bytes) -> None:
        digest = str(zlib.crc32(payload))
        prev = self.mine.get(source, (0, ""))[1]
        self.mine[source] = (seq + 1, digest)
        if len(self.queue) >= self.limit:
            self.stats.dropped += 1
            self.short.add(source)
            return
        self.queue.append(Item(source, "b", seq, digest, payload, prev))

    def lost(self, source: SourceKey, first: int, last: int) -> None:
        self.mine[source] = (last + 1, "")
        self.queue.append(Item(source, "l", first, str(last), at=time.monotonic()))

    def restart(self, source: SourceKey) -> None:
        where, digest = self.mine.get(source, (0, ""))
        self.mine[source] = (0, "")
        self.queue.append(Item(source, "r", where, digest))

    def forget(self, name: str) -> None:
        self.queue = deque(i for i in self.queue if i.source.instance != name)
        self.mine = {k: v for k, v in self.mine.items() if k.instance != name}
        self.short = {s for s in self.short if s.instance != name}
        self.unregistered.discard(name)

    def forget_source(self, source: SourceKey) -> None:
        """One publisher of an instance that goes on (a spec with fewer DP ranks)."""
        self.queue = deque(i for i in self.queue if i.source != source)
        self.mine.pop(source, None)
        self.short.discard(source)
        self.diverged.discard(source)

    # -- to Redis -----------------------------------------------------------------------

    def flush(self, client: redis.Redis) -> bool:
        """Append what is queued (but lost ranges younger than `lost_hold`, and what
        follows each of its publisher); returns True once the queue is empty and no log
        is short."""
        script = client.register_script(APPEND)
        self.queue, held = self._hold_lost()
        try:
            while self.queue:
                self._flush_some(client, script)
        finally:
            self.queue.extend(held)  # each publisher's items stay in their order
        for source in list(self.short):
            self.short.discard(source)
            where = self.mine.get(source)
            if where is not None:
                self._fill_to(client, script, source, where[0])
        return not self.queue

    def held_for(self) -> float | None:
        """Seconds until the first lost range held back may be logged (None: none)."""
        ats = [item.at for item in self.queue if item.kind == "l" and item.at]
        if not ats:
            return None
        return max(0.0, min(ats) + self.lost_hold - time.monotonic())

    def _hold_lost(self) -> tuple[deque[Item], deque[Item]]:
        """The queue split in what may go now and what waits (see LOST_HOLD): a lost
        range too young, and every item of its publisher after it."""
        ready: deque[Item] = deque()
        held: deque[Item] = deque()
        holding: set[SourceKey] = set()
        now = time.monotonic()
        for item in self.queue:
            if item.kind == "l" and item.at and now - item.at < self.lost_hold:
                holding.add(item.source)
            (held if item.source in holding else ready).append(item)
        return ready, held

    def _flush_some(self, client: redis.Redis, script: Any) -> None:
        taken = [self.queue.popleft() for _ in range(min(TAKE, len(self.queue)))]
        runs = _runs(taken)
        pipe = client.pipeline(transaction=False)
        for source, items in runs:
            keys = [cp_key(source), log_key(source), INSTANCES]
            args: list[Any] = [source.instance, int(source in self.diverged)]
            for item in items:
                args.extend(item.args())
            script(keys=keys, args=args, client=pipe)
        try:
            results = pipe.execute()
        except BaseException:
            self.queue.extendleft(reversed(taken))  # all of it is retried (appends dedup)
            raise
        retry: list[Item] = []
        gaps: dict[SourceKey, int] = {}  # the first gap of each publisher: where it ends
        for (source, items), result in zip(runs, results, strict=True):
            done, code, _next, conflicts, diverged = (int(x) for x in result)
            self.stats.appended += done - conflicts
            self.stats.conflicts += conflicts
            if diverged:
                self.diverged.add(source)
            else:
                self.diverged.discard(source)
            if code == -2:
                self._refused(source, len(items) - int(done))
                continue
            self.unregistered.discard(source.instance)
            rest = items[int(done) :]
            if code == -1 and rest:
                # A publisher's later runs in this pipeline met the same gap (the log's
                # next seq did not move): only the first is filled, the rest retried.
                gaps.setdefault(source, rest[0].a)
            retry.extend(rest)
        self.queue.extendleft(reversed(retry))
        for source, target in gaps.items():  # the items stay queued until the gap is filled
            self._fill_to(client, script, source, target)

    def _refused(self, source: SourceKey, count: int) -> None:
        """Redis does not know the instance: removed by another replica meanwhile, or
        Redis restarted empty or was flushed. The second loses every append from then on:
        say it loudly, once per instance until its appends land again."""
        self.stats.unregistered += count
        self.short.add(source)  # fetched again from the publisher once it is registered
        name = source.instance
        if name in self.unregistered or self.spec_of(name) is None:
            return  # said already, or removed (the registry this replica read says so)
        self.unregistered.add(name)
        log.error(
            "Redis does not know instance %r (restarted empty or flushed?): its batches are "
            "not stored (%d dropped so far, all instances); the other replicas and a warm "
            "restart will miss them until it is registered again",
            name,
            self.stats.unregistered,
        )

    def _fill_to(self, client: redis.Redis, script: Any, source: SourceKey, target: int) -> None:
        """Bring the log of `source` up to seq `target` from the publisher's replay. Where
        the log stands is read now, its seq and digest together: the replay is checked
        against that digest, and a seq from an earlier reply (a second gap of the same
        publisher in one pipeline, filled meanwhile by the first) paired with the digest
        of now failed that check, so the batches were logged as lost though the
        publisher held them (the Sentinel failover test's incomplete store)."""
        raw_n, raw_d = cast(list[bytes | None], client.hmget(cp_key(source), ["n", "d"]))
        n = int(raw_n or 0)
        if n >= target:
            return
        start = Checkpoint(n, int(raw_d) if raw_d else None)
        self.stats.gap_fills += 1
        items = fetch_range(self.spec_of(source.instance), source, start, target, self.fill_timeout)
        for item in items:
            if item.kind == "b":
                self.stats.refetched += 1
            else:
                self.stats.lost += int(item.b) - item.a + 1
        for i in range(0, len(items), RUN):
            args: list[Any] = [source.instance, 0]
            for item in items[i : i + RUN]:
                args.extend(item.args())
            script(keys=[cp_key(source), log_key(source), INSTANCES], args=args)
        log.warning("refilled the log of %r up to seq %d (%d entries)", source, target, len(items))


def _runs(items: list[Item]) -> list[tuple[SourceKey, list[Item]]]:
    """Consecutive runs per publisher (their relative order kept), at most RUN long."""
    by_source: dict[SourceKey, list[list[Item]]] = {}
    order: list[tuple[SourceKey, list[Item]]] = []
    for item in items:
        runs = by_source.setdefault(item.source, [])
        if not runs or len(runs[-1]) >= RUN:
            runs.append([])
            order.append((item.source, runs[-1]))
        runs[-1].append(item)
    return order


def fetch_range(
    spec: InstanceSpec | None, source: SourceKey, start: Checkpoint, target: int, timeout: float
) -> list[Item]:
    """Batches start.next_seq..target-1 of one publisher, from its replay buffer (with the
    Subscriber's checks that it is still the same engine); what it can't give is lost."""
    out: list[Item] = []
    nxt = start.next_seq
    if spec is not None and spec.replay_endpoint is not None:
        nxt = _replay_into(out, spec, source, start, target, timeout)
    if nxt < target:
        out.append(Item(source, "l", nxt, str(target - 1)))
    return out


def _replay_into(
    out: list[Item],
    spec: InstanceSpec,
    source: SourceKey,
    start: Checkpoint,
    target: int,
    timeout: float,
) -> int:
    assert spec.replay_endpoint is not None
    rank = source.rank
    one = InstanceSpec(
        spec.name,
        offset_endpoint(spec.endpoint, rank),
        offset_endpoint(spec.replay_endpoint, rank),
        spec.topic,
        1,
        spec.curve,
        spec.client_key,
    )
    key = SourceKey(spec.name, 0)
    policy = ReplayPolicy(idle_probe=None, max_attempts=2)
    sub = Subscriber(instances=[one], resume={key: start}, decode=False, policy=policy)
    nxt, deadline = start.next_seq, time.monotonic() + timeout
    prev = "" if start.last_digest is None else str(start.last_digest)
    try:
        while nxt < target and time.monotonic() < deadline:
            for item in sub.poll(0.1):
                if isinstance(item, Restarted | Unverified):
                    return nxt  # another engine now: the old seqs are gone
                if isinstance(item, Delivery) and nxt <= item.seq < target:
                    payload = item.payload or b""
                    digest = str(zlib.crc32(payload))
                    out.append(Item(source, "b", item.seq, digest, payload, prev))
                    nxt, prev = item.seq + 1, digest
                elif isinstance(item, Lost) and item.last >= nxt and item.first < target:
                    last = min(item.last, target - 1)
                    out.append(Item(source, "l", max(item.first, nxt), str(last)))
                    nxt, prev = last + 1, ""
    finally:
        sub.close()
    return nxt
