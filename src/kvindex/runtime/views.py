"""What every face of the service shows of the fleet, computed once here.

`/v1/instances`, `/v1/stats`, the dashboard and `/metrics` all render the same
`InstanceView`s (with their `RankView`s) and the same `FleetSummary`; `/v1/lookup`, the
dashboard's lookup box and a library caller get the same `LookupAnswer`. The faces only
choose which fields to show and how to spell them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvindex.runtime.approximate import ApproxStats
from kvindex.runtime.discovery import DiscoveryView
from kvindex.runtime.finders.reconcile import FoundBy
from kvindex.subscriber import InstanceSpec, Status
from kvindex.wire.tiers import tier_counts

__all__ = [
    "RECOVERY_COUNTERS",
    "STATUS_ORDER",
    "FleetSummary",
    "InstanceMatch",
    "InstanceView",
    "LookupAnswer",
    "RankLoad",
    "RankMatch",
    "RankView",
    "StoreHealth",
    "worst_status",
]

# Worst last: an instance reports the worst status among its DP ranks.
STATUS_ORDER: tuple[Status, ...] = (
    Status.LIVE,
    Status.ASLEEP,
    Status.REPLAYING,
    Status.CONNECTING,
    Status.INCOMPLETE,
    Status.DOWN,
)
_SEVERITY = {status: i for i, status in enumerate(STATUS_ORDER)}

# The RankView counters an instance sums over its ranks, as every face shows them.
RECOVERY_COUNTERS = (
    "gaps",
    "replayed_batches",
    "lost_batches",
    "decode_errors",
    "publisher_restarts",
    "malformed_messages",
    "handshake_failures",
    "replay_failures",
    "replay_refusals",
)


def worst_status(statuses: Iterable[Status], default: Status = Status.CONNECTING) -> Status:
    """The status an instance shows: its worst rank's (`default` if it has none: an
    engine named by its URL not found yet is `connecting`, one without events `live`)."""
    return max(statuses, key=_SEVERITY.__getitem__, default=default)


class RankLoad(msgspec.Struct, frozen=True, gc=False):
    """A DP rank's load, from its engine's load stream (SGLang's `LoadStat`): the cheapest
    load signal there is, read at most a second or so ago (`age_seconds` says)."""

    running_requests: int
    waiting_requests: int
    max_running_requests: int | None  # the scheduler's limit (None: not sent)
    kv_tokens_used: int
    kv_tokens_total: int | None  # KV capacity in tokens (None: not sent)
    kv_usage: float | None  # used / total, 0..1
    waiting_uncached_tokens: int  # prompt tokens waiting for prefill, not cached
    age_seconds: float  # since the newest reading came
    readings: int  # readings received
    malformed: int  # load messages skipped (not a LoadStat)


class RankView(msgspec.Struct, frozen=True, gc=False):
    """One DP rank of an instance, as the Subscriber and the index see it now (the API
    encodes it as it is: one rank of `GET /v1/instances`)."""

    rank: int
    status: Status
    last_seq: int | None
    gaps: int
    received: int
    delivered: int
    replayed_batches: int
    lost_batches: int
    decode_errors: int
    publisher_restarts: int
    last_batch_ts: float | None
    ingest_lag_seconds: float | None
    problem: str | None = None  # why its publisher can't be followed, once diagnosed
    malformed_messages: int = 0  # messages that are not vLLM's frame layout (skipped)
    handshake_failures: int = 0  # ZMTP/CURVE handshakes the link failed
    replay_failures: int = 0  # replay requests that ended without all they asked for
    replay_refusals: int = 0  # replay answers refused as wrong (seq, batch, size, time)
    load: RankLoad | None = None  # its load stream's newest reading (SGLang), if any


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance now: its spec, status (the worst of its ranks), counters and blocks."""

    spec: InstanceSpec
    status: Status
    ranks: list[RankView]
    blocks: int
    blocks_by_medium: dict[str, int]
    stored: int
    removed: int
    clears: int
    batches: int
    discovery: DiscoveryView | None = None  # an engine named by its URL: how it was found
    # How the index placed the engine's blocks (index.stats.CacheStats, since start).
    unplaced: int = 0  # held without a place in the prefix tree: found by hash only
    unrecognised_keys: int = 0  # extra keys of a shape this version doesn't know
    namespace_kept: int = 0  # unkeyed lower-tier stores that kept the keyed copy's namespace
    namespace_moved: int = 0  # entries moved when the keyed copy came after the unkeyed one
    found: FoundBy | None = None  # found by --discover (a k8s pod, a DNS name); None: named
    # An engine without events (`events=none`): its approximate cache (what was routed there)
    approximate_cache: ApproxStats | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def approximate(self) -> bool:
        """An engine without KV events (`events=none`): its cache is what was routed there."""
        return self.spec.events_none

    @property
    def blocks_by_tier(self) -> dict[str, int]:
        """`blocks_by_medium` in the tier vocabulary (`gpu`, `cpu`, `disk`, `external`)."""
        return tier_counts(self.blocks_by_medium)

    @property
    def last_seq(self) -> int | None:
        seqs = [r.last_seq for r in self.ranks if r.last_seq is not None]
        return max(seqs) if seqs else None

    def total(self, counter: str) -> int:
        """A counter summed over ranks (`gaps`, `lost_batches`, ...)."""
        return sum(int(getattr(r, counter)) for r in self.ranks)

    def totals(self) -> dict[str, int]:
        """Every RECOVERY_COUNTERS counter summed over ranks, by name."""
        return {counter: self.total(counter) for counter in RECOVERY_COUNTERS}

    @property
    def ingest_lag_seconds(self) -> float | None:
        lags = [r.ingest_lag_seconds for r in self.ranks if r.ingest_lag_seconds is not None]
        return max(lags) if lags else None

    @property
    def problem(self) -> str | None:
        """Why a rank's publisher can't be followed (the first such rank's), if one can't;
        else why an engine named by its URL could not be read (if it could not)."""
        return next(
            (
                f"rank {r.rank}: {r.problem}" if len(self.ranks) > 1 else r.problem
                for r in self.ranks
                if r.problem
            ),
            None if self.discovery is None else self.discovery.problem,
        )

    @property
    def last_batch_age_seconds(self) -> float | None:
        stamps = [r.last_batch_ts for r in self.ranks if r.last_batch_ts is not None]
        return max(0.0, time.time() - max(stamps)) if stamps else None


@dataclass(frozen=True, slots=True)
class FleetSummary:
    """Totals over every instance: what `/v1/stats`, the dashboard's header and the
    metrics show of the fleet as a whole."""

    instances: int
    statuses: dict[Status, int]  # every status of STATUS_ORDER, 0 where none has it
    blocks: int
    blocks_by_medium: dict[str, int]
    stored: int
    removed: int
    clears: int
    batches: int
    counters: dict[str, int]  # RECOVERY_COUNTERS summed over every instance
    ingest_lag_seconds: float | None  # the largest
    entries: int  # (rank, pool, hash) entries in the index
    backlog: int  # items read but not applied yet

    @property
    def blocks_by_tier(self) -> dict[str, int]:
        return tier_counts(self.blocks_by_medium)

    @classmethod
    def of(cls, views: list[InstanceView], *, entries: int, backlog: int) -> FleetSummary:
        by_medium: dict[str, int] = {}
        for view in views:
            for medium, count in view.blocks_by_medium.items():
                by_medium[medium] = by_medium.get(medium, 0) + count
        lags = [v.ingest_lag_seconds for v in views if v.ingest_lag_seconds is not None]
        return cls(
            instances=len(views),
            statuses={s: sum(v.status == s for v in views) for s in STATUS_ORDER},
            blocks=sum(v.blocks for v in views),
            blocks_by_medium=by_medium,
            stored=sum(v.stored for v in views),
            removed=sum(v.removed for v in views),
            clears=sum(v.clears for v in views),
            batches=sum(v.batches for v in views),
            counters={c: sum(v.total(c) for v in views) for c in RECOVERY_COUNTERS},
            ingest_lag_seconds=max(lags) if lags else None,
            entries=entries,
            backlog=backlog,
        )


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """How the state store is doing: what /healthz, /v1/stats and /metrics say of it.

    `up` is false while the store can't persist (its worker died and is being started
    again, or can't write: a full disk); `reason` says why. Lookups are answered from
    memory all along: a store that is down makes the service `degraded`, not unhealthy.
    `lag_seconds` is the age of the oldest applied item not durable yet (0: none)."""

    url: str
    up: bool = True
    reason: str | None = None
    restarts: int = 0
    last_error: str | None = None
    lag_seconds: float = 0.0
    pending_groups: int = 0
    dropped_batches: int = 0
    refused_batches: int = 0  # handed to the store, refused as written already
    detail: dict[str, Any] = field(default_factory=dict)  # the store's own counters


# -- lookups: msgspec structs, encoded as they are (a lookup answer is on the hot path) --


class RankMatch(msgspec.Struct, frozen=True, gc=False):
    """How many blocks of the prompt one DP rank holds, from the first."""

    rank: int
    matched_blocks: int


class InstanceMatch(msgspec.Struct, frozen=True, gc=False):
    """One instance's row of a lookup: what its best rank would reuse, and every rank's
    beside it. `by_tier` splits `matched_blocks` by tier (`gpu` first, then the run lower
    tiers hold from there); `by_group` is each KV cache group's own GPU hit (hybrid models).

    `matched_tokens` and `block_size` are None for a lookup by block hashes (no tokens)."""

    name: str
    status: Status
    matched_blocks: int
    matched_tokens: int | None
    block_size: int | None
    best_rank: int
    ranks: list[RankMatch]
    by_tier: dict[str, int] = {}
    by_group: dict[int, int] = {}


class LookupAnswer(msgspec.Struct, frozen=True, gc=False):
    """One row per followed instance, best first; `best` is where a router should send the
    prompt: never a `down` instance, None when no instance holds its first block."""

    best: str | None
    instances: list[InstanceMatch]

    @property
    def hit(self) -> bool:
        """Whether any instance holds at least the prompt's first block."""
        return any(row.matched_blocks for row in self.instances)
