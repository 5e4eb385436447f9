"""What a `Subscriber` yields: batches, and notices about the stream between them."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvindex.wire import EventBatch


class SourceKey(tuple[str, int]):
    """One publisher: an instance name and its data-parallel rank (0 without DP)."""

    __slots__ = ()

    def __new__(cls, instance: str, rank: int = 0) -> SourceKey:
        return super().__new__(cls, (instance, rank))

    @property
    def instance(self) -> str:
        return self[0]

    @property
    def rank(self) -> int:
        return self[1]

    def __repr__(self) -> str:
        return f"{self[0]}[{self[1]}]" if self[1] else self[0]


@dataclass(frozen=True, slots=True)
class Delivery:
    """One published batch, delivered once, in seq order. Unpacks as (instance, seq, batch)."""

    source: SourceKey
    seq: int
    batch: EventBatch
    replayed: bool = False
    payload_size: int = 0
    payload: bytes | None = None  # the raw msgpack, when the Subscriber keeps payloads

    @property
    def instance(self) -> str:
        return self.source.instance

    @property
    def rank(self) -> int:
        return self.source.rank

    def __iter__(self) -> Iterator[Any]:
        return iter((self.source.instance, self.seq, self.batch))


@dataclass(frozen=True, slots=True)
class Notice:
    """Something about the stream of one publisher that user code may have to act on."""

    source: SourceKey

    @property
    def instance(self) -> str:
        return self.source.instance

    @property
    def rank(self) -> int:
        return self.source.rank

    def describe(self) -> str:
        return type(self).__name__


@dataclass(frozen=True, slots=True)
class Restarted(Notice):
    """The publisher restarted (its seq went back, or its replay buffer is another stream).

    Its cache is empty now: drop everything known about this source before applying the
    deliveries that follow.
    """

    last_seq: int | None = None
    new_seq: int | None = None
    reason: str = ""

    def describe(self) -> str:
        how = f" ({self.reason})" if self.reason else ""
        return f"publisher restarted{how}: seq {self.last_seq} -> {self.new_seq}, state dropped"


@dataclass(frozen=True, slots=True)
class Discarded(Restarted):
    """What the replay endpoint served is contradicted by the live stream (a batch the live
    stream then brought differently, or seqs the live stream had not reached): its answers
    can't be told from invented ones, so everything known of this source is dropped, as
    for a restart (it is a `Restarted`, so consumers drop their state the same way), and the
    source follows the live stream from here, `incomplete`. The engine did not restart."""

    def describe(self) -> str:
        return f"state dropped at seq {self.last_seq}: {self.reason}"


@dataclass(frozen=True, slots=True)
class ReplayRefused(Notice):
    """An answer of the replay endpoint was refused (`reason`: a seq not asked for or out of
    order, a batch the live stream contradicts, a reply that is no reply, past the replay's
    deadline or byte budget): the replay ended there; what it had not brought is `Lost`,
    and no replay is asked of that endpoint for `backoff` seconds."""

    reason: str = ""
    backoff: float = 0.0

    def describe(self) -> str:
        return f"replay refused: {self.reason}; not asking again for {self.backoff:.0f} s"


@dataclass(frozen=True, slots=True)
class Gap(Notice):
    """Batches `first..last` were missed live; a replay was asked for them."""

    first: int = 0
    last: int = 0

    def describe(self) -> str:
        return f"gap: missed seq {self.first}..{self.last}, replaying"


@dataclass(frozen=True, slots=True)
class Lost(Notice):
    """Batches `first..last` can never be delivered (the publisher no longer has them, or
    its replay did not answer). The source's state is incomplete from here on."""

    first: int = 0
    last: int = 0
    reason: str = ""

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    def describe(self) -> str:
        return f"lost {self.count} batches (seq {self.first}..{self.last}): {self.reason}"


@dataclass(frozen=True, slots=True)
class Unverified(Notice):
    """It could not be checked that the publisher is still the process whose batch
    `anchor_seq` we hold (its replay did not answer after a reconnect, or its buffer no
    longer reaches back that far). Delivery goes on, but the state is marked incomplete (it
    may mix an old and a new engine) until the next restart."""

    anchor_seq: int = 0
    reason: str = ""

    def describe(self) -> str:
        return (
            f"could not check that the publisher is still the engine whose seq "
            f"{self.anchor_seq} we hold ({self.reason}): incomplete"
        )


@dataclass(frozen=True, slots=True)
class Replayed(Notice):
    """A replay finished: `count` batches from seq `start` on came from the replay buffer."""

    start: int = 0
    count: int = 0

    def describe(self) -> str:
        last = self.start + self.count - 1
        return f"replayed {self.count} batches (seq {self.start}..{last})"


@dataclass(frozen=True, slots=True)
class DecodeFailed(Notice):
    """The batch `seq` could not be decoded; it is skipped (its seq still counts)."""

    seq: int = 0
    error: str = ""

    def describe(self) -> str:
        return f"seq {self.seq} skipped: {self.error}"


@dataclass(frozen=True, slots=True)
class Malformed(Notice):
    """A message that is not vLLM's frame layout at all (counted, skipped)."""

    error: str = ""

    def describe(self) -> str:
        return f"malformed message skipped: {self.error}"


@dataclass(frozen=True, slots=True)
class Unreachable(Notice):
    """The publisher can't be followed, and `reason` says why (a host that doesn't resolve,
    nothing listening, a refused CURVE handshake, ...); the link has been down `seconds`.
    Said when it is found out and again about once a minute while it lasts."""

    endpoint: str = ""
    reason: str = ""
    seconds: float = 0.0

    def describe(self) -> str:
        lasting = f" (for {self.seconds:.0f} s)" if self.seconds >= 1 else ""
        return f"can't follow {self.endpoint}{lasting}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Connection(Notice):
    """The publisher's socket connected or went away (ZMQ reconnects by itself)."""

    connected: bool = True

    def describe(self) -> str:
        return "connected" if self.connected else "disconnected"


Item = Delivery | Notice


class Status(enum.StrEnum):
    CONNECTING = "connecting"
    REPLAYING = "replaying"
    LIVE = "live"
    INCOMPLETE = "incomplete"
    DOWN = "down"
    # The engine says it sleeps (its /metrics): its GPU blocks are gone until it sends
    # again. Never a link's status: the Fleet sets it (see Fleet.sleep_state).
    ASLEEP = "asleep"


@dataclass(slots=True)
class SourceStats:
    """Counters of one publisher. `lost_batches` > 0 (since the last restart) = incomplete."""

    received: int = 0  # live messages taken off the SUB socket
    delivered: int = 0
    replayed_batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    lost_batches: int = 0
    lost_since_restart: int = 0
    decode_errors: int = 0
    malformed_messages: int = 0
    unknown_events: int = 0
    handshake_failures: int = 0  # ZMTP/CURVE handshakes refused on the SUB link
    publisher_restarts: int = 0
    unverified_reconnects: int = 0
    replay_requests: int = 0
    replay_failures: int = 0  # requests that ended without all they were asked for
    replay_refusals: int = 0  # answers refused as wrong (see `ReplayRefused`)
    last_seq: int | None = None
    last_ts: float | None = None
    connected: bool = False
    problem: str | None = None  # why the link is down, once diagnosed (see `Unreachable`)
    extra: dict[str, Any] = field(default_factory=dict)
