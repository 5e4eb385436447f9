"""The HTTP API in process (TestClient runs the app and its ingest task in one loop),
against real publishers on loopback: every endpoint, bad input, dynamic instances."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
from netutil import wait_until
from service_workload import TestClient

from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec, ReplayPolicy
from kvindex.wire import BigramBlockStored, BlockRemoved, BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

FAST = ReplayPolicy(first_reply_timeout=0.5, idle_timeout=0.3, deadline=5.0)
DIGEST = bytes(range(32))


@dataclass
class Service:
    client: TestClient
    pub: Publisher
    fleet: Fleet

    def instances(self) -> dict[str, dict[str, Any]]:
        return {i["name"]: i for i in self.client.get("/v1/instances").json()["instances"]}

    def wait_blocks(self, name: str, count: int) -> None:
        assert wait_until(lambda: self.instances().get(name, {}).get("blocks") == count)


def publish_base(pub: Publisher) -> None:
    """Chain 1-2-3 over tokens 0..11 (block size 4), the same tokens under a LoRA, a second
    copy of block 1 then one removal of it, and one CPU block known by its digest only."""
    pub.publish([BlockStored([1, 2, 3], None, list(range(12)), 4)])
    pub.publish([BlockStored([11, 12], None, list(range(8)), 4, lora_name="sql")])
    pub.publish([BlockStored([1], None, list(range(4)), 4)])
    pub.publish([BlockRemoved([1])])
    pub.publish([BlockStored([DIGEST], None, [], 0, medium="CPU")])


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        spec = InstanceSpec("a", pub.endpoint, pub.replay_endpoint)
        fleet = Fleet([spec], policy=FAST)
        with TestClient(create_app(fleet), raise_server_exceptions=False) as client:
            svc = Service(client, pub, fleet)
            assert wait_until(lambda: svc.instances()["a"]["status"] == "live")
            publish_base(pub)
            svc.wait_blocks("a", 6)
            yield svc


def test_healthz(service: Service) -> None:
    r = service.client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_instances_fields(service: Service) -> None:
    a = service.instances()["a"]
    for key in (
        "name", "status", "last_seq", "blocks", "gaps", "replayed_batches", "lost_batches",
        "decode_errors", "publisher_restarts", "dp", "endpoint", "replay_endpoint",
        "blocks_by_medium", "stored", "removed", "clears", "ingest_lag_seconds", "ranks",
    ):  # fmt: skip
        assert key in a, key
    assert a["status"] == "live" and a["last_seq"] == 4 and a["dp"] == 1
    assert a["blocks"] == 6 and a["blocks_by_medium"] == {"CPU": 1, "GPU": 5}
    assert (a["stored"], a["removed"], a["clears"]) == (7, 1, 0)
    assert a["endpoint"] == service.pub.endpoint
    assert a["replay_endpoint"] == service.pub.replay_endpoint
    assert a["ranks"][0]["rank"] == 0 and a["ranks"][0]["last_seq"] == 4
    assert 0 <= a["ingest_lag_seconds"] < 5


def test_blocks_each_once_and_by_medium(service: Service) -> None:
    get = service.client.get
    assert sorted(get("/v1/instances/a/blocks").json()["block_hashes"]) == sorted(
        ["1", "2", "3", "11", "12", DIGEST.hex()]
    )
    gpu = get("/v1/instances/a/blocks", params={"medium": "GPU"}).json()["block_hashes"]
    assert sorted(gpu) == ["1", "11", "12", "2", "3"]
    assert get("/v1/instances/a/blocks?medium=CPU").json()["block_hashes"] == [DIGEST.hex()]
    assert get("/v1/instances/a/blocks?medium=DISK").json()["block_hashes"] == []
    r = get("/v1/instances/nope/blocks")
    assert r.status_code == 404 and "nope" in r.json()["error"]


def lookup(service: Service, body: Any) -> Any:
    r = service.client.post("/v1/lookup", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_lookup_by_tokens(service: Service) -> None:
    answer = lookup(service, {"token_ids": list(range(14))})
    assert answer["best"] == "a"
    [row] = answer["instances"]
    assert (row["matched_blocks"], row["matched_tokens"], row["block_size"]) == (3, 12, 4)
    assert row["best_rank"] == 0 and row["ranks"] == [{"rank": 0, "matched_blocks": 3}]
    assert lookup(service, {"token_ids": list(range(7))})["instances"][0]["matched_blocks"] == 1
    miss = lookup(service, {"token_ids": [9, 9, 9, 9, 9]})
    assert miss["best"] is None and miss["instances"][0]["matched_blocks"] == 0
    assert lookup(service, {"token_ids": []})["instances"][0]["matched_blocks"] == 0


def test_lookup_lora_namespace(service: Service) -> None:
    tokens = list(range(12))
    sql = lookup(service, {"token_ids": tokens, "lora_name": "sql"})
    assert sql["instances"][0]["matched_blocks"] == 2
    other = lookup(service, {"token_ids": tokens, "lora_name": "other"})
    assert other["instances"][0]["matched_blocks"] == 0


def test_lookup_salt_namespace() -> None:
    """A tenant's salted chain (vLLM: the salt in block 0's extra keys) answers only a
    lookup with that salt; per-tier and per-group detail stand beside it."""
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        fleet = Fleet([InstanceSpec("s", pub.endpoint, pub.replay_endpoint)], policy=FAST)
        with TestClient(create_app(fleet), raise_server_exceptions=False) as client:
            svc = Service(client, pub, fleet)
            assert wait_until(lambda: svc.instances()["s"]["status"] == "live")
            pub.publish([BlockStored([1, 2, 3], None, list(range(12)), 4, group_idx=0)])
            keys = [["tenant-1"], None]
            pub.publish(
                [BlockStored([21, 22], None, list(range(8)), 4, extra_keys=keys, group_idx=0)]
            )
            svc.wait_blocks("s", 5)
            check_salts(svc)


def check_salts(service: Service) -> None:
    tokens = list(range(12))
    salted = lookup(service, {"token_ids": tokens, "cache_salt": "tenant-1"})["instances"][0]
    assert (salted["matched_blocks"], salted["by_tier"], salted["by_group"]) == (
        2,
        {"gpu": 2},
        {"0": 2},
    )
    other = lookup(service, {"token_ids": tokens, "cache_salt": "tenant-2"})
    assert other["instances"][0]["matched_blocks"] == 0
    # Without the salt only the plain chain answers (3 blocks), never the salted one.
    assert lookup(service, {"token_ids": tokens})["instances"][0]["matched_blocks"] == 3


def test_lookup_of_plain_tokens_finds_an_eagle_engines_bigram_pages() -> None:
    """An SGLang engine with an EAGLE bigram cache publishes pages of pairs; a lookup of
    the plain token ids answers what its match_prefix reuses (n tokens: n - 1 units, in
    whole pages), and never mixes them with a plain engine's chain of the same ids."""
    with (
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as eagle,
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as plain,
    ):
        specs = [
            InstanceSpec("eagle", eagle.endpoint, eagle.replay_endpoint),
            InstanceSpec("plain", plain.endpoint, plain.replay_endpoint),
        ]
        fleet = Fleet(specs, policy=FAST)
        with TestClient(create_app(fleet), raise_server_exceptions=False) as client:
            svc = Service(client, eagle, fleet)
            assert wait_until(lambda: all(i["status"] == "live" for i in svc.instances().values()))
            tokens = list(range(10, 19))  # 9 tokens: 8 units, 4 pages of 2
            pairs = list(pairwise(tokens))
            eagle.publish([BigramBlockStored([1, 2, 3, 4], None, block_size=2, token_pairs=pairs)])
            plain.publish([BlockStored([5], None, [10, 11, 11, 12], 4)])  # page 0, flattened
            svc.wait_blocks("eagle", 4)
            svc.wait_blocks("plain", 1)

            def rows(ids: list[int]) -> dict[str, tuple[int, int, int]]:
                answer = lookup(svc, {"token_ids": ids})["instances"]
                return {
                    r["name"]: (r["matched_blocks"], r["matched_tokens"], r["block_size"])
                    for r in answer
                }

            assert rows(tokens)["eagle"] == (4, 8, 2)
            assert rows(tokens[:8])["eagle"] == (3, 6, 2)
            assert rows(tokens)["plain"][0] == 0
            miss = rows([10, 11, 11, 12])
            assert miss["eagle"][0] == 0 and miss["plain"] == (1, 4, 4)


