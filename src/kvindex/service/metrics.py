"""Prometheus metrics of a running service, for a vLLM operator's Grafana board.

Fleet state is read at scrape time by a custom collector (`FleetCollector`): ingest never
touches a metric object, so the hot path pays nothing for being observable. Only lookups,
which are served one request at a time anyway, update a histogram and two counters.
Each app gets its own registry, so two services in one process (tests) never collide; it
holds the process and platform collectors too (memory, CPU, file descriptors, GC).

Engines are labelled `engine` (never `instance`, Prometheus's own label for the target);
counters count one thing each (blocks, or events, or batches); ratios are left to PromQL.
Every metric is listed, with its type and labels, in docs/operations.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvindex.runtime import STATUS_ORDER, Fleet, InstanceView, StoreHealth
from kvindex.runtime.engine_metrics import MetricsScraper
from kvindex.runtime.finders import Reconciler
from kvindex.runtime.heap import heap_bytes
from kvindex.runtime.prefix_tokens import CacheStats
from kvindex.wire.tiers import tier_of

__all__ = ["FleetCollector", "LookupMetrics", "ServiceMetrics"]

_LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)

# The label that names an engine (a followed instance): `instance` is Prometheus's own (the
# scraped target) and would become `exported_instance` unless the scrape honours labels.
ENGINE = "engine"

# (metric name without _total, help, RankView counter summed over ranks)
_SOURCE_COUNTERS = (
    ("kvindex_batches_received", "Live messages received from the publisher.", "received"),
    ("kvindex_batches_delivered", "Batches delivered in order (live and replayed).", "delivered"),
    ("kvindex_batches_replayed", "Batches recovered from the replay endpoint.", "replayed_batches"),
    ("kvindex_batches_lost", "Batches that could never be delivered.", "lost_batches"),
    ("kvindex_gaps", "Gaps seen in the live stream.", "gaps"),
    ("kvindex_decode_errors", "Payloads or events that could not be decoded.", "decode_errors"),
    ("kvindex_publisher_restarts", "Engine restarts detected.", "publisher_restarts"),
    (
        "kvindex_malformed_messages",
        "Messages that are not vLLM's frame layout (skipped).",
        "malformed_messages",
    ),
    (
        "kvindex_handshake_failures",
        "ZMTP/CURVE handshakes that failed on the engine's links.",
        "handshake_failures",
    ),
    (
        "kvindex_replay_failures",
        "Replay requests that ended without all they asked for.",
        "replay_failures",
    ),
    (
        "kvindex_replay_refusals",
        "Replay answers refused (wrong seq or batch, no reply, past deadline or budget).",
        "replay_refusals",
    ),
)


class LookupMetrics:
    """What lookups cost and how often they find something: updated per request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram(
            "kvindex_lookup_latency_seconds",
            "Time to answer a lookup inside the service (excluding HTTP parsing).",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "kvindex_lookup_requests", "Lookups answered.", ["kind"], registry=registry
        )
        self.hits = Counter(
            "kvindex_lookup_hits",
            "Lookups where at least one instance held at least one block of the prompt.",
            ["kind"],
            registry=registry,
        )
        self.compiled = Counter(
            "kvindex_lookup_compiled_requests",
            "Lookups by tokens whose body was read and answer written in C; the others went "
            "through the Python route (a body with floats, escaped strings or token ids past "
            "32 bits, a refused one...).",
            registry=registry,
        )
        self._requests = 0
        self._hits = 0
        # A labelled child is looked up under a lock each time: these are made once.
        self._children: dict[str, tuple[Any, ...]] = {}

    def observe(self, kind: str, seconds: float, hit: bool, compiled: bool = False) -> None:
        children = self._children.get(kind)
        if children is None:
            children = tuple(m.labels(kind) for m in (self.latency, self.requests, self.hits))
            self._children[kind] = children
        latency, requests, hits = children
        latency.observe(seconds)
        requests.inc()
        self._requests += 1
        if hit:
            hits.inc()
            self._hits += 1
        if compiled:
            self.compiled.inc()

    @property
    def totals(self) -> tuple[int, int]:
        """(requests, hits) over every kind, since start."""
        return self._requests, self._hits

    @property
    def hit_ratio(self) -> float | None:
        return self._hits / self._requests if self._requests else None


