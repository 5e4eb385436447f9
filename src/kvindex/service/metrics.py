"""Prometheus metrics of a running service, for a vLLM operator's Grafana board.

Fleet state is read at scrape time by a custom collector (`FleetCollector`): ingest never
touches a metric object, so the hot path pays nothing for being observable. Only lookups,
which are served one request at a time anyway, update a histogram and two counters.
Each app gets its own registry, so two services in one process (tests) never collide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvindex.runtime import STATUS_ORDER, Fleet, InstanceView

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

# (metric name without _total, help, RankView counter summed over ranks)
_SOURCE_COUNTERS = (
    ("kvindex_batches_received", "Live messages received from the publisher.", "received"),
    ("kvindex_batches_delivered", "Batches delivered in order (live and replayed).", "delivered"),
    ("kvindex_batches_replayed", "Batches recovered from the replay endpoint.", "replayed_batches"),
    ("kvindex_batches_lost", "Batches that could never be delivered.", "lost_batches"),
    ("kvindex_gaps", "Gaps seen in the live stream.", "gaps"),
    ("kvindex_decode_errors", "Payloads or events that could not be decoded.", "decode_errors"),
    ("kvindex_publisher_restarts", "Engine restarts detected.", "publisher_restarts"),
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
        self._requests = 0
        self._hits = 0

    def observe(self, kind: str, seconds: float, hit: bool) -> None:
        self.latency.labels(kind).observe(seconds)
        self.requests.labels(kind).inc()
        self._requests += 1
        if hit:
            self.hits.labels(kind).inc()
            self._hits += 1

    @property
    def totals(self) -> tuple[int, int]:
        """(requests, hits) over every kind, since start."""
        return self._requests, self._hits

    @property
    def hit_ratio(self) -> float | None:
        return self._hits / self._requests if self._requests else None


class FleetCollector(Collector):
    """Reads the fleet's counters when Prometheus scrapes (nothing is kept in between)."""

    def __init__(self, fleet: Fleet, lookups: LookupMetrics) -> None:
        self.fleet = fleet
        self.lookups = lookups

    def collect(self) -> Iterator[Metric]:
        views = self.fleet.instance_views()
        yield from _instance_metrics(views)
        yield from _source_metrics(views)
        yield from self._fleet_metrics(views)

    def _fleet_metrics(self, views: list[InstanceView]) -> Iterator[Metric]:
        fleet = self.fleet.summary(views)
        yield _gauge("kvindex_instances", "Instances followed.", fleet.instances)
        yield _gauge("kvindex_index_entries", "(rank, pool, hash) entries.", fleet.entries)
        yield _gauge("kvindex_ingest_backlog", "Items read but not applied yet.", fleet.backlog)
        ingest = self.fleet.ingest
        items = CounterMetricFamily("kvindex_ingest_items", "Items applied to the index.")
        items.add_metric([], ingest.items)
        yield items
        errors = CounterMetricFamily("kvindex_ingest_errors", "Items the index failed to apply.")
        errors.add_metric([], ingest.errors)
        yield errors
        ratio = self.lookups.hit_ratio
        yield _gauge(
            "kvindex_lookup_hit_ratio",
            "Share of lookups since start where some instance held at least one block.",
            float("nan") if ratio is None else ratio,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _instance_metrics(views: list[InstanceView]) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        "kvindex_instance_blocks",
        "Distinct block hashes held, by medium.",
        labels=["instance", "medium"],
    )
    events = CounterMetricFamily(
        "kvindex_instance_events",
        "Blocks stored and removed, and AllBlocksCleared events, applied.",
        labels=["instance", "type"],
    )
    status = GaugeMetricFamily(
        "kvindex_instance_status",
        "1 for the instance's current status (the worst of its DP ranks), 0 for the others.",
        labels=["instance", "status"],
    )
    lag = GaugeMetricFamily(
        "kvindex_ingest_lag_seconds",
        "When the instance's last batch was applied: wall time minus the batch's timestamp.",
        labels=["instance"],
    )
    age = GaugeMetricFamily(
        "kvindex_last_batch_age_seconds",
        "Now minus the timestamp of the instance's last batch (grows while it is idle).",
        labels=["instance"],
    )
    for view in views:
        for medium, count in view.blocks_by_medium.items():
            blocks.add_metric([view.name, medium], count)
        for kind, value in (("stored", view.stored), ("removed", view.removed)):
            events.add_metric([view.name, kind], value)
        events.add_metric([view.name, "clears"], view.clears)
        for state in STATUS_ORDER:
            status.add_metric([view.name, state.value], 1.0 if view.status == state else 0.0)
        if view.ingest_lag_seconds is not None:
            lag.add_metric([view.name], view.ingest_lag_seconds)
        batch_age = view.last_batch_age_seconds
        if batch_age is not None:
            age.add_metric([view.name], batch_age)
    yield from (blocks, events, status, lag, age)


def _source_metrics(views: list[InstanceView]) -> Iterator[Metric]:
    for name, doc, counter in _SOURCE_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["instance"])
        for view in views:
            family.add_metric([view.name], view.total(counter))
        yield family
    seq = GaugeMetricFamily(
        "kvindex_last_seq", "Last seq delivered, per DP rank.", labels=["instance", "rank"]
    )
    for view in views:
        for rank in view.ranks:
            if rank.last_seq is not None:
                seq.add_metric([view.name, str(rank.rank)], rank.last_seq)
    yield seq


class ServiceMetrics:
    """The registry of one app: fleet state read at scrape time, plus lookup metrics."""

    def __init__(self, fleet: Fleet) -> None:
        # `*_created` series only double the output; this switch is process-wide.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.lookups = LookupMetrics(self.registry)
        self.registry.register(FleetCollector(fleet, self.lookups))
        self.started = time.time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
