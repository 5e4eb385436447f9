"""`/metrics` parses as Prometheus text and says what the fleet and the lookups did."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from httpfixture import FakeEngine, serve_engine, vllm_metrics
from netutil import wait_until
from prometheus_client.parser import text_string_to_metric_families
from service_workload import TestClient

from kvindex.runtime import Fleet, StoreHealth
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: TestClient) -> Samples:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@contextmanager
def live_engine() -> Iterator[tuple[Publisher, TestClient]]:
    """A publisher followed as engine `m` by an app, once it is live."""
    with (
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub,
        TestClient(
            create_app(Fleet([InstanceSpec("m", pub.endpoint, pub.replay_endpoint)]))
        ) as client,
    ):
        assert wait_until(
            lambda: client.get("/v1/instances").json()["instances"][0]["status"] == "live"
        )
        yield pub, client


def test_metrics_follow_the_fleet_and_lookups() -> None:
    with live_engine() as (pub, client):
        pub.publish([BlockStored([1, 2], None, list(range(8)), 4)])
        pub.publish([BlockStored([b"\x01" * 32], None, [], 0, medium="CPU")])
        pub.publish([AllBlocksCleared()])
        pub.publish([BlockStored([1, 2, 3], None, list(range(12)), 4)])
        pub.publish([BlockRemoved([3])])
        assert wait_until(
            # absent until the first batch is applied: wait for it rather than fail at once
            lambda: (
                scrape(client).get(
                    ("kvindex_last_seq", frozenset({"engine": "m", "rank": "0"}.items()))
                )
                == 4
            )
        )

        for tokens in (list(range(8)), [5, 5, 5, 5], list(range(12))):
            client.post("/v1/lookup", json={"token_ids": tokens})
        client.post("/v1/lookup/hashes", json={"block_hashes": ["1"]})

        s = scrape(client)
        assert value(s, "kvindex_engine_blocks", engine="m", medium="GPU", tier="gpu") == 2
        cpu = frozenset({("engine", "m"), ("medium", "CPU"), ("tier", "cpu")})
        assert ("kvindex_engine_blocks", cpu) not in s
        # Blocks and events apart: 1 + 2 + 3 blocks stored, 1 removed, and one clear event.
        assert value(s, "kvindex_blocks_stored_total", engine="m") == 6
        assert value(s, "kvindex_blocks_removed_total", engine="m") == 1
        assert value(s, "kvindex_cache_clears_total", engine="m") == 1
        # The CPU event had no tokens: held by hash, without a place in the tree.
        assert value(s, "kvindex_blocks_unplaced_total", engine="m") == 1
        assert value(s, "kvindex_blocks_unrecognised_keys_total", engine="m") == 0
        assert value(s, "kvindex_engine_status", engine="m", status="live") == 1
        assert value(s, "kvindex_engine_status", engine="m", status="down") == 0
        assert value(s, "kvindex_batches_delivered_total", engine="m") == 5
        assert value(s, "kvindex_batches_lost_total", engine="m") == 0
        assert value(s, "kvindex_publisher_restarts_total", engine="m") == 0
        assert value(s, "kvindex_decode_errors_total", engine="m") == 0
        assert 0 <= value(s, "kvindex_ingest_lag_seconds", engine="m") < 5
        assert value(s, "kvindex_engines") == 1

        assert value(s, "kvindex_lookup_latency_seconds_count", kind="tokens") == 3
        assert value(s, "kvindex_lookup_requests_total", kind="tokens") == 3
        assert value(s, "kvindex_lookup_hits_total", kind="tokens") == 2
        assert value(s, "kvindex_lookup_hits_total", kind="hashes") == 1

        pub.publish([BlockStored([b"\x02" * 32], None, [], 0, medium="CPU")])
        assert wait_until(lambda: ("kvindex_engine_blocks", cpu) in scrape(client))


def test_placement_counters_follow_keys_across_tiers() -> None:
    """A salted GPU chain, then the same hashes offloaded to the CPU without extra keys
    (as vLLM's offload tracker announces them): the CPU copies keep the salt's namespace,
    counted; a block with extra keys of an unknown shape is counted too."""
    salted = {"extra_keys": [["tenant-salt"], None], "medium": "GPU"}
    with live_engine() as (pub, client):
        pub.publish([BlockStored([1, 2], None, list(range(8)), 4, **salted)])
        pub.publish([BlockStored([1, 2], None, list(range(8)), 4, medium="CPU")])
        pub.publish([BlockStored([7], None, [9, 9, 9, 9], 4, extra_keys=[[{"odd": 1}]])])
        key = ("kvindex_namespace_kept_total", frozenset({("engine", "m")}))
        assert wait_until(lambda: scrape(client).get(key) == 2)
        s = scrape(client)
        assert value(s, "kvindex_blocks_unrecognised_keys_total", engine="m") == 1
        assert value(s, "kvindex_namespace_moved_total", engine="m") == 0
        assert value(s, "kvindex_blocks_unplaced_total", engine="m") == 0


def test_two_apps_have_separate_registries() -> None:
    with TestClient(create_app(Fleet())) as one, TestClient(create_app(Fleet())) as two:
        one.post("/v1/lookup", json={"token_ids": [1]})
        assert value(scrape(one), "kvindex_lookup_requests_total", kind="tokens") == 1
        assert ("kvindex_lookup_requests_total", frozenset({("kind", "tokens")})) not in scrape(two)


def test_metrics_fit_prometheus() -> None:
    """No label Prometheus reserves for itself, no since-start ratio gauges (counters, for
    PromQL to divide over a window), and the process's own memory and CPU."""
    with TestClient(create_app(Fleet([InstanceSpec("m", "tcp://127.0.0.1:9")]))) as client:
        r = client.get("/metrics")
        families = list(text_string_to_metric_families(r.text))
    labels = {label for f in families for s in f.samples for label in s.labels}
    assert not labels & {"instance", "job"}, labels  # the scrape target's, not ours
    assert "engine" in labels
    names = {f.name for f in families}
    assert not [n for n in names if "ratio" in n]
    assert {"process_resident_memory_bytes", "process_cpu_seconds", "python_info"} <= names
    assert "python_gc_objects_collected" in names
    version = [s for f in families for s in f.samples if s.name == "kvindex_build_info"]
    assert version and version[0].labels["version"]


def test_store_metrics_come_from_the_store_itself() -> None:
    said = [StoreHealth("sqlite:///x", lag_seconds=0.25, pending_groups=12, restarts=1)]
    with TestClient(create_app(Fleet(), store_health=lambda: said[0])) as client:
        s = scrape(client)
        assert value(s, "kvindex_store_up") == 1
        assert value(s, "kvindex_store_lag_seconds") == 0.25
        assert value(s, "kvindex_store_pending_groups") == 12
        assert value(s, "kvindex_store_restarts_total") == 1
        said[0] = StoreHealth("sqlite:///x", up=False, reason="gone", last_error="gone")
        s = scrape(client)
        assert value(s, "kvindex_store_up") == 0
        info = [k for k in s if k[0] == "kvindex_store_info"]
        assert ("last_error", "gone") in info[0][1]
        assert client.get("/healthz").json() == {"status": "degraded", "reason": "store: gone"}


def documented_metrics() -> set[str]:
    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    table = text.split("<!-- metrics:start")[1].split("<!-- metrics:end -->")[0]
    return set(re.findall(r"^\| `(kvindex_\w+)`", table, re.M))


def test_every_metric_is_documented_and_every_documented_one_exists(tmp_path: Path) -> None:
    from tokenizer_fixture import build_tokenizer

    from kvindex.runtime.tokenize import Tokenizers
    from kvindex.service.lookups import Routing

    engine = FakeEngine()  # its /metrics read by kvindex: the kvindex_engine_* figures
    engine.metrics = vllm_metrics(waiting=1, running=2, kv=0.5, queries=10, hits=5)

    def app(pub: Publisher, engine_url: str) -> Any:
        fleet = Fleet(
            [
                InstanceSpec("m", pub.endpoint, pub.replay_endpoint, http=engine_url),
                InstanceSpec.parse("n=events=none,gpu_blocks=8"),  # kvindex_approximate_*
            ]
        )
        tokenizers = Tokenizers(fleet)  # a local one: its prefix cache's figures
        tokenizers.add("m", str(build_tokenizer(tmp_path / "tok")))
        return create_app(fleet, routing=Routing.of(fleet, tokenizers))

    with (
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub,
        serve_engine(engine) as engine_url,
        TestClient(app(pub, engine_url)) as client,
    ):
        pub.publish([BlockStored([1], None, list(range(4)), 4)])
        assert wait_until(
            lambda: (
                ("kvindex_last_seq", frozenset({("engine", "m"), ("rank", "0")})) in scrape(client)
                and ("kvindex_engine_pool_blocks", frozenset({("engine", "m"), ("rank", "0")}))
                in scrape(client)
            )
        )
        client.post("/v1/lookup", json={"token_ids": [0, 1, 2, 3]})  # a hit
        families = list(text_string_to_metric_families(client.get("/metrics").text))
    exposed = set()
    for family in families:
        for sample in family.samples:
            name = sample.name
            if name.startswith("kvindex_"):
                for suffix in ("_bucket", "_count", "_sum"):
                    if family.type == "histogram" and name.endswith(suffix):
                        name = name[: -len(suffix)]
                exposed.add(name)
    assert exposed == documented_metrics()
