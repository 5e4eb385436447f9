"""Where to send a prompt: the routing score over a lookup, and predicted blocks.

**The score** (docs/routing.md has the table and the reasoning). For each candidate, an
instance's DP rank that is not `down` (and serves the model, when the lookup names one):

    score = prefix_weight   x prefix        (the prompt's blocks it would reuse, by tier)
          + queue_weight    x queue         (fewer requests waiting: 1 = the fewest)
          + running_weight  x running       (fewer requests running: 1 = the fewest)
          + kv_weight       x kv_free       (1 - KV-cache usage)

- `prefix` = (sum over tiers of tier_weight x blocks reused from that tier, plus
  predicted_weight x predicted blocks) / the prompt's whole blocks: 0 to 1.
- `queue` and `running` are min-max normalized over the candidates, as llm-d's queue
  scorer does: 1 for the fewest, 0 for the most, 1 for all when they are equal.
- a load scorer is used only when every candidate's load is known (a `LoadSource` knows
  it, and it is no older than `max_load_age`); otherwise it is left out and `why` says so.

The best candidate has the highest score (then more blocks reused, then the name); the
answer's `why` says what each part was worth. A rank's tier split is known for the rank
with the most blocks (the lookup's `by_tier`); another rank's blocks count as GPU blocks.

**Load sources** plug in per instance and DP rank (`LoadSource.load`): vLLM's `/metrics`
(`kvindex.runtime.engine_metrics.MetricsScraper`), or anything else that can say how many
requests wait and run and how full the KV cache is (an SGLang load stream).

**Predictions** close the window between a routing decision and the engine's BlockStored:
`route` records the prompt's token chain on the chosen instance and rank for `ttl`
seconds. Lookups that ask for a score count the blocks a prediction shares with their
prompt (whole blocks, by common prefix, in the same model, LoRA and salt namespace) as
`predicted_blocks` beside the real ones, until the real blocks are there (then the
prediction is dropped) or it expires. They live in this overlay only: the index stays
exact, nothing predicted is stored or persisted, and plain lookups never see them.

**Engines without events** (`events=none` in the spec) have no index rows: their blocks
are what `route` sent there, kept in `ApproximateCaches` (kvindex.runtime.approximate;
an LRU bounded by the engine's pool, aged by a TTL). A scored lookup and `route` count
them as the instance's matched blocks, and its row says `approximate: true`; a route
there records the prompt in that cache instead of a prediction.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvindex.index.multimodal import MMFeature, MMKey, PromptKeys
from kvindex.runtime.approximate import ApproximateCaches
from kvindex.runtime.views import InstanceMatch, LookupAnswer, RankMatch
from kvindex.subscriber import Status

if TYPE_CHECKING:
    from kvindex.runtime.fleet import Fleet

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_TTL",
    "WEIGHT_NAMES",
    "Candidate",
    "Load",
    "LoadSource",
    "NoCandidate",
    "Predictions",
    "RouteAnswer",
    "Router",
    "ScoredAnswer",
    "ScoredMatch",
    "Weights",
]

DEFAULT_BLOCK_SIZE = 16  # vLLM's, for an instance whose block size nothing has shown yet
DEFAULT_TTL = 2.0  # seconds a route's prediction lasts unless its real blocks show first
TIERS = ("gpu", "cpu", "disk", "external")
# What `Weights.of` takes: the scorers' weights, then each tier's.
WEIGHT_NAMES = ("prefix", "queue", "running", "kv", "backlog", "predicted", *TIERS)


class Load(msgspec.Struct, frozen=True, gc=False):
    """How busy one DP rank of an engine is; None where the source can't say."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0 to 1
    at: float = 0.0  # time.monotonic() when it was read
    block_size: int | None = None  # the engine's, where the source knows it
    # uncached prompt tokens waiting for prefill (SGLang's `num_waiting_uncached_tokens`)
    waiting_tokens: float | None = None


