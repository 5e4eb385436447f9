"""An SGLang engine as `kvindex serve` shows it: one tier vocabulary for every face.

A real publisher on loopback sends what SGLang's recorder sends (tagged maps, signed int64
page hashes, `CPU_PINNED` for HiCache's host tier, `DISK`, `EXTERNAL`) beside a vLLM-style
instance (`GPU`, `CPU`); the API, the block listing's `?medium=` and the metrics must
speak tiers (`gpu`, `cpu`, `disk`, `external`) for both.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
from netutil import wait_until
from service_workload import TestClient
from test_service_metrics import scrape, value

from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.subscriber import InstanceSpec
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

LOOPBACK = "tcp://127.0.0.1:*"


def sglang_page(h: int, parent: int | None, token: int, medium: str) -> dict[str, object]:
    """One page-size-1 page as SGLang 0.5.23's recorder announces it."""
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": parent,
        "token_ids": [token],
        "block_size": 1,
        "lora_id": None,
        "medium": medium,
    }


@pytest.fixture
def two_engines() -> Iterator[tuple[TestClient, Publisher, Publisher]]:
    with (
        Publisher(LOOPBACK, LOOPBACK) as sgl,
        Publisher(LOOPBACK, LOOPBACK) as vllm,
    ):
        fleet = Fleet(
            [
                InstanceSpec("sgl", sgl.endpoint, sgl.replay_endpoint),
                InstanceSpec("vllm", vllm.endpoint, vllm.replay_endpoint),
            ]
        )
        with TestClient(create_app(fleet)) as client:
            yield client, sgl, vllm


def test_tiers_for_both_engines(two_engines: tuple[TestClient, Publisher, Publisher]) -> None:
    client, sgl, vllm = two_engines
    pages = [sglang_page(-1, None, 5, "GPU"), sglang_page(-2, -1, 6, "GPU")]
    pages += [sglang_page(-1, None, 5, "CPU_PINNED"), sglang_page(-2, -1, 6, "CPU_PINNED")]
    pages += [sglang_page(-1, None, 5, "DISK"), sglang_page(-3, None, 9, "EXTERNAL")]
    sgl.publish_payload(msgspec.msgpack.encode([1.0, pages, 0]))
    vllm.publish([BlockStored([1, 2], None, list(range(8)), 4, medium="GPU")])
    vllm.publish([BlockStored([b"\x01" * 32], None, [], 0, medium="CPU")])

    def instances() -> dict[str, dict[str, object]]:
        rows = client.get("/v1/instances").json()["instances"]
        return {row["name"]: row for row in rows}

    assert wait_until(
        lambda: instances()["sgl"]["blocks"] == 3 and instances()["vllm"]["blocks"] == 3
    )
    got = instances()
    assert got["sgl"]["blocks_by_medium"] == {"CPU_PINNED": 2, "DISK": 1, "EXTERNAL": 1, "GPU": 2}
    assert got["sgl"]["blocks_by_tier"] == {"gpu": 2, "cpu": 2, "disk": 1, "external": 1}
    assert got["vllm"]["blocks_by_tier"] == {"gpu": 2, "cpu": 1}
    stats = client.get("/v1/stats").json()
    assert stats["blocks_by_tier"] == {"gpu": 4, "cpu": 3, "disk": 1, "external": 1}

    # ?medium= takes the engine's own name or the tier's, in either case.
    def listed(name: str, medium: str) -> list[str]:
        r = client.get(f"/v1/instances/{name}/blocks", params={"medium": medium})
        assert r.status_code == 200, r.text
        hashes: list[str] = r.json()["block_hashes"]
        return hashes

    assert listed("sgl", "CPU_PINNED") == listed("sgl", "cpu") == ["-1", "-2"]
    assert listed("sgl", "CPU") == ["-1", "-2"]  # the tier, named as vLLM names it
    assert listed("sgl", "disk") == listed("sgl", "DISK") == ["-1"]
    assert listed("sgl", "external") == ["-3"]
    assert listed("vllm", "cpu") == listed("vllm", "CPU") == ["01" * 32]
    assert listed("vllm", "gpu") == ["1", "2"]

    s = scrape(client)
    assert value(s, "kvindex_engine_blocks", engine="sgl", medium="CPU_PINNED", tier="cpu") == 2
    assert value(s, "kvindex_engine_blocks", engine="sgl", medium="EXTERNAL", tier="external") == 1
    assert value(s, "kvindex_engine_blocks", engine="vllm", medium="CPU", tier="cpu") == 1


def test_lookup_answers_tiers_for_sglang_media(
    two_engines: tuple[TestClient, Publisher, Publisher],
) -> None:
    """GPU pages from the first, then the run HiCache's host tier holds from there, as
    SGLang would reuse them: `by_tier` speaks tiers, not SGLang's medium names."""
    client, sgl, _ = two_engines
    pages = [sglang_page(-1, None, 5, "GPU")]
    pages += [sglang_page(-1, None, 5, "CPU_PINNED"), sglang_page(-2, -1, 6, "CPU_PINNED")]
    sgl.publish_payload(msgspec.msgpack.encode([1.0, pages, 0]))

    def row() -> dict[str, object]:
        answer = client.post("/v1/lookup", json={"token_ids": [5, 6, 7]}).json()
        found: dict[str, object] = next(r for r in answer["instances"] if r["name"] == "sgl")
        return found

    assert wait_until(lambda: row()["matched_blocks"] == 2)
    assert row()["by_tier"] == {"gpu": 1, "cpu": 1}
