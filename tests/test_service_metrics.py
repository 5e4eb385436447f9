"""`/metrics` parses as Prometheus text and says what the fleet and the lookups did."""

from __future__ import annotations

import pytest
from netutil import wait_until
from prometheus_client.parser import text_string_to_metric_families
from service_workload import TestClient

from kvindex.runtime import Fleet
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


def test_metrics_follow_the_fleet_and_lookups() -> None:
    with (
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub,
        TestClient(
            create_app(Fleet([InstanceSpec("m", pub.endpoint, pub.replay_endpoint)]))
        ) as client,
    ):
        assert wait_until(
            lambda: client.get("/v1/instances").json()["instances"][0]["status"] == "live"
        )
        pub.publish([BlockStored([1, 2], None, list(range(8)), 4)])
        pub.publish([BlockStored([b"\x01" * 32], None, [], 0, medium="CPU")])
        pub.publish([AllBlocksCleared()])
        pub.publish([BlockStored([1, 2, 3], None, list(range(12)), 4)])
        pub.publish([BlockRemoved([3])])
        assert wait_until(
            # absent until the first batch is applied: wait for it rather than fail at once
            lambda: (
                scrape(client).get(
                    ("kvindex_last_seq", frozenset({"instance": "m", "rank": "0"}.items()))
                )
                == 4
            )
        )

        for tokens in (list(range(8)), [5, 5, 5, 5], list(range(12))):
            client.post("/v1/lookup", json={"token_ids": tokens})
        client.post("/v1/lookup/hashes", json={"block_hashes": ["1"]})

        s = scrape(client)
        assert value(s, "kvindex_instance_blocks", instance="m", medium="GPU") == 2
        assert (
            "kvindex_instance_blocks",
            frozenset({("instance", "m"), ("medium", "CPU")}),
        ) not in s
        assert value(s, "kvindex_instance_events_total", instance="m", type="stored") == 6
        assert value(s, "kvindex_instance_events_total", instance="m", type="removed") == 1
        assert value(s, "kvindex_instance_events_total", instance="m", type="clears") == 1
        assert value(s, "kvindex_instance_status", instance="m", status="live") == 1
        assert value(s, "kvindex_instance_status", instance="m", status="down") == 0
        assert value(s, "kvindex_batches_delivered_total", instance="m") == 5
        assert value(s, "kvindex_batches_lost_total", instance="m") == 0
        assert value(s, "kvindex_publisher_restarts_total", instance="m") == 0
        assert value(s, "kvindex_decode_errors_total", instance="m") == 0
        assert 0 <= value(s, "kvindex_ingest_lag_seconds", instance="m") < 5
        assert value(s, "kvindex_instances") == 1

        assert value(s, "kvindex_lookup_latency_seconds_count", kind="tokens") == 3
        assert value(s, "kvindex_lookup_requests_total", kind="tokens") == 3
        assert value(s, "kvindex_lookup_hits_total", kind="tokens") == 2
        assert value(s, "kvindex_lookup_hits_total", kind="hashes") == 1
        assert value(s, "kvindex_lookup_hit_ratio") == pytest.approx(3 / 4)

        pub.publish([BlockStored([b"\x02" * 32], None, [], 0, medium="CPU")])
        assert wait_until(
            lambda: (
                ("kvindex_instance_blocks", frozenset({("instance", "m"), ("medium", "CPU")}))
                in scrape(client)
            )
        )


def test_two_apps_have_separate_registries() -> None:
    with TestClient(create_app(Fleet())) as one, TestClient(create_app(Fleet())) as two:
        one.post("/v1/lookup", json={"token_ids": [1]})
        assert value(scrape(one), "kvindex_lookup_requests_total", kind="tokens") == 1
        assert ("kvindex_lookup_requests_total", frozenset({("kind", "tokens")})) not in scrape(two)
