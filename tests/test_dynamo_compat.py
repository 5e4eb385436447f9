"""kvindex's peer API beside NVIDIA Dynamo's own standalone indexer (`python -m
dynamo.indexer`, the `[bench]` extra): the same `/register` requests to both, the same ZMQ
publishers followed by both, then the same `/query`, `/query_by_hash` (Dynamo's own local
block hashes, from its binding), `/workers`, `/unregister` requests, and the answers
compared as parsed JSON. Skipped, with the reason, where Dynamo's indexer does
not install or run (docs/peers.md).

The streams are plain ones (no salts, multimodal keys or hybrid groups, where kvindex follows
the engine instead of Dynamo's model): DP ranks of one worker, two models, a second routing
group, a prefix continued on CPU, a branch, a removal in the middle of a chain, a clear.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpfixture import serve_app
from test_router_service import until

from kvindex.bench.e2e.dynamo import Peer, standalone, standalone_status
from kvindex.bench.e2e.probes import http_json
from kvindex.index import FleetIndex, ReferenceIndex
from kvindex.index.localhash import as_signed, local_hashes
from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(180)

BS = 16
A = list(range(5000, 5000 + 8 * BS))  # 8 blocks
B = A[: 4 * BS] + list(range(9000, 9000 + 3 * BS))  # A's first 4 blocks, then its own 3


def block_hash(tokens: list[int], end: int) -> int:
    """A stable engine hash for the block ending at token `end` (u63, like vLLM's)."""
    return hash(("blk", *tokens[:end])) & (2**63 - 1)


def store(tokens: list[int], first: int, last: int, medium: str | None = None) -> BlockStored:
    """BlockStored of blocks `first`..`last - 1` of `tokens`, chained to block `first - 1`."""
    hashes: list[int | bytes] = [block_hash(tokens, (i + 1) * BS) for i in range(first, last)]
    parent = block_hash(tokens, first * BS) if first else None
    return BlockStored(hashes, parent, tokens[first * BS : last * BS], BS, medium=medium)


def remove(tokens: list[int], block: int) -> BlockRemoved:
    return BlockRemoved([block_hash(tokens, (block + 1) * BS)])


Published = Mapping[tuple[int, int], Sequence[Sequence[Event]]]


def publish_and_wait(
    both: Both, pubs: dict[tuple[int, int], Publisher], batches: Published
) -> None:
    """Publish, then wait until both indexers have applied every batch."""
    before = sum(both.dynamo.applied().values())
    for key, events in batches.items():
        for batch in events:
            pubs[key].publish(batch)
    # Dynamo's applied-events counter counts one model's index only (measured: the qwen
    # worker's events never show in it), so qwen's are waited for by a query.
    qwen = batches.get((3, 0), [])
    counted = sum(len(b) for key, events in batches.items() if key != (3, 0) for b in events)
    both.dynamo.wait_applied(before + counted, 30)
    if qwen:
        query = {"token_ids": A, "model_name": "qwen"}
        assert until(lambda: b'"3"' in both.dynamo.status("POST", "/query", query)[1], 30)
    seqs = {f"{w}:{r}": pub.next_seq - 1 for (w, r), pub in pubs.items()}

    def caught_up() -> bool:
        rows = both.kvindex.get("/v1/instances").json()["instances"]
        return {r["name"]: r["last_seq"] for r in rows} == seqs

    assert until(caught_up, 30)
    assert both.dynamo.refused() == 0  # every event applied as Dynamo models it


def local_hash_index() -> Any:
    """The default index, keeping local block hashes (what `serve --local-hashes` runs)."""
    if FleetIndex is ReferenceIndex:
        return ReferenceIndex()
    from kvindex.index.compiled import CompiledIndex

    return CompiledIndex(local_hashes=True)


class Both:
    """The same request to Dynamo's indexer and to kvindex: (status, parsed JSON) of each."""

    def __init__(self, dynamo: Peer, kvindex: httpx.Client) -> None:
        self.dynamo = dynamo
        self.kvindex = kvindex

    def send(self, method: str, path: str, body: Any = None) -> tuple[Any, Any]:
        code, raw = self.dynamo.status(method, path, body)
        theirs = (code, json.loads(raw) if raw.strip() else None)
        reply = self.kvindex.request(method, path, json=body)
        ours = (reply.status_code, reply.json() if reply.content.strip() else None)
        return theirs, ours

    def same(self, method: str, path: str, body: Any = None) -> Any:
        theirs, ours = self.send(method, path, body)
        assert ours == theirs, f"{method} {path} {body!r}"
        return ours[1]


@pytest.fixture(scope="module")
def dynamo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    status = standalone_status()
    if not status["available"]:
        pytest.skip(f"Dynamo's standalone indexer can't run here: {status['reason']}")
    workdir: Path = tmp_path_factory.mktemp("dynamo")
    with standalone(workdir, [], "compat", timeout=60) as peer:
        yield peer


def test_same_publishers_same_requests_same_answers_as_dynamos_indexer(dynamo: Peer) -> None:
    with ExitStack() as stack:

        def publisher(rank: int = 0) -> Publisher:
            pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", dp_rank=rank)
            return stack.enter_context(pub)

        pubs = {
            (1, 0): publisher(),
            (1, 1): publisher(1),
            (2, 0): publisher(),
            (3, 0): publisher(),  # model qwen
            (4, 0): publisher(),  # routing group canary
            (5, 0): publisher(),  # cleared
        }
        fleet = Fleet(index=local_hash_index())  # /query_by_hash needs local hashes
        url = stack.enter_context(serve_app(create_app(fleet)))
        both = Both(dynamo, stack.enter_context(httpx.Client(base_url=url, timeout=10)))

        for (worker, rank), pub in pubs.items():
            body = {
                "instance_id": worker,
                "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint,
                "model_name": "qwen" if worker == 3 else "llama",
                "block_size": BS,
                "dp_rank": rank,
            }
            if worker == 4:
                body["routing_group"] = "canary"
            assert both.same("POST", "/register", body) == {"status": "ok"}
        dup = {"instance_id": 1, "endpoint": pubs[1, 0].endpoint, "model_name": "llama"}
        assert both.same("POST", "/register", {**dup, "block_size": BS}) == {
            "error": "instance 1 dp_rank 0 already registered"
        }

        def listening() -> bool:
            found = [
                ls for w in http_json(dynamo.url, "/workers") for ls in w["listeners"].values()
            ]
            return len(found) == len(pubs) and all(ls["status"] == "active" for ls in found)

        assert until(listening, 30)
        assert until(lambda: all(fleet.status(n).value == "live" for n in fleet.specs), 30)
        # An active Dynamo listener has connected, but its subscription may still be on its
        # way to the PUB socket: a publisher's only batch sent meanwhile would be lost to
        # Dynamo for good (nothing later tells it of the gap).
        time.sleep(1.0)

        # Two phases, so that both indexers see the same order across publishers: every
        # store first, then a block removed from the middle of worker 1 rank 0's chain.
        stores: Published = {
            (1, 0): [[store(A, 0, 4)], [store(B, 4, 7)]],
            (1, 1): [[store(A, 0, 8)]],
            (2, 0): [[store(A, 0, 2), store(A, 2, 6, medium="CPU")]],
            (3, 0): [[store(A, 0, 8)]],
            (4, 0): [[store(A, 0, 6)]],
            (5, 0): [[store(A, 0, 8)], [AllBlocksCleared()], [store(B, 0, 3)]],
        }
        publish_and_wait(both, pubs, stores)
        publish_and_wait(both, pubs, {(1, 0): [[remove(A, 2)]]})

        queries: list[dict[str, Any]] = [
            {"token_ids": A, "model_name": "llama"},
            {"token_ids": A[: 5 * BS + 7], "model_name": "llama"},  # a partial last block
            {"token_ids": A[: 3 * BS] + [1] * BS, "model_name": "llama"},
            {"token_ids": list(range(70000, 70000 + 4 * BS)), "model_name": "llama"},
            {"token_ids": [], "model_name": "llama"},
            {"token_ids": A, "model_name": "llama", "lora_name": "ad"},
            {"token_ids": A, "model_name": "llama", "cache_salt": "s"},
            {"token_ids": A, "model_name": "llama", "routing_group": "canary"},
            {"token_ids": A, "model_name": "qwen"},
            {"token_ids": A, "model_name": "mistral"},
            {"token_ids": A, "model_name": "llama", "routing_group": "nope"},
        ]
        answers = [both.same("POST", "/query", q) for q in queries]
        # not trivially equal: the first query meets every worker's own prefix
        assert answers[0]["scores"] == {
            "1": {"0": 2 * BS, "1": 8 * BS},
            "2": {"0": 2 * BS},
            "5": {"0": 3 * BS},
        }
        assert answers[0]["instances"]["2"] == {
            "longest_matched": 6 * BS, "gpu": 2 * BS, "dp": {"0": 2 * BS}, "cpu": 6 * BS,
            "disk": 6 * BS,
        }  # fmt: skip
        assert answers[2]["scores"] == {
            "1": {"0": 2 * BS, "1": 3 * BS},
            "2": {"0": 2 * BS},
            "5": {"0": 3 * BS},
        }

        # Where they differ: B's own blocks hang under a block that rank 0 removed, and
        # Dynamo 1.6.1 then credits rank 1 (which stored A, never B's blocks) with B's
        # branch too (7 blocks: its walk keeps a worker set without intersecting it once
        # its size equals the next node's). kvindex answers what each rank holds.
        # /query_by_hash: the same prompts as Dynamo's own local block hashes (its binding
        # computes them; kvindex's localhash must give the same), signed as on the wire.
        from dynamo._core import compute_block_hash_for_seq

        by_hash = [*queries[:5], *queries[7:]]
        for q in by_hash:
            hashes = compute_block_hash_for_seq(q["token_ids"], BS)
            assert hashes == local_hashes(q["token_ids"], BS)
            body = {k: v for k, v in q.items() if k != "token_ids"}
            body["block_hashes"] = [as_signed(h) for h in hashes]
            assert both.same("POST", "/query_by_hash", body) == both.same("POST", "/query", q)
        for seeded in [{"lora_name": "ad"}, {"cache_namespace": "s"}]:
            hashes = compute_block_hash_for_seq(A, BS, **seeded)
            salt = seeded.get("cache_namespace")
            assert hashes == local_hashes(A, BS, seeded.get("lora_name"), salt)
            body = {"block_hashes": [as_signed(h) for h in hashes], "model_name": "llama"}
            assert both.same("POST", "/query_by_hash", body)["scores"] == {}
        salted = {"block_hashes": [1], "model_name": "llama", "cache_salt": "s"}
        assert "cache_salt is not accepted" in both.same("POST", "/query_by_hash", salted)["error"]
        # which refusal comes first: the salt's, before the model is looked up
        both.same("POST", "/query_by_hash", {**salted, "model_name": "mistral"})
        missing = {"block_hashes": [1], "model_name": "mistral"}
        assert both.same("POST", "/query_by_hash", missing) == {
            "error": "no indexer for model=mistral routing_group=default"
        }

        theirs, ours = both.send("POST", "/query", {"token_ids": B, "model_name": "llama"})
        assert ours[1]["scores"]["1"] == {"0": 2 * BS, "1": 4 * BS}
        assert theirs[1]["scores"]["1"] == {"0": 2 * BS, "1": 7 * BS}
        assert ours[1]["scores"]["5"] == theirs[1]["scores"]["5"] == {"0": 3 * BS}

        def workers(answer: Any) -> Any:
            return sorted(answer, key=lambda w: (w["model_name"], w["instance_id"]))

        for params in ["", "?model_name=llama", "?model_name=llama&routing_group=canary"]:
            theirs, ours = both.send("GET", f"/workers{params}")
            assert ours[0] == theirs[0] == 200
            assert workers(ours[1]) == workers(theirs[1])

        one_rank = {"instance_id": 1, "model_name": "llama", "routing_group": "default"}
        assert both.same("POST", "/unregister", {**one_rank, "dp_rank": 1}) == {"status": "ok"}
        assert both.same("POST", "/unregister", {"instance_id": 5, "model_name": "llama"})
        assert both.same("POST", "/unregister", {"instance_id": 5, "model_name": "llama"}) == {
            "error": "instance 5 not found"
        }
        for q in queries[:4]:
            both.same("POST", "/query", q)
        theirs, ours = both.send("GET", "/workers")
        assert workers(ours[1]) == workers(theirs[1])
        assert both.same("GET", "/health") is None
