"""Replaying a recording as vLLM-compatible publishers (PUB + replay ROUTER per source).

Each recorded source (instance, DP rank) gets its own publisher. Payloads go out byte for
byte under their recorded seqs; a recorded restart restarts that publisher (seq back to
the new stream's first seq, replay buffer emptied), and recorded holes (lost batches)
stay holes.

Pacing follows the batches' own timestamps (when the engine published them), scaled by
`speed` (None: as fast as possible); not the receive times, which bunch up whatever a
recorder caught up from a replay buffer. A batch whose time lies before one already sent
(another engine's clock, a catch-up) goes at once. The pause between two recording
sessions of an appended file is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from kvindex.recording.format import BatchRec, NoticeRec, SessionRec
from kvindex.recording.reader import Reader
from kvindex.subscriber import InstanceSpec, SourceKey, offset_endpoint
from kvindex.wire.publisher import Publisher

__all__ = [
    "ReplayPublisher",
    "ReplayStats",
    "Survey",
    "Target",
    "batch_time",
    "plan",
    "recorded_sources",
    "replay",
    "survey",
]

_SLEEP_SLICE = 0.1  # the longest a stop request waits during a pause


class ReplayPublisher(Publisher):
    """A `Publisher` that sends payloads under given seqs (a recording's own)."""

    def publish_at(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:  # the stream went back without a recorded restart
            self.restart()
        self.put(seq, payload)


@dataclass(frozen=True, slots=True)
class Target:
    """Where one recorded source is republished."""

    source: SourceKey
    endpoint: str
    replay_endpoint: str | None = None


_ts_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])


def batch_time(rec: BatchRec) -> float:
    """When the engine published the batch (its own timestamp, the payload's first field),
    or the receive time when the payload has no usable one. Only that field is decoded."""
    try:
        ts = msgspec.msgpack.decode(_ts_decoder.decode(rec.payload)[0], type=float)
    except (msgspec.DecodeError, IndexError):
        return rec.received
    return ts if 0 < ts < float("inf") else rec.received


@dataclass(slots=True)
class Survey:
    """What a recording holds, read once before replaying it."""

    sources: list[SourceKey]  # instances in order of first appearance, ranks sorted
    batches: int
    span: float  # seconds from the first batch's time to the last's (one session's)
    damage: str | None = None
    truncated: bool = False


def survey(path: str) -> Survey:
    ranks: dict[str, set[int]] = {}
    batches = 0
    span = 0.0
    first: float | None = None
    last = 0.0
    reader = Reader(path)
    for rec in reader:
        if isinstance(rec, SessionRec):
            if first is not None:
                span += last - first
            first = None
        elif isinstance(rec, BatchRec | NoticeRec):
            ranks.setdefault(rec.instance, set()).add(rec.rank)
            if isinstance(rec, BatchRec):
                batches += 1
                t = batch_time(rec)
                first = t if first is None else min(first, t)
                last = max(last, t)
    if first is not None:
        span += last - first
    sources = [SourceKey(name, rank) for name, rs in ranks.items() for rank in sorted(rs)]
    return Survey(sources, batches, span, reader.damage, reader.truncated)


def recorded_sources(path: str) -> list[SourceKey]:
    """The sources of a recording: instances in order of first appearance, ranks sorted."""
    return survey(path).sources


def plan(
    sources: Sequence[SourceKey],
    pub: str | None = None,
    replay_base: str | None = None,
    specs: Iterable[InstanceSpec] = (),
) -> list[Target]:
    """Endpoints per source: from an instance's spec if given (rank r on port + r, as vLLM
    binds them), else on consecutive ports from `pub` (and `replay_base`), each instance's
    ranks together. Raises ValueError for a source that gets no endpoint."""
    by_name = {spec.name: spec for spec in specs}
    targets: list[Target] = []
    slot = 0
    for name in dict.fromkeys(s.instance for s in sources):
        ranks = [s.rank for s in sources if s.instance == name]
        spec = by_name.get(name)
        for rank in ranks:
            if spec is not None:
                ep, rep = spec.endpoint, spec.replay_endpoint
                where = _offset(ep, rep, rank)
            elif pub is not None:
                where = _offset(pub, replay_base, slot + rank)
            else:
                raise ValueError(f"no endpoint for recorded instance {name!r}: give --pub")
            targets.append(Target(SourceKey(name, rank), *where))
        if spec is None:
            slot += max(ranks) + 1
    return targets


def _offset(endpoint: str, replay: str | None, n: int) -> tuple[str, str | None]:
    return offset_endpoint(endpoint, n), None if replay is None else offset_endpoint(replay, n)