def test_lookup_by_hashes(service: Service) -> None:
    post = service.client.post
    r = post("/v1/lookup/hashes", json={"block_hashes": ["1", "2", "99", "3"]})
    assert r.status_code == 200
    assert r.json()["instances"][0]["matched_blocks"] == 2
    r = post("/v1/lookup/hashes", json={"block_hashes": [DIGEST.hex()]})
    assert r.json()["instances"][0]["matched_blocks"] == 1
    r = post("/v1/lookup/hashes", json={"block_hashes": ["xyz"]})
    assert r.status_code == 400 and "xyz" in r.json()["error"]


def test_stats(service: Service) -> None:
    stats = service.client.get("/v1/stats").json()
    assert stats["instances"] == 1 and stats["statuses"]["live"] == 1
    assert stats["blocks_by_medium"] == {"CPU": 1, "GPU": 5}
    assert (stats["stored"], stats["removed"], stats["clears"]) == (7, 1, 0)
    rates = stats["rates"]
    assert rates["stores_per_minute"] > 0 and rates["removes_per_minute"] > 0
    assert "net_growth_per_minute" in rates and "clears_per_minute" in rates


def test_dashboard_and_docs(service: Service) -> None:
    page = service.client.get("/")
    assert page.status_code == 200 and "/dashboard/dashboard.js" in page.text
    snapshot = service.client.get("/v1/dashboard/snapshot").json()["snapshot"]
    assert [row["name"] for row in snapshot["instances"]] == ["a"]  # what the page shows
    assert service.client.get("/docs").status_code == 200
    paths = service.client.get("/openapi.json").json()["paths"]
    for path in ("/healthz", "/v1/instances", "/v1/instances/{name}/blocks", "/v1/lookup"):
        assert path in paths


BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    ("POST", "/v1/lookup", {"token_ids": "abc"}, 422),
    ("POST", "/v1/lookup", {"token_ids": [1, "2"]}, 422),
    ("POST", "/v1/lookup", {"token_ids": [1.5]}, 422),
    ("POST", "/v1/lookup", {"token_ids": [-1]}, 422),
    ("POST", "/v1/lookup", {"token_ids": [2**64]}, 422),
    ("POST", "/v1/lookup", {"token_ids": [True]}, 422),
    ("POST", "/v1/lookup", {"token_ids": [1], "lora_name": 5}, 422),
    ("POST", "/v1/lookup", {"token_ids": [1], "extra": 1}, 422),
    ("POST", "/v1/lookup", {}, 422),
    ("POST", "/v1/lookup", [], 422),
    ("POST", "/v1/lookup", None, 400),
    ("POST", "/v1/lookup/hashes", {"block_hashes": ["1"], "x": 1}, 422),
    ("POST", "/v1/lookup", {"token_ids": [0] * 1_000_001}, 422),
    ("POST", "/v1/lookup/hashes", {"block_hashes": [1]}, 422),
    ("POST", "/v1/lookup/hashes", {"block_hashes": ["-"]}, 400),
    ("POST", "/v1/lookup/hashes", {"block_hashes": ["ABC"]}, 400),
    ("POST", "/v1/instances", {}, 400),
    ("POST", "/v1/instances", {"spec": "nope"}, 400),
    ("POST", "/v1/instances", {"spec": "x=tcp://h:1", "name": "x"}, 400),
    ("POST", "/v1/instances", {"name": "x", "endpoint": "http://h:1"}, 400),
    ("POST", "/v1/instances", {"name": "x", "endpoint": "tcp://h:1", "dp": 0}, 400),
    ("POST", "/v1/instances", {"name": "x", "endpoint": "tcp://h:1", "dp": "2"}, 422),
    ("POST", "/v1/instances", {"name": "bad name", "endpoint": "tcp://h:1"}, 400),
    ("POST", "/v1/instances", {"spec": "a=tcp://127.0.0.1:1"}, 409),
    ("DELETE", "/v1/instances/nope", None, 404),
    ("GET", "/v1/nothing", None, 404),
    ("PUT", "/v1/lookup", None, 405),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD_REQUESTS)