StoreHealthOf = Callable[[], StoreHealth]


class FleetCollector(Collector):
    """Reads the fleet's counters when Prometheus scrapes (nothing is kept in between)."""

    def __init__(
        self,
        fleet: Fleet,
        store: StoreHealthOf | None = None,
        engines: MetricsScraper | None = None,
        finders: Reconciler | None = None,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.engines = engines
        self.finders = finders

    def collect(self) -> Iterator[Metric]:
        views = self.fleet.instance_views()
        yield from _engine_metrics(views)
        yield from _placement_metrics(views)
        yield from _source_metrics(views)
        yield from _load_metrics(views)
        yield from self._fleet_metrics(views)
        if self.store is not None:
            yield from _store_metrics(self.store())
        if self.engines is not None:
            yield from _scraped_metrics(self.engines)

    def _fleet_metrics(self, views: list[InstanceView]) -> Iterator[Metric]:
        fleet = self.fleet.summary(views)
        yield _gauge("kvindex_engines", "Engines (instances) followed.", fleet.instances)
        yield _gauge("kvindex_index_entries", "(rank, pool, hash) entries.", fleet.entries)
        yield _gauge("kvindex_ingest_backlog", "Items read but not applied yet.", fleet.backlog)
        ingest = self.fleet.ingest
        yield _counter("kvindex_ingest_items", "Items applied to the index.", ingest.items)
        yield _counter("kvindex_ingest_errors", "Items the index failed to apply.", ingest.errors)
        yield _counter(
            "kvindex_ingest_batches_in_c",
            "Ordinary batches received and applied in C, without Python.",
            ingest.batches_in_c,
        )
        yield _counter(
            "kvindex_ingest_gil_seconds",
            "CPU seconds the ingest threads spent in Python (holding the GIL).",
            ingest.gil_seconds,
        )
        yield _counter(
            "kvindex_engine_sleep_resets",
            "Times an engine's rank said it sleeps and its blocks were marked gone.",
            self.fleet.sleep_resets,
        )
        yield _counter(
            "kvindex_engine_idle_with_blocks",
            "Times an engine's KV usage read 0 past the grace while it held GPU blocks (kept).",
            self.fleet.idle_with_blocks,
        )
        yield from self._discovery_metrics()
        info = InfoMetricFamily("kvindex_build", "The kvindex version serving.")
        info.add_metric([], {"version": _version()})
        yield info

    def _discovery_metrics(self) -> Iterator[Metric]:
        """Engines found by --discover, by how, and the changes the finders made."""
        found = GaugeMetricFamily(
            "kvindex_engines_found",
            "Engines followed because --discover found them.",
            labels=["how"],
        )
        hows = [by.how for by in list(self.fleet.found.values())]
        for how in ("k8s", "dns"):
            found.add_metric([how], hows.count(how))
        yield found
        changes = CounterMetricFamily(
            "kvindex_discovery_changes", "Engines --discover added and removed.", labels=["change"]
        )
        finders = self.finders
        changes.add_metric(["added"], finders.added if finders is not None else 0)
        changes.add_metric(["removed"], finders.removed if finders is not None else 0)
        yield changes


def _version() -> str:
    from kvindex import __version__

    return __version__


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


# How the index placed each engine's blocks (issue 20): counters per engine, from its view.
_PLACEMENT_COUNTERS = (
    (
        "kvindex_blocks_unplaced",
        "Blocks held without a place in the prefix tree (no tokens, an unknown parent, a "
        "position no event says): counted in the engine's pools, found by hash only.",
        "unplaced",
    ),
    (
        "kvindex_blocks_unrecognised_keys",
        "Blocks whose extra keys had a shape this kvindex doesn't know: keyed on their own, "
        "never matched by a plain lookup.",
        "unrecognised_keys",
    ),
    (
        "kvindex_namespace_kept",
        "Lower-tier stores without extra keys (vLLM's offload events) that kept the "
        "namespace (LoRA, salt) of the engine's keyed copy of the same hash.",
        "namespace_kept",
    ),
    (
        "kvindex_namespace_moved",
        "Entries moved into their namespace when the keyed copy came after an unkeyed one.",
        "namespace_moved",
    ),
)


def _placement_metrics(views: list[InstanceView]) -> Iterator[Metric]:
    for name, doc, field in _PLACEMENT_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=[ENGINE])
        for view in views:
            family.add_metric([view.name], getattr(view, field))
        yield family


