"""An engine put to sleep as vLLM 0.33 does it, and woken: the index follows its real cache.

vLLM publishes KV events only from a scheduler step. `sleep(level>=1)` discards the KV
cache and queues `AllBlocksCleared`, but a paused engine runs no step: the event goes out
when it wakes and works again. Until then only its `/metrics` says so
(`vllm:engine_sleep_state{sleep_state="awake"} 0`). `SleepyEngine` is such an engine: a
real publisher, its true pool (`RefRank`), a real HTTP `/metrics`; the fleet reads it
through the real scraper and must equal the engine's real cache before, during and after
the sleep, the rank `asleep` meanwhile, lookups matching nothing on it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import pytest
from httpfixture import FakeEngine, serve_engine, vllm_metrics
from netutil import wait_until
from service_workload import Conversation, RefRank

from kvindex.runtime import Fleet
from kvindex.runtime.engine_metrics import MetricsScraper, parse_vllm_metrics
from kvindex.subscriber import InstanceSpec, Status
from kvindex.wire import AllBlocksCleared
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)


def sleep_state(awake: bool, engine: int = 0) -> str:
    """vLLM 0.33's sleep gauge: one sample per state, the current one 1."""
    labels = f'engine="{engine}",model_name="m"'
    level = "0" if awake else "1"
    return (
        "# HELP vllm:engine_sleep_state Engine sleep state\n"
        "# TYPE vllm:engine_sleep_state gauge\n"
        f'vllm:engine_sleep_state{{{labels},sleep_state="awake"}} {1 if awake else 0}\n'
        f'vllm:engine_sleep_state{{{labels},sleep_state="weights_offloaded"}} {level}\n'
        f'vllm:engine_sleep_state{{{labels},sleep_state="discard_all"}} 0\n'
    )


class SleepyEngine:
    """A vLLM-like engine that sleeps and wakes as vLLM 0.33 does."""

    def __init__(self, seed: int = 3) -> None:
        self.pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.ref = RefRank(self.pub)
        self.rng = random.Random(seed)
        self.convs = [Conversation(self.rng, i) for i in range(3)]
        self.http = FakeEngine()
        self.queued: list[AllBlocksCleared] = []  # events of steps not run yet
        self.served: list[list[int]] = []  # the prompts it cached, in order
        self.set_awake(True)

    def set_awake(self, awake: bool) -> None:
        self.http.metrics = vllm_metrics(0, 0, 0.0) + sleep_state(awake)

    def work(self, turns: int = 3) -> None:
        if self.queued:  # the first step after waking sends what the sleep queued
            self.pub.publish(list(self.queued))
            self.queued.clear()
        for _ in range(turns):
            for conv in self.convs:
                prompt = conv.next_prompt()
                self.ref.serve(prompt)
                self.served.append(prompt)
                self.ref.evict(self.rng, self.rng.randrange(0, 3))

    def sleep(self) -> None:
        """sleep(level=1): the cache is discarded now, the event only queued."""
        self.ref.gpu.clear()
        self.ref.cpu.clear()
        self.queued.append(AllBlocksCleared())
        self.set_awake(False)

    def wake(self) -> None:
        self.set_awake(True)


@pytest.fixture
def engine() -> Iterator[SleepyEngine]:
    sleepy = SleepyEngine()
    try:
        yield sleepy
    finally:
        sleepy.pub.close()


def test_the_sleep_gauge_is_read_per_rank() -> None:
    text = vllm_metrics(1, 2, 0.5) + sleep_state(False) + sleep_state(True, engine=1)
    ranks = parse_vllm_metrics(text)
    assert (ranks[0].awake, ranks[1].awake) == (False, True)
    assert parse_vllm_metrics(vllm_metrics(1, 2, 0.5))[0].awake is None  # before 0.11


