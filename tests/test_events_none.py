"""Engines without KV events (`events=none`): the spec, the approximate cache (LRU bounded
by the pool, aged by a TTL) and a real `kvindex serve` routing a mixed fleet over HTTP,
one engine publishing real events over ZMQ and one publishing nothing."""

from __future__ import annotations

import time
from array import array
from pathlib import Path

import httpx
import pytest
from clitools import kvindex
from test_router_serve import started, stored
from test_router_service import until

from kvindex.runtime.approximate import ApproximateCaches
from kvindex.subscriber import SourceKey
from kvindex.subscriber.spec import InstanceSpec, SpecError
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(90)


def _data(tokens: list[int]) -> bytes:
    return array("I", tokens).tobytes()


def test_spec_events_none_round_trips_and_refuses_what_does_not_apply() -> None:
    spec = InstanceSpec.parse("n0=events=none,gpu_blocks=100,ttl=30,model=m,block_size=8")
    assert (spec.events_none, spec.pool_blocks, spec.approx_ttl) == (True, 100, 30.0)
    assert spec.sources() == [] and spec.ranks() == [0] and not spec.pending
    assert InstanceSpec.parse(spec.render()) == spec
    loaded = InstanceSpec.parse("n2=events=none,load=tcp://127.0.0.1:5558")  # SGLang's load
    assert loaded.load_sources() == [(SourceKey("n2", 0), "tcp://127.0.0.1:5558")]
    assert InstanceSpec.parse(loaded.render()) == loaded and loaded.sources() == []
    for bad, why in (
        ("n0=events=none,dp=2", "unknown option"),
        ("n0=events=none,gpu_blocks=0", "gpu_blocks"),
        ("n0=events=none,ttl=nan", "ttl"),
        ("n0=events=none,ttl=0", "ttl"),
        ("n0=tcp://127.0.0.1:5557,gpu_blocks=3", "unknown option"),
    ):
        with pytest.raises(SpecError, match=why):
            InstanceSpec.parse(bad)
    # an API client's spec: its URLs are held to the engine allow-list like any other's
    client = InstanceSpec.parse("n1=events=none,http=http://127.0.0.1:8000", from_client=True)
    assert client.events_none and client.hosts() == ["127.0.0.1"]


def test_approximate_cache_shares_prefixes_evicts_deepest_lru_first_and_expires() -> None:
    now = [0.0]
    caches = ApproximateCaches(clock=lambda: now[0])
    caches.configure("n0", capacity=6, ttl=10.0)
    ns = ("m", None, None, None)
    a, b = list(range(16)), list(range(100, 116))  # 4 blocks of 4 each
    assert caches.record("n0", ns, _data(a), 4) == 4
    assert caches.match("n0", ns, _data([*a[:8], 7, 7, 7, 7]), 4) == 2  # the shared prefix
    assert caches.match("n0", ("other", None, None, None), _data(a), 4) == 0
    now[0] = 1.0
    assert caches.record("n0", ns, _data(b), 4) == 4  # 8 blocks > 6: a's 2 deepest go
    assert caches.match("n0", ns, _data(a), 4) == 2
    assert caches.match("n0", ns, _data(b), 4) == 4
    stats = caches.stats("n0")
    assert stats is not None and (stats.blocks, stats.evicted, stats.routed) == (6, 2, 2)
    now[0] = 10.5  # a's blocks (routed at 0) are past their TTL, b's (at 1) not
    assert caches.match("n0", ns, _data(a), 4) == 0
    assert caches.match("n0", ns, _data(b), 4) == 4
    now[0] = 11.0
    assert caches.match("n0", ns, _data(b), 4) == 0
    stats = caches.stats("n0")
    assert stats is not None and (stats.blocks, stats.expired) == (0, 6)
    assert caches.record("other", ns, _data(a), 4) == 0  # not an events=none instance


