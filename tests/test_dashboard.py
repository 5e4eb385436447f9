"""The dashboard's server side: prefix-sharing analysis, its routes, and `kvindex demo`
as a subprocess (the stream's numbers equal the API's once the load pauses; a recent
prompt is found on the instance that ran it; Ctrl+C ends it cleanly with a stream open).
The page itself is driven by a real browser in tests/browser/."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from clitools import Proc, kvindex
from netutil import wait_until
from service_workload import TestClient

from kvindex.index import FleetIndex
from kvindex.index.sharing import sharing
from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.subscriber import SourceKey
from kvindex.wire import BlockStored, EventBatch

pytestmark = pytest.mark.timeout(60)

BS = 4


def store(
    index: FleetIndex, source: SourceKey, hashes: list[int], tokens: list[int], **kw: Any
) -> None:
    index.apply(source, EventBatch(0.0, [BlockStored(list(hashes), None, tokens, BS, **kw)]))


# -- prefix sharing ---------------------------------------------------------------------------


def test_sharing_counts_blocks_by_content_and_ranks_prefixes() -> None:
    index = FleetIndex()
    prompt = list(range(16))  # 4 blocks
    # a and b hold the whole prompt under different hashes (different seeds); c the first 2
    # blocks on DP rank 1; d the same tokens under a LoRA adapter (another namespace).
    store(index, SourceKey("a"), [1, 2, 3, 4], prompt)
    store(index, SourceKey("b"), [11, 12, 13, 14], prompt)
    store(index, SourceKey("c", 1), [21, 22], prompt[:8])
    store(index, SourceKey("d"), [31, 32, 33, 34], prompt, lora_name="x")
    store(index, SourceKey("d"), [35], [9, 9, 9, 9])
    result = sharing(index)
    assert result.instances == ["a", "b", "c", "d"]
    assert result.overlap == [[4, 4, 2, 0], [4, 4, 2, 0], [2, 2, 2, 0], [0, 0, 0, 5]]
    assert result.complete and result.nodes == 4 + 4 + 1  # 2 namespaces' nodes + d's own
    assert (result.shared, result.everywhere) == (4, 0)
    top = [(p.blocks, p.instances, p.score) for p in result.prefixes]
    assert top == [(4, ("a", "b"), 8), (2, ("a", "b", "c"), 6)]
    assert result.prefixes[0].token_ids == prompt
    assert result.prefixes[1].token_ids == prompt[:8]


def test_sharing_walk_is_bounded() -> None:
    index = FleetIndex()
    for i in range(50):
        store(index, SourceKey("a"), [i], [i, i, i, i])
    partial = sharing(index, max_nodes=10)
    assert partial.nodes == 10 and not partial.complete


# -- routes, in process ----------------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Fleet())) as c:
        yield c


def test_page_and_assets(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ("dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css"):
        assert f"/dashboard/{asset}" in page.text
        answer = client.get(f"/dashboard/{asset}")
        assert answer.status_code == 200 and len(answer.content) > 1000, asset
    assert client.get("/dashboard/../app.py").status_code == 404
    assert client.get("/dashboard/nothing.js").json() == {"error": "no such file"}


def test_snapshot_and_prompts_without_a_source(client: TestClient) -> None:
    snap = client.get("/v1/dashboard/snapshot").json()
    assert snap["snapshot"]["fleet"]["instances"] == 0
    assert snap["snapshot"]["instances"] == [] and snap["history"]
    assert snap["sharing"]["overlap"] == []
    assert client.get("/v1/dashboard/prompts").json() == {"prompts": []}


# -- kvindex demo ------------------------------------------------------------------------------


def start_demo(*extra: str) -> tuple[Proc, str]:
    # engines named, not found through the demo's dnsmasq: the snapshot's first event must
    # hold them all (test_discovery_dns runs the demo's discovery)
    demo = kvindex(
        "demo", "--instances", "3", "--http", "127.0.0.1:0", "--seed", "3", "--no-discover", *extra
    )
    line = demo.wait_for(demo.out, lambda s: "dashboard at http" in s, timeout=20)
    return demo, line.split("dashboard at ")[1].split()[0]


def sse_events(
    url: str, count: int, headers: dict[str, str] | None = None
) -> Iterator[tuple[str, dict[str, Any]]]:
    with httpx.stream("GET", url + "v1/dashboard/stream", headers=headers, timeout=10) as stream:
        name = "message"
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                yield name, json.loads(line[6:])
                name = "message"
                count -= 1
                if not count:
                    return


def test_demo_stream_agrees_with_the_api_and_ctrl_c_stops_it() -> None:
    demo, url = start_demo("--rate", "60", "--gpu-blocks", "256", "--pause-after", "4")
    try:
        events = list(sse_events(url, 3))
        assert [name for name, _ in events] == ["init", "message", "message"]
        init = events[0][1]
        assert set(init) >= {"snapshot", "history", "trends", "sharing", "interval"}
        names = [r["name"] for r in init["snapshot"]["instances"]]
        assert names == ["sglang-0", "vllm-0", "vllm-1", "vllm-2"]  # SGLang found by URL
        assert events[2][1]["point"]["t"] > events[1][1]["point"]["t"]
        # a page that reconnects gets only the history it missed
        seen = events[1][1]["point"]["t"]
        ((name, resumed),) = sse_events(url, 1, {"Last-Event-ID": repr(seen)})
        assert name == "init" and resumed["resumed"] and not init["resumed"]
        assert resumed["history"] and all(p["t"] > seen for p in resumed["history"])
        assert len(resumed["history"]) <= 3  # not the whole history again
        demo.wait_for(demo.out, lambda s: "load paused" in s, timeout=10)
        check_snapshot_equals_api(url)
        check_recent_prompt_lookup(url)
        with httpx.stream("GET", url + "v1/dashboard/stream", timeout=10) as open_stream:
            next(open_stream.iter_lines())
            demo.interrupt(signal.SIGINT)  # with a stream open: it must not hold the exit
            assert demo.finish(timeout=8) == 0
        assert any("stopped" in line for line in demo.out)
    finally:
        demo.kill()


def snapshot_disagreements(url: str) -> list[str]:
    """Where the dashboard's latest snapshot differs from /v1/instances (empty: nowhere)."""
    api = {i["name"]: i for i in httpx.get(url + "v1/instances").json()["instances"]}
    snapshot = httpx.get(url + "v1/dashboard/snapshot").json()["snapshot"]
    wrong = [
        f"{row['name']}.{key}: {row[key]} != {api[row['name']][key]}"
        for row in snapshot["instances"]
        for key in (
            "blocks",
            "blocks_by_medium",
            "blocks_by_tier",
            "last_seq",
            "gaps",
            "lost_batches",
        )
        if row[key] != api[row["name"]][key]
    ]
    if snapshot["fleet"]["blocks"] != sum(i["blocks"] for i in api.values()):
        wrong.append("fleet blocks")
    if snapshot["fleet"]["events_per_s"] != 0:
        wrong.append("still moving")
    return wrong


