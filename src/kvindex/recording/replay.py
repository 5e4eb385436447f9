"""Replaying a recording as vLLM-compatible publishers (PUB + replay ROUTER per source).

Each recorded source (instance, DP rank) gets its own publisher. Payloads go out byte for
byte under their recorded seqs; a recorded restart restarts that publisher (seq back to
the new stream's first seq, replay buffer emptied), and recorded holes (lost batches)
stay holes. Pacing follows the recorded receive times, scaled by `speed` (None: as fast
as possible); the pause between two recording sessions of an appended file is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import zmq

from kvindex.recording.format import BatchRec, NoticeRec, SessionRec
from kvindex.recording.reader import records
from kvindex.subscriber import InstanceSpec, SourceKey, offset_endpoint
from kvindex.wire.publisher import Publisher

__all__ = ["ReplayPublisher", "ReplayStats", "Target", "plan", "recorded_sources", "replay"]

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


def recorded_sources(path: str) -> list[SourceKey]:
    """The sources of a recording: instances in order of first appearance, ranks sorted."""
    ranks: dict[str, set[int]] = {}
    for rec in records(path):
        if isinstance(rec, BatchRec | NoticeRec):
            ranks.setdefault(rec.instance, set()).add(rec.rank)
    return [SourceKey(name, rank) for name, rs in ranks.items() for rank in sorted(rs)]


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

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


class _Clock:
    """Maps recorded receive times to when to send, at `speed` (None: no waiting)."""

    def __init__(self, speed: float | None) -> None:
        self.speed = speed
        self.origin: tuple[float, float] | None = None  # (recorded time, monotonic time)

    def rebase(self) -> None:
        self.origin = None

    def delay(self, received: float) -> float:
        if self.speed is None:
            return 0.0
        now = time.monotonic()
        if self.origin is None:
            self.origin = (received, now)
            return 0.0
        recorded, start = self.origin
        return start + (received - recorded) / self.speed - now


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
) -> ReplayStats:
    """Send the recording through `pubs` (from `open_publishers`), paced by `speed`."""
    stats = ReplayStats()
    clock = _Clock(speed)
    for rec in records(path):
        if stop():
            break
        if isinstance(rec, SessionRec):
            clock.rebase()
        elif isinstance(rec, NoticeRec) and rec.kind == "Restarted":
            pub = pubs.get(SourceKey(rec.instance, rec.rank))
            if pub is not None:
                pub.restart()
                stats.restarts += 1
        elif isinstance(rec, BatchRec) and not _send(rec, pubs, clock, stop, stats):
            break
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
    wait = clock.delay(rec.received)
    if wait > 0 and not _sleep(wait, stop):
        return False
    pub.publish_at(rec.seq, rec.payload)
    stats.batches += 1
    stats.per_source[source] = stats.per_source.get(source, 0) + 1
    return True