def test_an_engine_asleep_holds_nothing_until_it_works_again(engine: SleepyEngine) -> None:
    with serve_engine(engine.http) as url:
        spec = InstanceSpec(
            "v", engine.pub.endpoint, engine.pub.replay_endpoint, metrics=f"{url}/metrics"
        )
        fleet = Fleet([spec], ingest_workers=1)
        scraper = MetricsScraper(lambda: [("v", f"{url}/metrics")])
        scraper.on_sleep = fleet.sleep_state
        asyncio.run(fleet.start())
        try:
            time.sleep(0.3)
            engine.work()
            truth = engine.ref.held
            source = spec.sources()[0].source
            # Every batch applied, not only the blocks right: a batch that leaves the set as
            # it was may still be on its way (CI read seq 14 here, then 17 after the sleep).
            last = engine.pub.next_seq - 1
            assert wait_until(lambda: fleet.index.source_state(source)[0] == last)
            assert fleet.block_hashes("v") == truth()
            seq_before = fleet.index.source_state(source)[0]
            (row,) = fleet.lookup(engine.served[-1]).instances
            assert row.matched_blocks > 0  # what it just cached, before it sleeps
            with httpx.Client() as client:
                scraper.scrape_once(client)
                assert fleet.status("v") == Status.LIVE and fleet.sleep_resets == 0

                engine.sleep()  # nothing is published: only /metrics says it
                scraper.scrape_once(client)
                assert fleet.block_hashes("v") == truth() == set()
                view = fleet.instance_view("v")
                assert view.status == Status.ASLEEP and view.blocks == 0
                assert fleet.sleep_resets == 1
                # the seq applied is kept: the queued clear then continues the stream
                assert fleet.index.source_state(spec.sources()[0].source)[0] == seq_before
                scraper.scrape_once(client)  # asleep still: counted once
                assert fleet.sleep_resets == 1
                (row,) = fleet.lookup(engine.served[-1]).instances
                assert (row.name, row.matched_blocks, row.status) == ("v", 0, Status.ASLEEP)

                engine.wake()
                engine.work()  # the queued AllBlocksCleared, then new blocks
                assert wait_until(lambda: fleet.block_hashes("v") == truth() != set())
                assert fleet.instance_view("v").status == Status.LIVE
                scraper.scrape_once(client)
                assert fleet.instance_view("v").status == Status.LIVE
                assert fleet.block_hashes("v") == truth()
        finally:
            asyncio.run(fleet.stop())


def test_an_idle_engine_keeps_its_blocks_and_is_said_once(engine: SleepyEngine) -> None:
    """KV usage 0 while kvindex holds GPU blocks: an idle engine (vLLM counts only the
    blocks running requests hold). Past the grace it is said and counted, once per idle
    spell; the blocks stay, lookups still find them."""
    with serve_engine(engine.http) as url:
        spec = InstanceSpec("v", engine.pub.endpoint, engine.pub.replay_endpoint)
        fleet = Fleet([spec], ingest_workers=1)
        fleet.idle_grace = 0.3
        scraper = MetricsScraper(lambda: [("v", f"{url}/metrics")])
        scraper.on_sleep, scraper.on_usage = fleet.sleep_state, fleet.usage_state
        asyncio.run(fleet.start())
        try:
            time.sleep(0.3)
            engine.work()
            assert wait_until(lambda: fleet.block_hashes("v") == engine.ref.held())
            with httpx.Client() as client:
                scraper.scrape_once(client)  # usage 0 (vllm_metrics(0, 0, 0.0)): the spell starts
                assert fleet.idle_with_blocks == 0
                time.sleep(0.4)
                scraper.scrape_once(client)
                scraper.scrape_once(client)
                assert fleet.idle_with_blocks == 1  # said once
                assert fleet.block_hashes("v") == engine.ref.held() != set()  # kept
                (row,) = fleet.lookup(engine.served[-1]).instances
                assert row.matched_blocks > 0 and row.status == Status.LIVE
                engine.http.metrics = vllm_metrics(0, 1, 0.4) + sleep_state(True)
                scraper.scrape_once(client)  # busy again: the spell ends
                engine.http.metrics = vllm_metrics(0, 0, 0.0) + sleep_state(True)
                scraper.scrape_once(client)
                time.sleep(0.4)
                scraper.scrape_once(client)
                assert fleet.idle_with_blocks == 2
        finally:
            asyncio.run(fleet.stop())
