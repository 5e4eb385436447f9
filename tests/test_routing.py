"""Routing over a live fleet (real ZMQ publishers): models, the score's prefix and load
parts (load scraped from real HTTP `/metrics`), predictions and their expiry; the spec's
router options."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from httpfixture import FakeEngine, serve_engine, vllm_metrics
from test_runtime import until

from kvindex.runtime import Fleet
from kvindex.runtime.engine_metrics import MetricsScraper, parse_vllm_metrics
from kvindex.runtime.routing import NoCandidate, Predictions, Router, Weights
from kvindex.subscriber import InstanceSpec, SpecError, Status
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

BS = 4
PROMPT = list(range(100, 116))  # 4 blocks of 4


def chain(tokens: list[int], medium: str | None = None, start: int = 0) -> BlockStored:
    """BlockStored of `tokens` in whole blocks (hashes from the token values)."""
    blocks = len(tokens) // BS
    hashes = [hash(tuple(tokens[: (i + 1) * BS])) for i in range(blocks)]
    return BlockStored(hashes, None, tokens[: blocks * BS], BS, medium=medium)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def fleet_of(*specs: tuple[str, str | None]) -> Iterator[tuple[Fleet, dict[str, Publisher]]]:
    """A fleet following one live publisher per (name, model)."""
    with ExitStack() as stack:
        pubs = {
            name: stack.enter_context(Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
            for name, _ in specs
        }
        fleet = Fleet(
            [
                InstanceSpec(name, pubs[name].endpoint, pubs[name].replay_endpoint, model=model)
                for name, model in specs
            ]
        )
        yield fleet, pubs


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


def test_lookups_naming_a_model_see_only_its_instances() -> None:
    async def main() -> None:
        with fleet_of(("a", "llama"), ("b", "qwen"), ("c", None)) as (fleet, pubs):
            await fleet.start()
            try:
                assert await until(lambda: all(fleet.status(n) == Status.LIVE for n in pubs))
                for pub in pubs.values():
                    pub.publish([chain(PROMPT)])  # equal token ids on every model
                assert await until(lambda: all(fleet.index.block_count(n) == 4 for n in pubs))
                everyone = fleet.lookup(PROMPT)
                assert {r.name for r in everyone.instances} == {"a", "b", "c"}
                llama = fleet.lookup(PROMPT, model="llama")
                assert [(r.name, r.matched_blocks) for r in llama.instances] == [("a", 4)]
                assert llama.best == "a"
                assert fleet.lookup(PROMPT, model="mistral").instances == []
                assert fleet.models() == {"llama": ["a"], "qwen": ["b"]}
                assert fleet.serves("qwen") and not fleet.serves("mistral")
            finally:
                await fleet.stop()

    run(main)


def test_tier_weights_rank_a_gpu_hit_above_a_cpu_hit_and_why_says_so() -> None:
    async def main() -> None:
        with fleet_of(("gpu", None), ("cpu", None)) as (fleet, pubs):
            await fleet.start()
            try:
                assert await until(lambda: all(fleet.status(n) == Status.LIVE for n in pubs))
                pubs["gpu"].publish([chain(PROMPT[:8])])  # 2 blocks on GPU
                pubs["cpu"].publish([chain(PROMPT, medium="CPU")])  # 4 blocks on CPU
                assert await until(lambda: fleet.index.block_count("cpu") == 4)
                assert await until(lambda: fleet.index.block_count("gpu") == 2)
                weights = Weights(tiers={"gpu": 1.0, "cpu": 0.4})
                scored = Router(fleet, weights).lookup(PROMPT)
                # cpu: 4 x 0.4 = 1.6 blocks' worth; gpu: 2 x 1.0 = 2.0
                assert scored.best == "gpu", scored.why
                assert scored.why.startswith("best gpu: 1.50 = prefix 1.50 (2 blocks)")
                assert "queue left out" in scored.why  # no load known
                rows = {r.name: r for r in scored.instances}
                assert rows["cpu"].score == pytest.approx(3.0 * 1.6 / 4)
                assert rows["cpu"].by_tier == {"cpu": 4}
                # a CPU block worth as much as a GPU one: the longer prefix wins
                even = Router(fleet, Weights(tiers={"gpu": 1.0, "cpu": 1.0})).lookup(PROMPT)
                assert even.best == "cpu"
            finally:
                await fleet.stop()

    run(main)


def test_load_scraped_from_the_engines_metrics_outweighs_a_longer_prefix() -> None:
    async def main() -> None:
        busy, idle = FakeEngine(), FakeEngine()
        busy.metrics = vllm_metrics(waiting=200, running=64, kv=0.95, queries=1000, hits=900)
        idle.metrics = vllm_metrics(waiting=0, running=2, kv=0.10, queries=1000, hits=100)
        with ExitStack() as stack:
            urls = {
                "busy": stack.enter_context(serve_engine(busy)),
                "idle": stack.enter_context(serve_engine(idle)),
            }
            with fleet_of(("busy", None), ("idle", None)) as (fleet, pubs):
                scraper = MetricsScraper(
                    lambda: [(n, urls[n] + "/metrics") for n in urls], interval=0.05
                )
                scraper.start()
                await fleet.start()
                try:
                    assert await until(lambda: all(fleet.status(n) == Status.LIVE for n in pubs))
                    pubs["busy"].publish([chain(PROMPT)])  # the whole prefix
                    pubs["idle"].publish([chain(PROMPT[:8])])  # half of it
                    assert await until(lambda: fleet.index.block_count("idle") == 2)
                    assert await until(lambda: fleet.index.block_count("busy") == 4)
                    assert scraper.wait_round()
                    router = Router(fleet, loads=[scraper])
                    scored = router.lookup(PROMPT)
                    assert scored.best == "idle", scored.why
                    assert "200 waiting" in scored.why and "left out" not in scored.why
                    idle_row = next(r for r in scored.instances if r.name == "idle")
                    parts = idle_row.candidates[0].parts
                    assert parts == {"prefix": 1.5, "queue": 2.0, "running": 1.0, "kv": 0.9}
                    # without load weights, the prefix alone decides
                    prefix_only = Weights(queue=0, running=0, kv=0)
                    assert Router(fleet, prefix_only, [scraper]).lookup(PROMPT).best == "busy"
                    figures = scraper.figures()["busy"][0]
                    assert figures.capacity_blocks == 2048 and figures.block_size == 16
                    assert figures.lifetime_hit_rate == pytest.approx(0.9)
                    # a scrape that fails makes the load unknown, never stale
                    busy.metrics_status = 500
                    assert scraper.wait_round()
                    assert scraper.load("busy") is None
                    assert "HTTP 500" in scraper.errors()["busy"]
                    assert "queue left out (no load known for busy)" in router.lookup(PROMPT).why
                finally:
                    scraper.stop()
                    await fleet.stop()

    run(main)


def test_the_windowed_hit_rate_and_dp_ranks_of_vllm_metrics() -> None:
    text = vllm_metrics(1, 2, 0.5, queries=100, hits=25, engine=0) + vllm_metrics(
        3, 4, 0.25, queries=10, hits=10, engine=1
    ).replace("# HELP", "# X").replace("# TYPE", "# Y")
    # two ranks' samples under one family each, as vLLM writes a DP engine's
    merged = "\n".join(line for line in text.splitlines() if not line.startswith("# ")) + "\n"
    ranks = parse_vllm_metrics(merged)
    assert ranks[0].waiting == 1 and ranks[1].waiting == 3 and ranks[1].kv_usage == 0.25
    with pytest.raises(ValueError):
        parse_vllm_metrics("vllm:num_requests_waiting{engine=0 nope\n")


def test_route_predicts_the_prompt_on_the_choice_until_the_real_blocks_or_the_ttl() -> None:
    async def main() -> None:
        clock = Clock()
        engines = {"a": FakeEngine(), "b": FakeEngine()}
        engines["a"].metrics = vllm_metrics(waiting=0, running=0, kv=0.1, block_size=BS)
        engines["b"].metrics = vllm_metrics(waiting=1, running=0, kv=0.1, block_size=BS)
        with ExitStack() as stack:
            urls = {n: stack.enter_context(serve_engine(e)) for n, e in engines.items()}
            with fleet_of(("a", "m"), ("b", "m")) as (fleet, pubs):
                scraper = MetricsScraper(
                    lambda: [(n, u + "/metrics") for n, u in urls.items()], interval=0.05
                )
                scraper.start()
                await fleet.start()
                try:
                    assert await until(lambda: all(fleet.status(n) == Status.LIVE for n in pubs))
                    assert scraper.wait_round()
                    preds = Predictions(ttl=2.0, clock=clock)
                    router = Router(fleet, loads=[scraper], predictions=preds)
                    first = router.route(PROMPT, model="m")
                    assert first.best == "a", first.why  # the emptier queue
                    assert first.predicted.blocks == 4 and first.predicted.ttl_seconds == 2.0
                    # a's queue fills before its BlockStored arrives: the scrape shows it
                    engines["a"].metrics = vllm_metrics(5, 0, 0.1, block_size=BS)
                    engines["b"].metrics = vllm_metrics(0, 0, 0.1, block_size=BS)
                    assert scraper.wait_round()
                    blind = Router(fleet, loads=[scraper]).lookup(PROMPT, model="m")
                    assert blind.best == "b"  # without predictions, the burst spreads
                    for _ in range(3):
                        again = router.route(PROMPT, model="m")
                        assert again.best == "a", again.why  # the predicted prefix holds it
                        row = next(r for r in again.instances if r.name == "a")
                        assert row.predicted_blocks == 4 and row.matched_blocks == 0
                        assert "4 predicted" in again.why
                    # predictions never reach plain lookups or the index
                    assert all(r.matched_blocks == 0 for r in fleet.lookup(PROMPT).instances)
                    # nor lookups in another namespace
                    salted = router.lookup(PROMPT, model="m", cache_salt="s")
                    assert all(r.predicted_blocks == 0 for r in salted.instances)
                    # the real BlockStored arrives: the prediction is dropped
                    pubs["a"].publish([chain(PROMPT)])
                    assert await until(lambda: fleet.index.block_count("a") == 4)
                    real = router.lookup(PROMPT, model="m")
                    row = next(r for r in real.instances if r.name == "a")
                    assert row.matched_blocks == 4 and row.predicted_blocks == 0
                    assert router.predictions.confirmed >= 1
                    # a prediction nobody confirms is gone after its TTL
                    other = list(range(500, 516))
                    router.route(other, model="m")
                    scored = router.lookup(other, model="m")
                    assert any(r.predicted_blocks for r in scored.instances)
                    clock.now += 2.01
                    scored = router.lookup(other, model="m")
                    assert not any(r.predicted_blocks for r in scored.instances)
                    assert router.predictions.expired >= 1 and len(router.predictions) == 0
                    with pytest.raises(NoCandidate, match="no instance serves model 'x'"):
                        router.route(PROMPT, model="x")
                finally:
                    scraper.stop()
                    await fleet.stop()

    run(main)


def test_weights_and_ttl_are_checked() -> None:
    with pytest.raises(ValueError, match="prefix must be a number >= 0"):
        Weights(prefix=-1)
    with pytest.raises(ValueError, match="unknown tier 'hbm'"):
        Weights(tiers={"hbm": 1.0})
    with pytest.raises(ValueError, match="TTL"):
        Predictions(ttl=0)


def test_predictions_are_bounded() -> None:
    preds = Predictions(ttl=60, max_entries=3)
    for i in range(5):
        preds.record(("m", None, None), "a", 0, [i] * 8, 4)
    assert len(preds) == 3
    assert preds.match(("m", None, None), [0] * 8, [4]) == {}  # the oldest went first
    assert preds.match(("m", None, None), [4] * 8, [4]) == {("a", 0): (2, 4)}


def test_spec_router_options_round_trip_and_bad_ones_are_one_line_errors() -> None:
    text = "a=tcp://h:5557,replay=tcp://h:5558,model=meta/llama-3,http=http://h:8000"
    spec = InstanceSpec.parse(text)
    assert spec.model == "meta/llama-3" and spec.metrics_url == "http://h:8000/metrics"
    assert InstanceSpec.parse(spec.render()) == spec
    ranks = InstanceSpec.parse("a=tcp://h:1,rank=1,rank@3=tcp://g:9,replay@3=tcp://g:10")
    assert ranks.ranks() == [1, 3]
    assert [(s.source.rank, s.endpoint) for s in ranks.sources()] == [
        (1, "tcp://h:1"),
        (3, "tcp://g:9"),
    ]
    assert InstanceSpec.parse(ranks.render()) == ranks
    registered = InstanceSpec.parse("7:2=tcp://h:1,rank=2,routing_group=east,block_size=8")
    assert (registered.routing_group, registered.block_size) == ("east", 8)
    assert InstanceSpec.parse(registered.render()) == registered
    for bad, message in [
        ("a=tcp://h:1,routing_group=a b", "routing_group"),
        ("a=tcp://h:1,block_size=0", "block_size must be between 1 and"),
        ("a=tcp://h:1,block_size=16k", "block_size must be a whole number"),
        ("a=tcp://h:1,http=ftp://x", "not an http"),
        ("a=tcp://h:1,model=a b", "model"),
        ("a=tcp://h:1,dp=2,rank@3=tcp://g:9", "don't go together"),
        ("a=tcp://h:1,replay@3=tcp://g:9", "needs rank@3="),
        ("a=tcp://h:1,rank=x", "whole number"),
    ]:
        with pytest.raises(SpecError, match=message):
            InstanceSpec.parse(bad)