def test_serve_routes_a_mixed_fleet_and_learns_the_events_none_engine() -> None:
    """`a0` publishes nothing: what /v1/route sends there is found there by the next
    scored lookup (approximate), evicted at its 4-block pool, expired after its TTL;
    `e1` publishes real events and wins the prompts it holds."""
    held = list(range(1000, 1032))  # 2 blocks of 16, published by e1
    with Publisher("tcp://127.0.0.1:*") as pub:
        proc = kvindex(
            "serve", "--store", "memory", "--http", "127.0.0.1:0",
            "--instance", f"e1={pub.endpoint}",
            "--instance", "a0=events=none,gpu_blocks=4,ttl=4,block_size=16",
        )  # fmt: skip
        try:
            with httpx.Client(base_url=started(proc), timeout=10) as client:
                instances = {i["name"]: i for i in client.get("/v1/instances").json()["instances"]}
                assert instances["a0"]["approximate"] is True
                assert instances["a0"]["status"] == "live"
                assert (
                    instances["a0"]["spec"] == "a0=events=none,gpu_blocks=4,ttl=4.0,block_size=16"
                )
                assert instances["e1"]["approximate"] is False

                def e1_holds() -> bool:
                    pub.publish([stored(held, 16)])
                    time.sleep(0.1)
                    return (
                        client.post("/v1/lookup", json={"token_ids": held}).json()["best"] == "e1"
                    )

                assert until(e1_holds)  # ZMQ's slow joiner may miss the first batches
                p1 = list(range(32))
                first = client.post("/v1/route", json={"token_ids": p1}).json()
                assert first["best"] == "a0"  # nobody holds p1: the tie goes by name
                assert first["predicted"] == {
                    "instance": "a0", "rank": 0, "blocks": 2, "ttl_seconds": 4.0
                }  # fmt: skip
                scored = client.post("/v1/lookup", json={"token_ids": p1, "score": True}).json()
                rows = {r["name"]: r for r in scored["instances"]}
                assert scored["best"] == "a0"
                assert (rows["a0"]["matched_blocks"], rows["a0"]["approximate"]) == (2, True)
                assert (rows["e1"]["matched_blocks"], rows["e1"]["approximate"]) == (0, False)
                # the plain lookup is the exact index: a0 published nothing
                plain = client.post("/v1/lookup", json={"token_ids": p1}).json()
                assert plain["best"] is None
                # what e1 holds goes to e1 (its real blocks), and nothing is learnt on a0
                assert client.post("/v1/route", json={"token_ids": held}).json()["best"] == "e1"
                # a0's pool is 4 blocks: two more 2-block prompts routed there push p1 out
                for start in (200, 300):
                    p = list(range(start, start + 32))
                    assert client.post("/v1/route", json={"token_ids": p}).json()["best"] == "a0"
                again = client.post("/v1/lookup", json={"token_ids": p1, "score": True}).json()
                assert {r["name"]: r for r in again["instances"]}["a0"]["matched_blocks"] == 0
                metrics = client.get("/metrics").text
                assert 'kvindex_engine_approximate{engine="a0"} 1.0' in metrics
                assert 'kvindex_approximate_blocks{engine="a0",kind="evicted"} 2.0' in metrics
                cache = {i["name"]: i for i in client.get("/v1/instances").json()["instances"]}[
                    "a0"
                ]["approximate_cache"]
                assert (cache["blocks"], cache["capacity"], cache["evicted"]) == (4, 4, 2)
                # past the TTL, what was routed there is assumed gone
                last = list(range(300, 332))
                time.sleep(4.5)
                late = client.post("/v1/lookup", json={"token_ids": last, "score": True}).json()
                assert {r["name"]: r for r in late["instances"]}["a0"]["matched_blocks"] == 0
                # removed and added again by the API: it starts empty
                assert client.delete("/v1/instances/a0").status_code in (200, 204)
                added = client.post("/v1/instances", json={"spec": "a0=events=none,ttl=60"})
                assert added.status_code == 201, added.text
                routed = client.post("/v1/route", json={"token_ids": last}).json()
                assert routed["best"] == "a0" and routed["predicted"]["ttl_seconds"] == 60.0
        finally:
            proc.interrupt()
            assert proc.finish(15) == 0