def check_snapshot_equals_api(url: str) -> None:
    # Paused, the fleet comes to rest (a batch dropped last is still fetched by replay);
    # from then on the snapshot must equal the API exactly.
    assert wait_until(lambda: not snapshot_disagreements(url), timeout=10, step=0.25), (
        snapshot_disagreements(url)
    )


def check_recent_prompt_lookup(url: str) -> None:
    prompts = httpx.get(url + "v1/dashboard/prompts").json()["prompts"]
    assert prompts and all(p["token_ids"] for p in prompts)
    found = 0
    for prompt in prompts:
        body = {"token_ids": prompt["token_ids"], "lora_name": prompt["lora_name"]}
        if prompt.get("cache_salt"):  # SGLang's salted requests match only under their salt
            body["cache_salt"] = prompt["cache_salt"]
        answer = httpx.post(url + "v1/lookup", json=body).json()
        rows = {r["name"]: r for r in answer["instances"]}
        found += rows[prompt["instance"]]["matched_blocks"] > 0
    assert found >= len(prompts) // 2  # the rest may have been evicted since


def test_snapshot_marks_an_engine_without_events_approximate() -> None:
    """An events=none engine's row: `approximate`, and the blocks /v1/route sent there."""
    from kvindex.service.lookups import Routing
    from kvindex.subscriber import InstanceSpec

    fleet = Fleet([InstanceSpec.parse("n0=events=none,gpu_blocks=64,block_size=4")])
    with TestClient(create_app(fleet, routing=Routing.of(fleet))) as c:
        assert c.post("/v1/route", json={"token_ids": list(range(12))}).json()["best"] == "n0"

        def row() -> dict[str, Any]:  # a snapshot a second
            [found] = c.get("/v1/dashboard/snapshot").json()["snapshot"]["instances"]
            return dict(found)

        assert wait_until(lambda: row()["approximate_blocks"] == 3, timeout=5)
        last = row()
        assert (last["name"], last["status"], last["approximate"]) == ("n0", "live", True)
        assert last["blocks"] == 0  # the index holds nothing of it: it published nothing