def _engine_metrics(views: list[InstanceView]) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        "kvindex_engine_blocks",
        "Distinct block hashes the engine holds now, by medium (as the engine names it) "
        "and tier (gpu, cpu, disk, external: one vocabulary for every engine).",
        labels=[ENGINE, "medium", "tier"],
    )
    stored = CounterMetricFamily(
        "kvindex_blocks_stored", "Blocks stored (BlockStored, block by block).", labels=[ENGINE]
    )
    removed = CounterMetricFamily(
        "kvindex_blocks_removed", "Blocks removed (BlockRemoved, block by block).", labels=[ENGINE]
    )
    clears = CounterMetricFamily(
        "kvindex_cache_clears", "AllBlocksCleared events (prefix cache resets).", labels=[ENGINE]
    )
    status = GaugeMetricFamily(
        "kvindex_engine_status",
        "1 for the engine's current status (the worst of its DP ranks), 0 for the others.",
        labels=[ENGINE, "status"],
    )
    lag = GaugeMetricFamily(
        "kvindex_ingest_lag_seconds",
        "When the engine's last batch was applied: wall time minus the batch's timestamp.",
        labels=[ENGINE],
    )
    age = GaugeMetricFamily(
        "kvindex_last_batch_age_seconds",
        "Now minus the timestamp of the engine's last batch (grows while it is idle).",
        labels=[ENGINE],
    )
    approximate = GaugeMetricFamily(
        "kvindex_engine_approximate",
        "1 for an engine without KV events (events=none): its blocks are what /v1/route "
        "sent there (kvindex_approximate_blocks), not what it published.",
        labels=[ENGINE],
    )
    approx_blocks = GaugeMetricFamily(
        "kvindex_approximate_blocks",
        "An engine without KV events: the blocks kvindex assumes it holds (routed there, "
        "within its pool and TTL), and that pool's bound.",
        labels=[ENGINE, "kind"],
    )
    for view in views:
        name = view.name
        approximate.add_metric([name], 1.0 if view.approximate else 0.0)
        cache = view.approximate_cache
        if cache is not None:
            approx_blocks.add_metric([name, "held"], cache.blocks)
            approx_blocks.add_metric([name, "capacity"], cache.capacity)
            approx_blocks.add_metric([name, "evicted"], cache.evicted)
            approx_blocks.add_metric([name, "expired"], cache.expired)
        for medium, count in view.blocks_by_medium.items():
            blocks.add_metric([name, medium, tier_of(medium)], count)
        stored.add_metric([name], view.stored)
        removed.add_metric([name], view.removed)
        clears.add_metric([name], view.clears)
        for state in STATUS_ORDER:
            status.add_metric([name, state.value], 1.0 if view.status == state else 0.0)
        if view.ingest_lag_seconds is not None:
            lag.add_metric([name], view.ingest_lag_seconds)
        batch_age = view.last_batch_age_seconds
        if batch_age is not None:
            age.add_metric([name], batch_age)
    yield from (blocks, stored, removed, clears, status, lag, age, approximate, approx_blocks)


def _source_metrics(views: list[InstanceView]) -> Iterator[Metric]:
    for name, doc, counter in _SOURCE_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=[ENGINE])
        for view in views:
            family.add_metric([view.name], view.total(counter))
        yield family
    seq = GaugeMetricFamily(
        "kvindex_last_seq", "Last seq delivered, per DP rank.", labels=[ENGINE, "rank"]
    )
    for view in views:
        for rank in view.ranks:
            if rank.last_seq is not None:
                seq.add_metric([view.name, str(rank.rank)], rank.last_seq)
    yield seq


