"""What each engine says of itself on its Prometheus `/metrics`: load and cache figures.

A `MetricsScraper` reads the `/metrics` of every instance that has a metrics URL (`metrics=`
in its spec, or `http=` + `/metrics`) every `interval` seconds, on a thread of its own, and
keeps per DP rank (vLLM's `engine` label) what routing and operators need:

| figure | vLLM metric |
| --- | --- |
| requests waiting | `vllm:num_requests_waiting` |
| requests running | `vllm:num_requests_running` |
| KV-cache usage (0-1) | `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before 0.10) |
| prefix-cache queries, hits (tokens) | `vllm:prefix_cache_{queries,hits}_total` (`gpu_` before) |
| pool capacity (blocks), block size | `vllm:cache_config_info`'s `num_gpu_blocks`, `block_size` |
| awake or asleep | `vllm:engine_sleep_state{sleep_state="awake"}` (1 awake, 0 asleep) |

An engine put to sleep (level 1 or 2) has discarded its KV cache, but its queued
`AllBlocksCleared` goes out only when it runs a step again; `on_sleep(instance, rank,
awake)` hands every reading of the sleep state to whoever acts on it (the Fleet marks the
rank's blocks gone at once: `Fleet.sleep_state`).

The hit rate is the hits over the queries between two scrapes (and since the engine
started). It is a `LoadSource` for the routing score (`kvindex.runtime.routing`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvindex.runtime.routing import Load
from kvindex.security.engines import engine_hosts

__all__ = ["EngineFigures", "MetricsScraper", "parse_vllm_metrics"]

log = logging.getLogger(__name__)

_WAITING = ("vllm:num_requests_waiting",)
_RUNNING = ("vllm:num_requests_running",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
_CACHE_INFO = "vllm:cache_config_info"
_SLEEP_STATE = "vllm:engine_sleep_state"


@dataclass(slots=True)
class EngineFigures:
    """One DP rank of an engine at its last scrape."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    queries: float | None = None  # prefix-cache queries since the engine started (tokens)
    hits: float | None = None
    capacity_blocks: int | None = None  # the GPU pool (num_gpu_blocks)
    block_size: int | None = None
    awake: bool | None = None  # vllm:engine_sleep_state{sleep_state="awake"}; None: not said
    hit_rate: float | None = None  # over the last scrape interval
    scraped_at: float = 0.0  # time.monotonic()

    @property
    def lifetime_hit_rate(self) -> float | None:
        if self.queries and self.hits is not None:
            return self.hits / self.queries
        return None

    def load(self) -> Load:
        return Load(self.waiting, self.running, self.kv_usage, self.scraped_at, self.block_size)


def parse_vllm_metrics(text: str) -> dict[int, EngineFigures]:
    """The figures of each DP rank (vLLM's `engine` label; 0 without one) in a `/metrics`
    text. Raises ValueError for text that is not Prometheus's format."""
    ranks: dict[int, EngineFigures] = {}

    def rank_of(labels: dict[str, str]) -> EngineFigures | None:
        engine = labels.get("engine", "0")
        if not engine.isdigit():
            return None
        return ranks.setdefault(int(engine), EngineFigures())

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            figures = rank_of(sample.labels)
            if figures is None:
                continue
            if name in _WAITING:
                figures.waiting = sample.value
            elif name in _RUNNING:
                figures.running = sample.value
            elif name in _KV_USAGE:
                figures.kv_usage = sample.value
            elif name.removesuffix("_total") in _QUERIES and not name.endswith("_created"):
                figures.queries = sample.value
            elif name.removesuffix("_total") in _HITS and not name.endswith("_created"):
                figures.hits = sample.value
            elif name == _CACHE_INFO:
                figures.capacity_blocks = _int(sample.labels.get("num_gpu_blocks"))
                figures.block_size = _int(sample.labels.get("block_size"))
            elif name == _SLEEP_STATE and sample.labels.get("sleep_state") == "awake":
                figures.awake = sample.value >= 0.5
    return ranks


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


@dataclass(slots=True)
class _Target:
    url: str
    ranks: dict[int, EngineFigures] = field(default_factory=dict)
    error: str | None = None
    scrapes: int = 0
    failures: int = 0