def _non_negative(value: object) -> bool:
    """A finite number, 0 or more (not a bool, not NaN)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    return math.isfinite(value) and value >= 0


class LoadSource(Protocol):
    """Says how busy an instance's DP ranks are (None: it knows nothing of it)."""

    def load(self, instance: str) -> Mapping[int, Load] | None: ...


class NoCandidate(LookupError):
    """No instance can take the prompt (none serves the model, or every one is down)."""


@dataclass(frozen=True, slots=True)
class Weights:
    """The score's weights (see the module doc and docs/routing.md)."""

    prefix: float = 3.0
    queue: float = 2.0
    running: float = 1.0
    kv: float = 1.0
    backlog: float = 0.0  # the prefill ahead of the prompt there, in tokens (module doc)
    tiers: Mapping[str, float] = field(
        default_factory=lambda: {"gpu": 1.0, "cpu": 0.8, "disk": 0.5, "external": 0.5}
    )
    predicted: float = 1.0  # a predicted block, against a GPU block's 1.0
    max_load_age: float = 10.0  # seconds: older load figures count as unknown

    def __post_init__(self) -> None:
        for name in ("prefix", "queue", "running", "kv", "backlog", "predicted", "max_load_age"):
            value = getattr(self, name)
            if not _non_negative(value):
                raise ValueError(f"routing weight {name} must be a number >= 0, got {value!r}")
        for tier, value in self.tiers.items():
            if tier not in TIERS:
                raise ValueError(f"unknown tier {tier!r} in the tier weights ({', '.join(TIERS)})")
            if not _non_negative(value):
                raise ValueError(f"tier weight {tier} must be a number >= 0, got {value!r}")

    @classmethod
    def of(cls, values: Mapping[str, float]) -> Weights:
        """The defaults with `values` over them, by flat name (`prefix`, `queue`, `running`,
        `kv`, `predicted`, or a tier: `gpu`, `cpu`, `disk`, `external`), as `serve
        --weights` and the config file's `[routing.weights]` give them; ValueError names a
        bad one."""
        unknown = sorted(set(values) - set(WEIGHT_NAMES))
        if unknown:
            raise ValueError(f"unknown routing weight {unknown[0]!r} ({', '.join(WEIGHT_NAMES)})")
        default = cls()
        tiers = {**default.tiers, **{t: v for t, v in values.items() if t in TIERS}}
        scorers = {k: v for k, v in values.items() if k not in TIERS}
        return cls(**scorers, tiers=tiers)

    def tier(self, name: str) -> float:
        return float(self.tiers.get(name, 0.0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "queue": self.queue,
            "running": self.running,
            "kv": self.kv,
            "backlog": self.backlog,
            "tiers": {t: self.tier(t) for t in TIERS},
            "predicted": self.predicted,
        }


# -- answers ----------------------------------------------------------------------------


class LoadOut(msgspec.Struct, frozen=True, gc=False):
    waiting: float | None
    running: float | None
    kv_usage: float | None
    age_seconds: float


class Candidate(msgspec.Struct, frozen=True, gc=False):
    """One DP rank's score, and its parts (each already weighted)."""

    rank: int
    matched_blocks: int
    predicted_blocks: int
    score: float
    parts: dict[str, float]
    load: LoadOut | None = None


class ScoredMatch(InstanceMatch, frozen=True, gc=False, kw_only=True):
    """A lookup row (an `InstanceMatch`) with its routing score: `route_rank` is the rank
    the score picks (its `score`), `predicted_blocks` the blocks predictions add there."""

    score: float | None  # None: not a candidate (down)
    route_rank: int | None
    predicted_blocks: int
    candidates: list[Candidate]
    # An engine without events (`events=none`): `matched_blocks` is what was routed there
    # and is still within its pool and TTL (kvindex.runtime.approximate), not its events.
    approximate: bool = False


class ScoredAnswer(msgspec.Struct, frozen=True, gc=False):
    """A lookup answer ordered by the routing score: `best` is the instance the score picks
    (never a `down` one), `best_rank` its rank, `why` says how it won."""

    best: str | None
    best_rank: int | None
    why: str
    prompt_tokens: int
    weights: dict[str, Any]
    instances: list[ScoredMatch]

    @property
    def hit(self) -> bool:
        return any(row.matched_blocks for row in self.instances)


class Prediction(msgspec.Struct, frozen=True, gc=False):
    """What `route` recorded: the prompt's blocks, predicted on the chosen rank."""

    instance: str
    rank: int
    blocks: int
    ttl_seconds: float


class RouteAnswer(msgspec.Struct, frozen=True, gc=False):
    """`POST /v1/route`: the scored answer, and the prediction recorded for the choice."""

    best: str
    best_rank: int
    why: str
    prompt_tokens: int
    predicted: Prediction
    weights: dict[str, Any]
    instances: list[ScoredMatch]


# -- predictions -----------------------------------------------------------------------

# model, LoRA adapter, cache salt, and the digest of a multimodal prompt's keys (predicted
# blocks of an image prompt count only for a lookup with the same keys: a conservative
# simplification, as the blocks before its first image would also serve a plain prompt)
Namespace = tuple[str | None, str | None, str | None, bytes | None]


def _namespace(
    model: str | None,
    lora_name: str | None,
    cache_salt: str | None,
    mm_features: Sequence[MMFeature | Mapping[str, Any]] | None,
    extra_keys: Sequence[Sequence[MMKey] | None] | None,
) -> Namespace:
    keys = PromptKeys.of(mm_features, extra_keys)
    return (model, lora_name, cache_salt, None if keys is None else keys.fingerprint())


@dataclass(slots=True)
class _Predicted:
    instance: str
    rank: int
    tokens: bytes  # uint32 token ids
    block_size: int
    expires: float
    key: tuple[Namespace, int, bytes]
    dropped: bool = False


def _as_bytes(tokens: Sequence[int] | bytes) -> bytes:
    if isinstance(tokens, bytes):
        return tokens
    try:
        return array("I", tokens).tobytes()
    except OverflowError:  # a token id past 32 bits: no prediction can be shared with it
        return b""


def common_blocks(a: bytes, b: bytes, block_size: int) -> int:
    """How many whole blocks of uint32 tokens `a` and `b` share from the start."""
    width = 4 * block_size
    low, high = 0, min(len(a), len(b)) // width
    while low < high:  # the longest equal prefix, by halves: each compare runs in C
        mid = (low + high + 1) // 2
        if a[: mid * width] == b[: mid * width]:
            low = mid
        else:
            high = mid - 1
    return low


class Predictions:
    """Predicted token chains per instance and rank, with an expiry (the module doc).

    Thread-safe; bounded at `max_entries` (the oldest go first)."""

    def __init__(
        self,
        ttl: float = DEFAULT_TTL,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (_non_negative(ttl) and ttl > 0):
            raise ValueError(f"the prediction TTL must be > 0 seconds, got {ttl!r}")
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._order: deque[_Predicted] = deque()  # by expiry (one TTL for all)
        self._by_first: dict[tuple[Namespace, int, bytes], list[_Predicted]] = {}
        self.recorded = 0
        self.confirmed = 0  # dropped because the real blocks arrived
        self.expired = 0

    def __len__(self) -> int:
        return sum(1 for p in self._order if not p.dropped)

    def record(
        self,
        namespace: Namespace,
        instance: str,
        rank: int,
        tokens: Sequence[int] | bytes,
        block_size: int,
    ) -> int:
        """Predict the prompt's whole blocks on (instance, rank); returns how many."""
        data = _as_bytes(tokens)
        blocks = len(data) // (4 * block_size)
        if blocks == 0:
            return 0
        data = data[: blocks * 4 * block_size]
        key = (namespace, block_size, data[: 4 * block_size])
        with self._lock:
            now = self._clock()
            self._expire(now)
            entry = _Predicted(instance, rank, data, block_size, now + self.ttl, key)
            self._order.append(entry)
            self._by_first.setdefault(key, []).append(entry)
            self.recorded += 1
            while len(self._order) > self.max_entries:
                self._drop(self._order.popleft())
        return blocks

    def match(
        self, namespace: Namespace, tokens: Sequence[int] | bytes, block_sizes: Iterable[int]
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """Per (instance, rank): (predicted blocks of this prompt, their block size)."""
        data = _as_bytes(tokens)
        found: dict[tuple[str, int], tuple[int, int]] = {}
        with self._lock:
            self._expire(self._clock())
            if not self._by_first:
                return found
            for size in set(block_sizes):
                entries = self._by_first.get((namespace, size, data[: 4 * size]))
                for entry in entries or ():
                    blocks = common_blocks(entry.tokens, data, size)
                    where = (entry.instance, entry.rank)
                    if blocks > found.get(where, (0, size))[0]:
                        found[where] = (blocks, size)
        return found

    def confirm(
        self,
        namespace: Namespace,
        instance: str,
        rank: int,
        tokens: Sequence[int] | bytes,
        block_size: int,
        real_blocks: int,
    ) -> None:
        """The rank holds `real_blocks` of this prompt for real: drop the predictions of
        it that are no longer ahead of that (the BlockStored they stood for arrived)."""
        data = _as_bytes(tokens)
        key = (namespace, block_size, data[: 4 * block_size])
        with self._lock:
            for entry in list(self._by_first.get(key, ())):
                if entry.instance != instance or entry.rank != rank:
                    continue
                shared = common_blocks(entry.tokens, data, block_size)
                if shared and shared <= real_blocks:
                    self._drop(entry)
                    self.confirmed += 1

    def _expire(self, now: float) -> None:
        order = self._order
        while order and (order[0].dropped or order[0].expires <= now):
            entry = order.popleft()
            if not entry.dropped:
                self._drop(entry)
                self.expired += 1

    def _drop(self, entry: _Predicted) -> None:
        if entry.dropped:
            return
        entry.dropped = True
        entries = self._by_first.get(entry.key)
        if entries is not None:
            entries.remove(entry)
            if not entries:
                del self._by_first[entry.key]


# -- the router ------------------------------------------------------------------------


@dataclass(slots=True)
class _Rank:
    """One candidate while scoring."""

    row: InstanceMatch
    rank: int
    matched: int
    predicted: int
    size: int
    load: Load | None
    uncached: int = 0  # the prompt's tokens it would compute (not reused, not predicted)
    parts: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def score(self) -> float:
        return sum(self.parts.values())


class Router:
    """Scores lookups, routes prompts and keeps the predictions (the module doc).

    `loads` are asked in order for each instance's load (the first that knows wins)."""

    def __init__(
        self,
        fleet: Fleet,
        weights: Weights | None = None,
        loads: Sequence[LoadSource] = (),
        predictions: Predictions | None = None,
    ) -> None:
        self.fleet = fleet
        self.weights = weights or Weights()
        self.loads = list(loads)
        self.predictions = predictions if predictions is not None else Predictions()
        # the events=none engines' caches (none without a fleet: the routing bench's
        # oracle scores the engines' true caches alone)
        self.approximate = fleet.approximate if fleet is not None else ApproximateCaches()
        self._sizes: dict[str, int] = {}  # instance -> block size its answers showed
        self.routed = 0

    # -- public ------------------------------------------------------------------------

    def lookup(
        self,
        tokens: Sequence[int],
        *,
        model: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MMFeature | Mapping[str, Any]] | None = None,
        extra_keys: Sequence[Sequence[MMKey] | None] | None = None,
    ) -> ScoredAnswer:
        """The fleet's lookup of `tokens`, scored; `best` follows the score. With a
        multimodal prompt's keys, predictions count only for the same keys."""
        answer = self.fleet.lookup(
            tokens,
            lora_name,
            cache_salt,
            model=model,
            mm_features=mm_features,
            extra_keys=extra_keys,
        )
        return self.score(
            answer, tokens, _namespace(model, lora_name, cache_salt, mm_features, extra_keys)
        )

    def route(
        self,
        tokens: Sequence[int],
        *,
        model: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MMFeature | Mapping[str, Any]] | None = None,
        extra_keys: Sequence[Sequence[MMKey] | None] | None = None,
    ) -> RouteAnswer:
        """Look up, choose, and predict the prompt's blocks on the choice; raises
        NoCandidate when no instance can take it."""
        namespace = _namespace(model, lora_name, cache_salt, mm_features, extra_keys)
        scored = self.lookup(
            tokens,
            model=model,
            lora_name=lora_name,
            cache_salt=cache_salt,
            mm_features=mm_features,
            extra_keys=extra_keys,
        )
        if scored.best is None or scored.best_rank is None:
            raise NoCandidate(scored.why)
        size = self._block_size(scored.best, model)
        spec = self.fleet.specs.get(scored.best)
        if spec is not None and spec.events_none:  # its cache is what is routed there
            blocks = self.approximate.record(scored.best, namespace, _as_bytes(tokens), size)
            ttl = spec.approx_ttl
        else:
            blocks = self.predictions.record(namespace, scored.best, scored.best_rank, tokens, size)
            ttl = self.predictions.ttl
        self.routed += 1
        return RouteAnswer(
            scored.best,
            scored.best_rank,
            scored.why,
            scored.prompt_tokens,
            Prediction(scored.best, scored.best_rank, blocks, ttl),
            scored.weights,
            scored.instances,
        )

    def score(
        self, answer: LookupAnswer, tokens: Sequence[int], namespace: Namespace
    ) -> ScoredAnswer:
        """`answer` (the fleet's lookup of `tokens` in `namespace`) with scores."""
        for row in answer.instances:
            if row.block_size:
                self._sizes[row.name] = row.block_size
        data = _as_bytes(tokens)
        answer = self._with_approximate(answer, data, namespace)
        predicted = self._predicted(answer, data, namespace)
        candidates = self._candidates(answer, predicted, len(tokens), namespace[0])
        notes = self._score(candidates)
        self._confirm(candidates, namespace, data)
        ranked = sorted(candidates, key=lambda c: (-c.score, -c.matched, c.row.name, c.rank))
        chosen = ranked[0] if ranked else None
        rows = self._rows(answer, candidates)
        why = _explain(chosen, ranked[1:], notes, answer, namespace[0])
        return ScoredAnswer(
            chosen.row.name if chosen else None,
            chosen.rank if chosen else None,
            why,
            len(tokens),
            self.weights.as_dict(),
            rows,
        )

    def _with_approximate(
        self, answer: LookupAnswer, data: bytes, namespace: Namespace
    ) -> LookupAnswer:
        """`answer` with each events=none instance's row filled in from its approximate
        cache (its index row is always empty: it publishes nothing)."""
        if self.fleet is None:
            return answer
        rows = []
        changed = False
        for row in answer.instances:
            spec = self.fleet.specs.get(row.name)
            if spec is None or not spec.events_none:
                rows.append(row)
                continue
            size = self._block_size(row.name, namespace[0])
            matched = self.approximate.match(row.name, namespace, data, size)
            if matched:
                changed = True
                row = msgspec.structs.replace(
                    row,
                    matched_blocks=matched,
                    matched_tokens=matched * size,
                    block_size=size,
                    best_rank=0,
                    ranks=[RankMatch(0, matched)],
                    by_tier={"gpu": matched},
                )
            rows.append(row)
        if not changed:
            return answer
        rows.sort(key=lambda r: (-r.matched_blocks, r.name))
        up = (r.name for r in rows if r.matched_blocks > 0 and r.status != Status.DOWN)
        return LookupAnswer(next(up, None), rows)

    def seen_block_size(self, instance: str) -> int | None:
        """The block size the instance's lookup answers showed (None: none matched yet)."""
        return self._sizes.get(instance)

    def load(self, instance: str) -> Mapping[int, Load] | None:
        """The instance's load per DP rank, from the first source that knows it."""
        for source in self.loads:
            found = source.load(instance)
            if found:
                return found
        return None

    # -- scoring ----------------------------------------------------------------------

    def _block_size(self, instance: str, model: str | None) -> int:
        """The instance's block size: as its answers showed it, else as its spec says
        (`block_size=`, e.g. from `/register`), else as its load source says (vLLM's
        cache_config_info), else another instance's of the model."""
        size = self._sizes.get(instance)
        if size is None:
            spec = self.fleet.specs.get(instance)
            size = spec.block_size if spec is not None else None
        if size is None:
            size = next((ld.block_size for ld in (self.load(instance) or {}).values()), None)
        if size is None and model is not None:  # another instance of the model showed one
            for name in self.fleet.models().get(model, []):
                size = self._sizes.get(name)
                if size is not None:
                    break
        return size or DEFAULT_BLOCK_SIZE

    def _predicted(
        self, answer: LookupAnswer, data: bytes, namespace: Namespace
    ) -> dict[tuple[str, int], tuple[int, int]]:
        sizes = {self._block_size(row.name, namespace[0]) for row in answer.instances}
        return self.predictions.match(namespace, data, sizes) if sizes else {}

    def _candidates(
        self,
        answer: LookupAnswer,
        predicted: dict[tuple[str, int], tuple[int, int]],
        prompt_tokens: int,
        model: str | None,
    ) -> list[_Rank]:
        out = []
        now = time.monotonic()
        for row in answer.instances:
            if row.status == Status.DOWN:
                continue
            loads = self.load(row.name) or {}
            size = row.block_size or self._block_size(row.name, model)
            for rank in row.ranks:
                extra, _ = predicted.get((row.name, rank.rank), (0, size))
                load = loads.get(rank.rank)
                if load is not None and now - load.at > self.weights.max_load_age:
                    load = None
                cand = _Rank(row, rank.rank, rank.matched_blocks, extra, size, load)
                self._prefix(cand, prompt_tokens)
                out.append(cand)
        return out

    def _prefix(self, cand: _Rank, prompt_tokens: int) -> None:
        w = self.weights
        whole = prompt_tokens // cand.size
        if whole == 0:
            cand.parts["prefix"] = 0.0
            return
        if cand.rank == cand.row.best_rank and cand.row.by_tier:
            by_tier = cand.row.by_tier
        else:
            by_tier = {"gpu": cand.matched} if cand.matched else {}
        reused = sum(w.tier(tier) * blocks for tier, blocks in by_tier.items())
        ahead = max(0, cand.predicted - cand.matched)
        cand.uncached = max(0, prompt_tokens - (cand.matched + ahead) * cand.size)
        cand.parts["prefix"] = w.prefix * min(1.0, (reused + w.predicted * ahead) / whole)

    def _score(self, cands: list[_Rank]) -> list[str]:
        """Adds the load parts; returns notes on the scorers left out."""
        w = self.weights
        notes = self._backlog(cands) if w.backlog and cands else []
        for name, weight, field_name in (
            ("queue", w.queue, "waiting"),
            ("running", w.running, "running"),
            ("kv", w.kv, "kv_usage"),
        ):
            if weight == 0 or not cands:
                continue
            values: list[float | None] = [
                getattr(c.load, field_name) if c.load is not None else None for c in cands
            ]
            if any(v is None for v in values):
                unknown = sorted(
                    {c.row.name for c, v in zip(cands, values, strict=True) if v is None}
                )
                notes.append(f"{name} left out (no load known for {', '.join(unknown[:3])})")
                continue
            known = [float(v) for v in values if v is not None]
            for cand, v in zip(cands, known, strict=True):
                if name == "kv":
                    cand.parts[name] = weight * max(0.0, 1.0 - v)
                else:
                    low, high = min(known), max(known)
                    cand.parts[name] = weight * (1.0 if high == low else (high - v) / (high - low))
        return notes

    def _backlog(self, cands: list[_Rank]) -> list[str]:
        """The backlog part: the prefill ahead of the prompt on each candidate, in tokens
        (what waits there uncached, plus the prompt's own uncached tokens), 1 for the
        least and in proportion for the others (twice the tokens: half the part)."""
        waiting = [c.load.waiting_tokens if c.load is not None else None for c in cands]
        if any(v is None for v in waiting):
            unknown = sorted({c.row.name for c, v in zip(cands, waiting, strict=True) if v is None})
            return [f"backlog left out (no waiting tokens known for {', '.join(unknown[:3])})"]
        costs = [max(1.0, float(v or 0) + c.uncached) for c, v in zip(cands, waiting, strict=True)]
        least = min(costs)
        for cand, cost in zip(cands, costs, strict=True):
            cand.parts["backlog"] = self.weights.backlog * least / cost
        return []

    def _confirm(self, cands: list[_Rank], namespace: Namespace, data: bytes) -> None:
        for cand in cands:
            if cand.predicted and cand.matched >= cand.predicted:
                self.predictions.confirm(
                    namespace, cand.row.name, cand.rank, data, cand.size, cand.matched
                )

    def _rows(self, answer: LookupAnswer, cands: list[_Rank]) -> list[ScoredMatch]:
        by_name: dict[str, list[_Rank]] = {}
        for cand in cands:
            by_name.setdefault(cand.row.name, []).append(cand)
        now = time.monotonic()
        rows = []
        specs = self.fleet.specs if self.fleet is not None else {}
        for row in answer.instances:
            mine = by_name.get(row.name, [])
            spec = specs.get(row.name)
            top = max(mine, key=lambda c: (c.score, c.matched, -c.rank), default=None)
            rows.append(
                ScoredMatch(
                    **msgspec.structs.asdict(row),  # the lookup row as it is
                    score=round(top.score, 6) if top else None,
                    route_rank=top.rank if top else None,
                    predicted_blocks=max(0, top.predicted - top.matched) if top else 0,
                    candidates=[_candidate(c, now) for c in mine],
                    approximate=spec is not None and spec.events_none,
                )
            )
        rows.sort(key=lambda r: (r.score is None, -(r.score or 0.0), -r.matched_blocks, r.name))
        return rows


def _candidate(cand: _Rank, now: float) -> Candidate:
    load = cand.load
    return Candidate(
        cand.rank,
        cand.matched,
        max(0, cand.predicted - cand.matched),
        round(cand.score, 6),
        {k: round(v, 6) for k, v in cand.parts.items()},
        None
        if load is None
        else LoadOut(load.waiting, load.running, load.kv_usage, round(max(0.0, now - load.at), 3)),
    )


def _describe(cand: _Rank) -> str:
    where = cand.row.name + (f" rank {cand.rank}" if len(cand.row.ranks) > 1 else "")
    parts = [f"prefix {cand.parts.get('prefix', 0.0):.2f} ({cand.matched} blocks"]
    if cand.predicted > cand.matched:
        parts[0] += f" + {cand.predicted - cand.matched} predicted"
    parts[0] += ")"
    load = cand.load
    if "queue" in cand.parts and load is not None:
        parts.append(f"queue {cand.parts['queue']:.2f} ({load.waiting:g} waiting)")
    if "running" in cand.parts and load is not None:
        parts.append(f"running {cand.parts['running']:.2f} ({load.running:g} running)")
    if "kv" in cand.parts and load is not None and load.kv_usage is not None:
        parts.append(f"kv {cand.parts['kv']:.2f} ({load.kv_usage:.0%} used)")
    return f"{where}: {cand.score:.2f} = " + " + ".join(parts)


def _explain(
    chosen: _Rank | None,
    others: list[_Rank],
    notes: list[str],
    answer: LookupAnswer,
    model: str | None,
) -> str:
    if chosen is None:
        if not answer.instances:
            return f"no instance serves model {model!r}" if model else "no instance is followed"
        return "every instance is down"
    text = "best " + _describe(chosen)
    if others:
        text += "; next " + _describe(others[0])
    if notes:
        text += "; " + "; ".join(notes)
    return text