def _scraped_metrics(scraper: MetricsScraper) -> Iterator[Metric]:
    """What each engine's own `/metrics` said at the last scrape (instances with a metrics
    URL: `metrics=` or `http=` in the spec), per DP rank: cache size, use, hits, load."""
    rank = [ENGINE, "rank"]
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "capacity_blocks": GaugeMetricFamily(
            "kvindex_engine_pool_blocks",
            "The engine's GPU KV-cache pool, in blocks (vLLM's num_gpu_blocks).",
            labels=rank,
        ),
        "kv_usage": GaugeMetricFamily(
            "kvindex_engine_kv_cache_usage",
            "The engine's KV-cache usage, 0-1 (vLLM's kv_cache_usage_perc).",
            labels=rank,
        ),
        "queries": CounterMetricFamily(
            "kvindex_engine_prefix_cache_queries",
            "Prefix-cache queries, in tokens, as the engine counts them (since it started).",
            labels=rank,
        ),
        "hits": CounterMetricFamily(
            "kvindex_engine_prefix_cache_hits",
            "Prefix-cache hits, in tokens, as the engine counts them (since it started).",
            labels=rank,
        ),
        "waiting": GaugeMetricFamily(
            "kvindex_engine_requests_waiting", "Requests waiting in the engine.", labels=rank
        ),
        "running": GaugeMetricFamily(
            "kvindex_engine_requests_running", "Requests running in the engine.", labels=rank
        ),
    }
    for name, ranks in sorted(scraper.figures().items()):
        for number, figures in sorted(ranks.items()):
            for field, family in families.items():
                value = getattr(figures, field)
                if value is not None:
                    family.add_metric([name, str(number)], value)
    yield from families.values()
    up = GaugeMetricFamily(
        "kvindex_engine_metrics_up",
        "1 if the engine's /metrics answered at the last scrape, 0 if not.",
        labels=[ENGINE],
    )
    failures = CounterMetricFamily(
        "kvindex_engine_metrics_failures",
        "Scrapes of the engine's /metrics that failed.",
        labels=[ENGINE],
    )
    errors = scraper.errors()
    for name, (_, failed) in sorted(scraper.counts().items()):
        up.add_metric([name], 0.0 if name in errors else 1.0)
        failures.add_metric([name], failed)
    yield from (up, failures)


# Per DP rank, from the engine's load stream (SGLang's LoadStat): (name, doc, RankLoad field).
_LOAD_GAUGES = (
    ("kvindex_engine_running_requests", "Requests running, per DP rank.", "running_requests"),
    ("kvindex_engine_waiting_requests", "Requests waiting, per DP rank.", "waiting_requests"),
    ("kvindex_engine_kv_tokens_used", "KV tokens in use, per DP rank.", "kv_tokens_used"),
    # The capacity beside the use (no ratio gauge: PromQL divides the two).
    ("kvindex_engine_kv_tokens_capacity", "KV capacity in tokens, per DP rank.", "kv_tokens_total"),
    ("kvindex_engine_load_age_seconds", "Age of the rank's newest load reading.", "age_seconds"),
)


def _load_metrics(views: list[InstanceView]) -> Iterator[Metric]:
    """Each rank's load, for the ranks whose engine sends a load stream (SGLang)."""
    for name, doc, attr in _LOAD_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=[ENGINE, "rank"])
        for view in views:
            for rank in view.ranks:
                value = None if rank.load is None else getattr(rank.load, attr)
                if value is not None:
                    family.add_metric([view.name, str(rank.rank)], value)
        yield family