def test_an_events_none_spec_survives_a_restart_and_its_cache_does_not(tmp_path: Path) -> None:
    """The SQLite store keeps the spec (added by the API), as any other; the approximate
    cache is not persisted: after a restart the instance is there, empty."""
    serve = (
        "serve", "--store", f"sqlite:///{tmp_path / 'k.sqlite'}", "--http", "127.0.0.1:0",
    )  # fmt: skip
    spec = "n0=events=none,gpu_blocks=64,ttl=600.0,model=m,block_size=4"
    prompt = {"token_ids": list(range(12)), "model": "m"}
    first = kvindex(*serve)
    try:
        with httpx.Client(base_url=started(first), timeout=10) as client:
            assert client.post("/v1/instances", json={"spec": spec}).status_code == 201
            assert client.post("/v1/route", json=prompt).json()["predicted"]["blocks"] == 3
            scored = client.post("/v1/lookup", json={**prompt, "score": True}).json()
            assert scored["instances"][0]["matched_blocks"] == 3
    finally:
        first.interrupt()
        assert first.finish(15) == 0
    again = kvindex(*serve)
    try:
        with httpx.Client(base_url=started(again), timeout=10) as client:
            [view] = client.get("/v1/instances").json()["instances"]
            assert (view["spec"], view["approximate"], view["status"]) == (spec, True, "live")
            scored = client.post("/v1/lookup", json={**prompt, "score": True}).json()
            assert scored["instances"][0]["matched_blocks"] == 0
    finally:
        again.interrupt()
        assert again.finish(15) == 0


def test_peers_workers_list_an_events_none_engine_as_approximate() -> None:
    from service_workload import TestClient

    from kvindex.runtime import Fleet
    from kvindex.service.app import create_app
    from kvindex.service.lookups import Routing

    fleet = Fleet([InstanceSpec.parse("7=events=none,model=llama,block_size=4")])
    with TestClient(create_app(fleet, routing=Routing.of(fleet))) as client:
        [worker] = client.get("/workers").json()
        assert (worker["source"], worker["status"], worker["endpoints"]) == (
            "approximate", "active", {}
        )  # fmt: skip
        prompt = {"token_ids": list(range(8)), "model_name": "llama"}
        assert (
            client.post("/v1/route", json={"token_ids": prompt["token_ids"]}).json()["best"] == "7"
        )
        # the peers' /query answers from the index: the engine published nothing
        answer = client.post("/query", json=prompt)
        assert answer.status_code == 200 and not any(
            any(ranks.values()) for ranks in answer.json()["scores"].values()
        ), answer.text


def test_pool_from_the_engines_metrics_and_a_sleep_clears_what_was_routed() -> None:
    """No `gpu_blocks=`: the bound is the engine's `num_gpu_blocks` once its `/metrics`
    is read (2048 here); when it says it sleeps, the blocks routed there are gone."""
    from httpfixture import FakeEngine, serve_engine, vllm_metrics
    from netutil import wait_until
    from service_workload import TestClient
    from test_sleep import sleep_state

    from kvindex.runtime import Fleet
    from kvindex.service.app import create_app
    from kvindex.service.lookups import Routing

    engine = FakeEngine()
    engine.metrics = vllm_metrics(waiting=0, running=0, kv=0.1) + sleep_state(awake=True)
    with serve_engine(engine) as engine_url:
        fleet = Fleet([InstanceSpec.parse(f"n0=events=none,http={engine_url},block_size=16")])
        with TestClient(create_app(fleet, routing=Routing.of(fleet))) as client:

            def cache() -> dict[str, int]:
                [view] = client.get("/v1/instances").json()["instances"]
                return dict(view["approximate_cache"])

            assert wait_until(lambda: cache()["capacity"] == 2048, timeout=10)
            routed = client.post("/v1/route", json={"token_ids": list(range(64))}).json()
            assert routed["predicted"]["blocks"] == 4 and cache()["blocks"] == 4
            engine.metrics = vllm_metrics(waiting=0, running=0, kv=0.0) + sleep_state(False)
            assert wait_until(lambda: cache()["blocks"] == 0, timeout=10)
            again = {"token_ids": list(range(64)), "score": True}
            assert (
                client.post("/v1/lookup", json=again).json()["instances"][0]["matched_blocks"] == 0
            )