def serve_specs(targets: Sequence[Target]) -> list[str]:
    """`kvindex serve --instance` specs that follow the replayed publishers."""
    out = []
    for name in dict.fromkeys(t.source.instance for t in targets):
        mine = [t for t in targets if t.source.instance == name]
        first = next((t for t in mine if t.source.rank == 0), mine[0])
        spec = f"{name}={first.endpoint}"
        if first.replay_endpoint:
            spec += f",replay={first.replay_endpoint}"
        dp = max(t.source.rank for t in mine) + 1
        out.append(spec + (f",dp={dp}" if dp > 1 else ""))
    return out


@dataclass(slots=True)
class ReplayStats:
    batches: int = 0
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    per_source: dict[SourceKey, int] = field(default_factory=dict)
    recorded_seconds: float = 0.0  # of recorded time played so far (batch times)
    # Why the replay ended before the end of the file: None if it played it all.
    stopped: str | None = None
    last: tuple[SourceKey, int] | None = None  # the last batch sent: source, seq
    truncated: bool = False  # the file ends mid-segment (its recorder was cut off)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


class _Clock:
    """Maps batch times to when to send them, at `speed` (None: no waiting)."""

    def __init__(self, speed: float | None) -> None:
        self.speed = speed
        self.origin: tuple[float, float] | None = None  # (batch time, monotonic time)
        self.played = 0.0  # recorded seconds of earlier sessions
        self.latest: float | None = None

    def rebase(self) -> None:
        if self.origin is not None and self.latest is not None:
            self.played += self.latest - self.origin[0]
        self.origin, self.latest = None, None

    def seconds(self) -> float:
        """Recorded seconds played so far."""
        if self.origin is None or self.latest is None:
            return self.played
        return self.played + self.latest - self.origin[0]

    def delay(self, t: float) -> float:
        now = time.monotonic()
        if self.origin is None:
            self.origin = (t, now)
        self.latest = t if self.latest is None else max(self.latest, t)
        if self.speed is None:
            return 0.0
        recorded, start = self.origin
        return start + (t - recorded) / self.speed - now


def _sleep(seconds: float, stop: Callable[[], bool]) -> bool:
    """Sleep, waking up for `stop`; False if stopped."""
    end = time.monotonic() + seconds
    while not stop():
        left = end - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, _SLEEP_SLICE))
    return False


def open_publishers(
    targets: Sequence[Target],
    buffer_steps: int = 10_000,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> dict[SourceKey, ReplayPublisher]:
    """Bind one publisher per target (closing those already bound if one fails)."""
    pubs: dict[SourceKey, ReplayPublisher] = {}
    try:
        for t in targets:
            pubs[t.source] = ReplayPublisher(
                t.endpoint, t.replay_endpoint, buffer_steps=buffer_steps, context=context
            )
    except BaseException:
        for pub in pubs.values():
            pub.close()
        raise
    return pubs


def replay(
    path: str,
    pubs: dict[SourceKey, ReplayPublisher],
    *,
    speed: float | None = 1.0,
    stop: Callable[[], bool] = lambda: False,
    tick: Callable[[ReplayStats], None] | None = None,
) -> ReplayStats:
    """Send the recording through `pubs` (from `open_publishers`), paced by `speed`.
    `stats.stopped` says why it ended early: a stop request, or damage in the file (the
    rest can't be read). `tick(stats)` is called after every batch and pause slice."""
    stats = ReplayStats()
    clock = _Clock(speed)
    reader = Reader(path)

    def halted() -> bool:  # between batches and every pause slice: progress, then stop?
        stats.recorded_seconds = clock.seconds()
        if tick is not None:
            tick(stats)
        return stop()

    for rec in reader:
        if halted():
            stats.stopped = "stopped by request"
            break
        if isinstance(rec, SessionRec):
            clock.rebase()
        elif isinstance(rec, NoticeRec) and rec.kind == "Restarted":
            pub = pubs.get(SourceKey(rec.instance, rec.rank))
            if pub is not None:
                pub.restart()
                stats.restarts += 1
        elif isinstance(rec, BatchRec) and not _send(rec, pubs, clock, halted, stats):
            stats.stopped = "stopped by request"
            break
    else:
        if reader.damage is not None:
            stats.stopped = f"the file is damaged: {reader.damage}; the rest can't be read"
        stats.truncated = reader.truncated
    stats.recorded_seconds = clock.seconds()
    return stats


def _send(
    rec: BatchRec,
    pubs: dict[SourceKey, ReplayPublisher],
    clock: _Clock,
    stop: Callable[[], bool],
    stats: ReplayStats,
) -> bool:
    source = SourceKey(rec.instance, rec.rank)
    pub = pubs.get(source)
    if pub is None:
        return True
    wait = clock.delay(batch_time(rec))
    if wait > 0 and not _sleep(wait, stop):
        return False
    pub.publish_at(rec.seq, rec.payload)
    stats.batches += 1
    stats.per_source[source] = stats.per_source.get(source, 0) + 1
    stats.last = (source, rec.seq)
    return True
