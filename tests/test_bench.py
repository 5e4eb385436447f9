"""The benchmark compares like with like, and its entry point writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kvindex import bench
from kvindex.index import FleetIndex
from kvindex.subscriber import SourceKey
from kvindex.wire import BatchDecoder


def test_workload_is_steady_state_and_both_consumers_agree() -> None:
    payloads, events = bench.workload(400, live_blocks=300)
    index, naive = FleetIndex(), set()
    decoder = BatchDecoder()
    for payload in payloads:
        index.apply(SourceKey("x"), decoder.decode(payload))
        for event in msgspec.msgpack.decode(payload)[1]:
            if event["type"] == "BlockStored":
                naive.update(event["block_hashes"])
            else:
                naive.difference_update(event["block_hashes"])
    assert index.block_hashes("x") == naive
    assert len(naive) == 300  # stores and removes balance at the live size
    assert events > 400


def test_lookup_latency_reports_percentiles() -> None:
    lat = bench.lookup_latency(instances=4, per_instance=50, prompt_blocks=16)
    assert 0 < lat["p50_us"] <= lat["p99_us"]


def test_main_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = [
        "--quick",
        "--out",
        str(out),
        "--batches",
        "200",
        "--lookup",
        "4x50",
        "--warm-blocks",
        "500",
    ]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["ingest"]["block_events"] > 0 and data["ingest"]["kvindex_per_s"] > 0
    assert set(data["lookup"]) == {"4x50"}
    assert data["ingest"]["sqlite_per_s"] > 0
    redis = data["ingest"]["redis_per_s"]
    assert redis is None or redis > 0  # None only where redis-server is not installed
    assert data["warm_restart"]["blocks"] == 500 and data["warm_restart"]["load_seconds"] > 0