class MetricsScraper:
    """Scrapes the engines' `/metrics` every `interval` seconds (see the module doc).

    `targets()` says which instances to scrape and where (called before every round, so
    instances added or removed at runtime are followed)."""

    def __init__(
        self,
        targets: Callable[[], Iterable[tuple[str, str]]],
        interval: float = 1.0,
        timeout: float = 2.0,
    ) -> None:
        self._targets = targets
        self.interval = interval
        self._timeout = timeout
        self._state: dict[str, _Target] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rounds = 0
        self._round_done = threading.Condition()
        # Each rank's sleep state as read (instance, rank, awake), on the scraper's thread.
        self.on_sleep: Callable[[str, int, bool], None] | None = None
        # Each rank's KV-cache usage as read (instance, rank, usage 0-1), likewise.
        self.on_usage: Callable[[str, int, float], None] | None = None
        # (instance, rank, num_gpu_blocks) at each scrape that says it: the pool's size
        self.on_pool: Callable[[str, int, int], None] | None = None

    # -- LoadSource --------------------------------------------------------------------

    def load(self, instance: str) -> dict[int, Load] | None:
        target = self._state.get(instance)
        if target is None or not target.ranks or target.error is not None:
            return None
        return {rank: figures.load() for rank, figures in target.ranks.items()}

    # -- what operators see ------------------------------------------------------------

    def figures(self) -> dict[str, dict[int, EngineFigures]]:
        """Each scraped instance's figures per DP rank, as of its last good scrape."""
        return {name: dict(t.ranks) for name, t in list(self._state.items()) if t.ranks}

    def errors(self) -> dict[str, str]:
        """Instances whose last scrape failed, and why."""
        return {name: t.error for name, t in list(self._state.items()) if t.error}

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per instance: (scrapes, failed scrapes) since start."""
        return {name: (t.scrapes, t.failures) for name, t in list(self._state.items())}

    # -- running -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvindex-metrics", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._timeout + 1)
            self._thread = None

    def wait_round(self, timeout: float = 10.0) -> bool:
        """Wait until a round of scrapes that started after this call has ended."""
        with self._round_done:
            target = self._rounds + 2
            return self._round_done.wait_for(lambda: self._rounds >= target, timeout)

    def _run(self) -> None:
        with httpx.Client(timeout=self._timeout) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                self.scrape_once(client)
                self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def scrape_once(self, client: httpx.Client) -> None:
        """One round: every target once."""
        # Each round asks the engine allow-list: a host dropped from it is scraped no more.
        wanted = {name: url for name, url in self._targets() if engine_hosts.allows_url(url)}
        for name in list(self._state):
            if name not in wanted:
                del self._state[name]
        for name, url in wanted.items():
            target = self._state.get(name)
            if target is None or target.url != url:
                target = self._state[name] = _Target(url)
            self._scrape(client, target)
            if target.error is None:
                self._hand_on(name, target)
        with self._round_done:
            self._rounds += 1
            self._round_done.notify_all()

    def _hand_on(self, name: str, target: _Target) -> None:
        """The sleep state and KV usage just read, to whoever acts on them."""
        for rank, figures in list(target.ranks.items()):
            if self.on_sleep is not None and figures.awake is not None:
                self.on_sleep(name, rank, figures.awake)
            if self.on_usage is not None and figures.kv_usage is not None:
                self.on_usage(name, rank, figures.kv_usage)
            if self.on_pool is not None and figures.capacity_blocks:
                self.on_pool(name, rank, figures.capacity_blocks)

    def _scrape(self, client: httpx.Client, target: _Target) -> None:
        target.scrapes += 1
        try:
            reply = client.get(target.url)
            if reply.status_code != 200:
                raise ValueError(f"HTTP {reply.status_code}")
            try:
                ranks = parse_vllm_metrics(reply.text)
            except ValueError as exc:  # its message may quote the page: the log's only
                log.info("the metrics at %s don't parse: %s", target.url, str(exc)[:200])
                raise ValueError("not Prometheus text") from None
        except (httpx.HTTPError, ValueError) as exc:
            target.failures += 1
            if target.error is None:
                log.warning("can't read the metrics at %s: %s", target.url, exc)
            target.error = f"{exc or type(exc).__name__}"[:200]
            return
        now = time.monotonic()
        for rank, figures in ranks.items():
            figures.scraped_at = now
            before = target.ranks.get(rank)
            figures.hit_rate = _windowed_rate(before, figures)
        target.ranks = ranks
        target.error = None


def _windowed_rate(before: EngineFigures | None, now: EngineFigures) -> float | None:
    """Hits over queries between two scrapes (None if nothing was queried meanwhile, or
    the counters went back: an engine restart)."""
    if before is None or None in (before.queries, before.hits, now.queries, now.hits):
        return before.hit_rate if before is not None else None
    assert before.queries is not None and before.hits is not None
    assert now.queries is not None and now.hits is not None
    queried = now.queries - before.queries
    if queried <= 0 or now.hits < before.hits:
        return before.hit_rate if queried == 0 else None
    return (now.hits - before.hits) / queried