def _store_metrics(health: StoreHealth) -> Iterator[Metric]:
    """How the state store is doing (see StoreHealth)."""
    yield _gauge(
        "kvindex_store_up", "1 while the state store persists what is applied.", float(health.up)
    )
    yield _gauge(
        "kvindex_store_lag_seconds",
        "Age of the oldest applied item the store has not made durable yet (0: none).",
        health.lag_seconds,
    )
    yield _gauge(
        "kvindex_store_pending_groups",
        "Groups of applied items handed to the store's worker, not durable yet.",
        health.pending_groups,
    )
    yield _counter(
        "kvindex_store_restarts",
        "Times the store's worker died and was started again.",
        health.restarts,
    )
    yield _counter(
        "kvindex_store_dropped_batches",
        "Batches not persisted because the store was too far behind (counted lost in it).",
        health.dropped_batches,
    )
    yield _counter(
        "kvindex_store_refused_batches",
        "Batches the store's worker refused as written already: a few after it restarted "
        "(handed again); any other is a batch the store lost.",
        health.refused_batches,
    )
    info = InfoMetricFamily("kvindex_store", "The state store, and its last error (empty: none).")
    info.add_metric([], {"url": health.url, "last_error": health.last_error or ""})
    yield info


class TokenizerCaches(Collector):
    """Each local tokenizer's prefix cache (`kvindex.runtime.prefix_tokens`), by model."""

    def __init__(self, stats: Callable[[], dict[str, CacheStats]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for name, doc, attr, kind in (
            ("kvindex_tokenizer_cache_bytes", "Memory the prefix cache holds.", "bytes", "g"),
            ("kvindex_tokenizer_cache_max_bytes", "Its bound (--tokenizer-cache-mb).",
             "max_bytes", "g"),
            ("kvindex_tokenizer_cache_entries", "Texts it holds the tokens of.", "entries", "g"),
            ("kvindex_tokenizer_cache_hits", "Texts whose prefix it held.", "hits", "c"),
            ("kvindex_tokenizer_cache_misses", "Texts tokenized whole.", "misses", "c"),
            ("kvindex_tokenizer_cache_reused_tokens", "Tokens taken from it, not tokenized.",
             "reused_tokens", "c"),
            ("kvindex_tokenizer_cache_tokenized_tokens", "Tokens the tokenizer made.",
             "tokenized_tokens", "c"),
        ):  # fmt: skip
            family = (GaugeMetricFamily if kind == "g" else CounterMetricFamily)(
                name, doc, labels=["model"]
            )
            for model, stat in stats.items():
                family.add_metric([model], float(getattr(stat, attr)))
            yield family


class HeapCollector(Collector):
    """The heap by its allocators' own statistics (kvindex.runtime.heap), read at scrape."""

    def collect(self) -> Iterator[Metric]:
        heap = heap_bytes()
        family = GaugeMetricFamily(
            "kvindex_heap_bytes",
            "Bytes live in each allocator: core (the compiled core's C), malloc (glibc's, "
            "the core's included), pymalloc (Python's small objects); the heap in use is "
            "malloc + pymalloc.",
            labels=["allocator"],
        )
        for name, value in (
            ("core", heap.core),
            ("malloc", heap.malloc),
            ("pymalloc", heap.pymalloc),
        ):
            if value is not None:
                family.add_metric([name], value)
        yield family


class ServiceMetrics:
    """The registry of one app: fleet state read at scrape time, lookup metrics, and the
    process's own (memory, CPU, file descriptors, GC, Python version)."""

    def __init__(
        self,
        fleet: Fleet,
        store: StoreHealthOf | None = None,
        engines: MetricsScraper | None = None,
        tokenizer_caches: Callable[[], dict[str, CacheStats]] | None = None,
        finders: Reconciler | None = None,
    ) -> None:
        # `*_created` series only double the output; this switch is process-wide.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.lookups = LookupMetrics(self.registry)
        self.fleet_collector = FleetCollector(fleet, store, engines, finders)
        self.registry.register(self.fleet_collector)
        if tokenizer_caches is not None:
            self.registry.register(TokenizerCaches(tokenizer_caches))
        self.registry.register(HeapCollector())
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.started = time.time()
        # Called before each scrape (the lookup thread's answers: kvindex.service.lookupd).
        self.before_render: list[Callable[[], None]] = []

    def render(self) -> bytes:
        for step in self.before_render:  # what is counted elsewhere, read in now
            step()
        return generate_latest(self.registry)
