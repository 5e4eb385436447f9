"""`kvindex serve` as a router runs it, as its own process over real HTTP and ZMQ: the
routing score's weights and the prediction TTL from the config file and the flags; the
peers' `/register` (routing group, block size) kept by a SQLite store across a restart."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from clitools import Proc, kvindex
from test_router_service import until

from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(90)


def started(proc: Proc) -> str:
    """The base URL serve says it listens on."""
    return proc.listening_url().rstrip("/")


def test_serve_scores_and_predicts_with_the_weights_and_ttl_it_is_given(tmp_path: Path) -> None:
    config = tmp_path / "k.toml"
    config.write_text("[routing]\nprediction_ttl = 3\n[routing.weights]\ncpu = 0.5\nqueue = 1.5\n")
    with Publisher("tcp://127.0.0.1:*") as pub:
        proc = kvindex(
            "serve", "--config", str(config), "--store", "memory", "--http", "127.0.0.1:0",
            "--instance", f"e0={pub.endpoint}", "--weights", "queue=0.25,kv=0",
            "--prediction-ttl", "7",
        )  # fmt: skip
        try:
            with httpx.Client(base_url=started(proc), timeout=10) as client:
                scored = client.post("/v1/lookup", json={"token_ids": [1] * 32, "score": True})
                assert scored.json()["weights"] == {  # the flag's queue over the file's
                    "prefix": 3.0, "queue": 0.25, "running": 1.0, "kv": 0.0, "predicted": 1.0,
                    "backlog": 0.0,
                    "tiers": {"gpu": 1.0, "cpu": 0.5, "disk": 0.5, "external": 0.5},
                }  # fmt: skip
                routed = client.post("/v1/route", json={"token_ids": list(range(32))}).json()
                assert routed["best"] == "e0"
                assert routed["predicted"] == {
                    "instance": "e0", "rank": 0, "blocks": 2, "ttl_seconds": 7.0
                }  # fmt: skip
        finally:
            proc.interrupt()
            assert proc.finish(15) == 0


def stored(tokens: list[int], size: int) -> BlockStored:
    blocks = len(tokens) // size
    hashes = [hash(("h", *tokens[: (i + 1) * size])) for i in range(blocks)]
    return BlockStored(hashes, None, tokens[: blocks * size], size)


def test_registered_routing_groups_and_block_sizes_survive_a_restart(tmp_path: Path) -> None:
    """`/register`'s routing group and block size are in the instance's spec, which the
    SQLite store keeps: after a restart the worker answers in its group, with its size."""
    store = f"sqlite:///{tmp_path / 'kvindex.sqlite'}"
    tokens = list(range(500, 524))  # 3 blocks of 8
    serve = ("serve", "--store", store, "--http", "127.0.0.1:0")
    query = {"token_ids": tokens, "model_name": "llama", "routing_group": "east"}
    with Publisher("tcp://127.0.0.1:*") as pub:
        first = kvindex(*serve)
        try:
            with httpx.Client(base_url=started(first), timeout=10) as client:
                registered = client.post(
                    "/register",
                    json={"instance_id": 7, "dp_rank": 2, "endpoint": pub.endpoint,
                          "model_name": "llama", "block_size": 8, "routing_group": "east"},
                )  # fmt: skip
                assert registered.status_code == 201, registered.text
                bad = client.post(
                    "/register",
                    json={"instance_id": 8, "endpoint": pub.endpoint, "model_name": "llama",
                          "block_size": 8, "routing_group": "two words"},
                )  # fmt: skip
                assert bad.status_code == 400 and "routing_group" in bad.json()["error"]
                assert until(lambda: _listening(client))
                # ZMQ's slow joiner: a subscription just made may miss the first batch
                assert until(lambda: _published(pub, tokens) and _answered(client, query))
                before = client.get("/workers").json()
                answer = client.post("/query", json=query).json()
        finally:
            first.interrupt()
            assert first.finish(15) == 0
        again = kvindex(*serve)
        try:
            with httpx.Client(base_url=started(again), timeout=10) as client:
                assert client.get("/workers").json() == before
                [worker] = before
                assert (worker["routing_group"], worker["block_size"]) == ("east", 8)
                assert list(worker["endpoints"]) == ["2"]
                assert client.post("/query", json=query).json() == answer
                assert answer["scores"] == {"7": {"2": 24}}
                elsewhere = client.post("/query", json={**query, "routing_group": "default"})
                assert elsewhere.status_code == 404
        finally:
            again.interrupt()
            assert again.finish(15) == 0


def _published(pub: Publisher, tokens: list[int]) -> bool:
    pub.publish([stored(tokens, 8)])
    return True


def _answered(client: httpx.Client, query: dict[str, object]) -> bool:
    time.sleep(0.1)
    return bool(client.post("/query", json=query).json()["scores"])


def _listening(client: httpx.Client) -> bool:
    workers = client.get("/workers").json()
    return bool(workers) and all(w["status"] == "active" for w in workers)