def test_bad_input_is_a_json_error(
    service: Service, method: str, path: str, body: Any, status: int
) -> None:
    r = service.client.request(method, path, json=body)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"], str) and r.json()["error"]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"not json",
        b"\xff\xfe",
        b'{"token_ids": [1,]}',
        b"[" * 10_000,
        b'{"token_ids": [1], "lora_name": "\x80"}',  # a string that is not UTF-8
        b'{"block_hashes": ["\xc3"]}',
        b'{"spec": "\xff"}',
    ],
)
def test_malformed_json_is_never_a_500(service: Service, raw: bytes) -> None:
    for path in ("/v1/lookup", "/v1/lookup/hashes", "/v1/instances"):
        r = service.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (400, 422), (path, raw[:20], r.status_code, r.text)
        assert "error" in r.json()


def test_oversized_body_is_refused(service: Service) -> None:
    body = b'{"token_ids": [' + b"1," * (17 * 1024 * 1024) + b"1]}"
    r = service.client.post(
        "/v1/lookup", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "error" in r.json()

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it streams
        yield b'{"token_ids": ['
        for _ in range(40):
            yield b"1," * (1024 * 1024)

    r = service.client.post("/v1/lookup", content=chunks())
    assert r.status_code == 413


def test_instances_added_and_removed_at_runtime(service: Service) -> None:
    client = service.client
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        r = client.post(
            "/v1/instances", json={"spec": f"b={pub.endpoint},replay={pub.replay_endpoint}"}
        )
        assert r.status_code == 201 and r.json()["name"] == "b"
        assert client.post("/v1/instances", json={"spec": f"b={pub.endpoint}"}).status_code == 409
        assert wait_until(lambda: service.instances()["b"]["status"] == "live")
        pub.publish([BlockStored([1, 2], None, list(range(8)), 4)])
        service.wait_blocks("b", 2)
        answer = lookup(service, {"token_ids": list(range(12))})
        assert [(r["name"], r["matched_blocks"]) for r in answer["instances"]] == [
            ("a", 3),
            ("b", 2),
        ]

        r = client.post(
            "/v1/instances", json={"name": "c", "endpoint": "tcp://127.0.0.1:9", "dp": 2}
        )
        assert r.status_code == 201 and len(r.json()["ranks"]) == 2
        assert r.json()["status"] == "connecting"
        rows = lookup(service, {"token_ids": list(range(12))})["instances"]
        assert rows[-1]["name"] == "c" and rows[-1]["ranks"] == [
            {"rank": 0, "matched_blocks": 0},
            {"rank": 1, "matched_blocks": 0},
        ]

        for name in ("b", "c"):
            assert client.delete(f"/v1/instances/{name}").status_code == 204
        assert client.delete("/v1/instances/b").status_code == 404
        assert client.get("/v1/instances/b/blocks").status_code == 404
        assert list(service.instances()) == ["a"]
        assert [r["name"] for r in lookup(service, {"token_ids": [1]})["instances"]] == ["a"]
        assert "b" not in service.fleet.index.instances()
    # The instance that stayed still ingests.
    service.pub.publish([BlockStored([4], 3, list(range(12, 16)), 4)])
    service.wait_blocks("a", 7)
    service.pub.publish([BlockRemoved([4])])
    service.wait_blocks("a", 6)
