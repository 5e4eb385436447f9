"""The router's HTTP API on a real server over real ZMQ publishers: lookups by prompt and
chat messages (a tokenizer built on the fly; an engine answering /tokenize over HTTP),
per model, scored; /v1/route's prediction; the peers' API (Dynamo's shapes), JSON and
msgpack; `serve --tokenizer`'s one-line errors."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from httpfixture import FakeEngine, serve_app, serve_engine, vllm_metrics
from prometheus_client.parser import text_string_to_metric_families
from tokenizer_fixture import build_tokenizer

from kvindex.index import compiled_index
from kvindex.runtime import Fleet
from kvindex.runtime.tokenize import Chat, LocalTokenizer, Tokenizers
from kvindex.service.app import create_app
from kvindex.service.lookups import Routing
from kvindex.subscriber import InstanceSpec
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(90)
BS = 4


def stored(tokens: list[int], medium: str | None = None) -> BlockStored:
    blocks = len(tokens) // BS
    hashes = [hash(("h", *tokens[: (i + 1) * BS])) for i in range(blocks)]
    return BlockStored(hashes, None, tokens[: blocks * BS], BS, medium=medium)


def until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "model")


def test_lookups_by_prompt_and_messages_per_model_scored_and_routed(model_dir: Path) -> None:
    local = LocalTokenizer.load(model_dir)
    engine = FakeEngine(local)  # model "e" is tokenized by its engine's /tokenize
    prompt = "Route each request to the instance that already holds its prefix. " * 3
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = local.encode_prompt(prompt)
    chat_ids = local.encode_chat(Chat(messages))
    with ExitStack() as stack:
        pubs = [stack.enter_context(Publisher("tcp://127.0.0.1:*")) for _ in range(3)]
        engine_url = stack.enter_context(serve_engine(engine))
        fleet = Fleet(
            [
                InstanceSpec("m0", pubs[0].endpoint, model="m"),
                InstanceSpec("m1", pubs[1].endpoint, model="m"),
                InstanceSpec("e0", pubs[2].endpoint, model="e", http=engine_url),
            ]
        )
        tokenizers = Tokenizers(fleet)
        tokenizers.add("m", str(model_dir))
        tokenizers.add("e", "vllm")
        app = create_app(fleet, routing=Routing.of(fleet, tokenizers))
        url = stack.enter_context(serve_app(app))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        half = len(prompt_ids) // 2
        pubs[0].publish([stored(prompt_ids)])  # m0: the whole prompt
        pubs[1].publish([stored(prompt_ids[:half])])  # m1: half of it
        pubs[2].publish([stored(chat_ids)])  # e0: the chat, under the other model
        whole = len(prompt_ids) // BS
        assert until(lambda: fleet.index.block_count("m0") == whole)
        assert until(lambda: fleet.index.block_count("e0") == len(chat_ids) // BS)

        answer = client.post("/v1/lookup", json={"prompt": prompt, "model": "m"}).json()
        rows = {r["name"]: r["matched_blocks"] for r in answer["instances"]}
        assert rows == {"m0": whole, "m1": half // BS} and answer["best"] == "m0"
        # the only-model default is not there with two tokenizers
        refused = client.post("/v1/lookup", json={"prompt": prompt})
        assert refused.status_code == 404 and "say which model" in refused.json()["error"]
        # messages, tokenized by the engine itself (its /tokenize was asked)
        chat = client.post("/v1/lookup", json={"messages": messages, "model": "e"}).json()
        assert [(r["name"], r["matched_blocks"]) for r in chat["instances"]] == [
            ("e0", len(chat_ids) // BS)
        ]
        assert any(path == "/tokenize" and "messages" in body for path, body in engine.requests)
        # token ids with a model, and a model nobody serves
        by_ids = client.post("/v1/lookup", json={"token_ids": chat_ids, "model": "e"}).json()
        assert by_ids["instances"] == chat["instances"]
        unknown = client.post("/v1/lookup", json={"token_ids": [1], "model": "x"})
        assert unknown.status_code == 404 and "model 'x'" in unknown.json()["error"]
        no_tok = client.post("/v1/lookup", json={"prompt": "hi", "model": "x"})
        assert no_tok.status_code == 404 and "tokenizer" in no_tok.json()["error"]
        bad = client.post("/v1/lookup", json={"prompt": 5})
        assert bad.status_code == 422 and "$.prompt" in bad.json()["error"]
        # the score: why, per tier and rank, weights
        scored = client.post(
            "/v1/lookup", json={"prompt": prompt, "model": "m", "score": True}
        ).json()
        assert scored["best"] == "m0" and scored["why"].startswith("best m0:")
        assert scored["prompt_tokens"] == len(prompt_ids)
        assert scored["weights"]["tiers"]["gpu"] == 1.0
        # a route records a prediction: a new prompt's burst stays where the first went
        fresh = "A story about a cache that remembered every prompt it was given. " * 2
        first = client.post("/v1/route", json={"prompt": fresh, "model": "m"}).json()
        assert first["predicted"]["blocks"] == len(local.encode_prompt(fresh)) // BS
        again = client.post("/v1/route", json={"prompt": fresh, "model": "m"}).json()
        assert again["best"] == first["best"]
        row = next(r for r in again["instances"] if r["name"] == first["best"])
        assert row["predicted_blocks"] == first["predicted"]["blocks"]
        none = client.post("/v1/route", json={"token_ids": [1, 2], "model": "x"})
        assert none.status_code == 404
        # the plain fast path is untouched: no predictions, no model filter
        plain = client.post("/v1/lookup", json={"token_ids": local.encode_prompt(fresh)})
        assert all(r["matched_blocks"] == 0 for r in plain.json()["instances"])
        assert "predicted_blocks" not in plain.text


def test_the_peers_api_answers_as_dynamos_indexer_does() -> None:
    tokens = list(range(1000, 1032))  # 8 blocks of 4
    with ExitStack() as stack:
        pubs = [stack.enter_context(Publisher("tcp://127.0.0.1:*")) for _ in range(3)]
        fleet = Fleet()
        app = create_app(fleet)
        url = stack.enter_context(serve_app(app))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        reg = {"instance_id": 7, "model_name": "llama", "block_size": BS}
        ok = client.post("/register", json={**reg, "endpoint": pubs[0].endpoint})
        assert (ok.status_code, ok.json()) == (201, {"status": "ok"})
        rank1 = {**reg, "endpoint": pubs[1].endpoint, "dp_rank": 1}
        packed = msgspec.msgpack.encode(rank1)
        ok = client.post(
            "/register", content=packed, headers={"content-type": "application/msgpack"}
        )
        assert ok.status_code == 201 and msgspec.msgpack.decode(ok.content) == {"status": "ok"}
        again = client.post("/register", json={**reg, "endpoint": pubs[0].endpoint})
        assert again.status_code == 409
        assert again.json() == {"error": "instance 7 dp_rank 0 already registered"}
        other = {"instance_id": 9, "model_name": "qwen", "block_size": BS}
        assert client.post("/register", json={**other, "endpoint": pubs[2].endpoint}).is_success
        bad = client.post("/register", json={**reg, "endpoint": "nope"})
        assert bad.status_code == 422  # the endpoint pattern (Dynamo: 400, plain text)

        assert until(lambda: all(fleet.status(n).value == "live" for n in fleet.specs))
        pubs[0].publish([stored(tokens[:16])])  # rank 0: 4 blocks on GPU
        pubs[1].publish([stored(tokens)])  # rank 1: 8 blocks on GPU
        pubs[2].publish([stored(tokens)])  # the other model
        assert until(lambda: fleet.index.block_count("7:1") == 8)
        assert until(lambda: fleet.index.block_count("7:0") == 4)
        assert until(lambda: fleet.index.block_count("9:0") == 8)

        query = {"token_ids": tokens, "model_name": "llama"}
        answer = client.post("/query", json=query).json()
        assert answer == {
            "scores": {"7": {"0": 16, "1": 32}},
            "frequencies": [],
            "instances": {
                "7": {
                    "longest_matched": 32,
                    "gpu": 32,
                    "dp": {"0": 16, "1": 32},
                    "cpu": 32,
                    "disk": 32,
                }
            },
        }
        packed_answer = client.post(
            "/query",
            content=msgspec.msgpack.encode(query),
            headers={"content-type": "application/msgpack"},
        )
        assert msgspec.msgpack.decode(packed_answer.content) == answer
        empty = client.post("/query", json={"token_ids": [], "model_name": "llama"}).json()
        assert empty == {"scores": {}, "frequencies": [], "instances": {}}
        missing = client.post("/query", json={"token_ids": tokens, "model_name": "x"})
        assert missing.status_code == 404
        assert missing.json() == {"error": "no indexer for model=x routing_group=default"}
        negative = client.post("/query", json={"token_ids": [-1], "model_name": "llama"})
        assert negative.status_code == 422

        workers = client.get("/workers", params={"model_name": "llama"}).json()
        assert len(workers) == 1
        worker = workers[0]
        assert worker["instance_id"] == 7 and worker["block_size"] == BS
        assert worker["endpoints"] == {"0": pubs[0].endpoint, "1": pubs[1].endpoint}
        assert worker["listeners"]["1"] == {"endpoint": pubs[1].endpoint, "status": "active"}
        assert client.get("/workers", params={"model_name": "none"}).json() == []
        health = client.get("/health")
        assert health.status_code == 200 and health.content == b""

        by_hash = client.post("/query_by_hash", json={"block_hashes": [1], "model_name": "llama"})
        if compiled_index(fleet.index) is not None:  # made without local hashes: it says how
            assert by_hash.status_code == 501 and "--local-hashes" in by_hash.json()["error"]
        else:  # the pure index hashes its stored tokens as it walks (tests/test_localhash.py)
            assert by_hash.status_code == 200 and by_hash.json()["scores"] == {}

        gone = client.post("/unregister", json={"instance_id": 7, "model_name": "llama"})
        assert (gone.status_code, gone.json()) == (200, {"status": "ok"})
        assert "7:0" not in fleet.specs and "7:1" not in fleet.specs
        twice = client.post("/unregister", json={"instance_id": 7, "model_name": "llama"})
        assert twice.status_code == 404 and twice.json() == {"error": "instance 7 not found"}
        assert client.post("/query", json=query).status_code == 404  # no worker of it left


def test_serve_refuses_a_bad_tokenizer_in_one_line(tmp_path: Path) -> None:
    for option, message in [
        ("nomodel", "must be MODEL=PATH or MODEL=vllm"),
        (f"m={tmp_path}", "no tokenizer.json there"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "kvindex", "serve", "--store", "memory", "--http",
             "127.0.0.1:0", "--tokenizer", option],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_engines_hit_rate_kv_usage_and_pool_on_metrics_and_the_dashboard() -> None:
    """Point 6: what each engine's own /metrics says (scraped over real HTTP) shows on
    kvindex's /metrics and the dashboard's snapshot; an engine that stops answering is 0
    on `kvindex_engine_metrics_up`."""
    busy, silent = FakeEngine(), FakeEngine()
    busy.metrics = vllm_metrics(waiting=3, running=5, kv=0.42, queries=1000, hits=250)
    silent.metrics_status = 500
    with ExitStack() as stack:
        pubs = [stack.enter_context(Publisher("tcp://127.0.0.1:*")) for _ in range(3)]
        urls = [stack.enter_context(serve_engine(e)) for e in (busy, silent)]
        fleet = Fleet(
            [
                InstanceSpec("busy", pubs[0].endpoint, http=urls[0]),
                InstanceSpec("silent", pubs[1].endpoint, metrics=urls[1] + "/metrics"),
                InstanceSpec("plain", pubs[2].endpoint),  # no metrics URL: not scraped
            ]
        )
        routing = Routing.of(fleet)
        routing.scraper.interval = 0.05
        url = stack.enter_context(serve_app(create_app(fleet, routing=routing)))
        client = stack.enter_context(httpx.Client(base_url=url))
        assert routing.scraper.wait_round()
        busy.metrics = vllm_metrics(waiting=3, running=5, kv=0.42, queries=1400, hits=550)
        assert routing.scraper.wait_round()  # 300 hits of 400 queries since the last one

        text = client.get("/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}

        def value(family: str, **labels: str) -> float | None:
            for sample in families[family].samples:
                if all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
            return None

        busy0 = {"engine": "busy", "rank": "0"}
        assert value("kvindex_engine_kv_cache_usage", **busy0) == 0.42
        assert value("kvindex_engine_pool_blocks", **busy0) == 2048
        assert value("kvindex_engine_prefix_cache_queries", **busy0) == 1400
        assert value("kvindex_engine_prefix_cache_hits", **busy0) == 550
        assert value("kvindex_engine_requests_waiting", **busy0) == 3
        assert value("kvindex_engine_metrics_up", engine="busy") == 1
        assert value("kvindex_engine_metrics_up", engine="silent") == 0
        assert (value("kvindex_engine_metrics_failures", engine="silent") or 0) >= 2
        assert value("kvindex_engine_metrics_up", engine="plain") is None

        def engines() -> dict[str, Any]:  # the dashboard samples once a second
            snapshot = client.get("/v1/dashboard/snapshot").json()["snapshot"]
            return {r["name"]: r["engine"] for r in snapshot["instances"]}

        assert until(lambda: (engines()["busy"] or {}).get("hit_rate") == 0.75)
        rows = {name: {"engine": e} for name, e in engines().items()}
        assert rows["busy"]["engine"] == {
            "kv_usage": 0.42,
            "hit_rate": 0.75,
            "pool_blocks": 2048,
            "waiting": 3,
            "running": 5,
        }
        assert rows["silent"]["engine"] is None and rows["plain"]["engine"] is None
