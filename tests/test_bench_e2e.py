"""The end-to-end bench cases in smoke mode: real publishers, `kvindex serve`, Dynamo's
standalone indexer (where `ai-dynamo-runtime` is installed) and clients, each in its own
process. Figures are not checked against targets (timing on a shared machine is not a
test); what is checked is that every case ran, measured something, and that what serve
and Dynamo ended up holding, and every lookup answer, is exactly what the workload left."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvindex.bench import e2e
from kvindex.bench.e2e import dynamo
from kvindex.bench.e2e.runs import best_run
from kvindex.bench.plan import PLANS

pytestmark = pytest.mark.timeout(300)

SMOKE = PLANS["smoke"].e2e
CASES = (
    "e2e_naive",
    "e2e_ingest_memory",
    "e2e_ingest_sqlite",
    "e2e_ingest_sqlite_python",
    "e2e_ingest_redis",
    "e2e_ingest_dynamo",
    "e2e_ingest_workers",
    "e2e_lookup",
    "e2e_freshness",
    "e2e_warm_restart",
    "e2e_routing",
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("bench-e2e")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVINDEX_BENCH_CACHE", str(workdir / "cache"))
        yield e2e.run_e2e(PLANS["smoke"], workdir)


def _peer(results: dict[str, Any]) -> None:
    if not results["e2e_peer"]["available"]:
        pytest.skip(results["e2e_peer"]["reason"])


def test_every_case_ran(results: dict[str, Any]) -> None:
    for case in CASES:
        assert case in results, case
        assert "error" not in results[case], (case, results[case])
    assert results["e2e_workload"]["block_events"] >= SMOKE.ingest_events


@pytest.mark.parametrize(
    "case",
    ["e2e_ingest_memory", "e2e_ingest_sqlite", "e2e_ingest_sqlite_python", "e2e_ingest_redis"],
)
def test_serve_ingested_the_whole_workload_exactly(results: dict[str, Any], case: str) -> None:
    r = results[case]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    # Every instance's last_seq reached its final seq, and the blocks serve lists per
    # instance are exactly those the simulated pools hold at the end.
    assert r["exact"] is True
    assert r["block_events"] == results["e2e_workload"]["block_events"]
    assert r["per_s"] > 0 and r["applied_per_s"] >= r["per_s"]
    assert r["lost_batches"] == 0 and r["decode_errors"] == 0
    assert r["serve_cpu_seconds_per_m_events"] > 0  # serve's CPU over the burst
    # serve's own counters over the burst: every batch applied, by the C path unless
    # KVINDEX_C_INGEST=0 (the SQLite baseline), and the GIL time those took.
    assert r["serve_batches"] == r["batches"]
    in_c = r["serve_batches"] if r["c_ingest"] else 0
    assert r["c_ingest"] == (case != "e2e_ingest_sqlite_python")
    assert r["serve_batches_in_c"] == in_c
    assert r["serve_gil_seconds"] > 0 and r["serve_gil_us_per_batch"] > 0
    if case != "e2e_ingest_memory":
        assert r["persist_lag_seconds"] >= 0


def test_one_and_two_ingest_workers_each_ingested_the_whole_workload_exactly(
    results: dict[str, Any],
) -> None:
    r = results["e2e_ingest_workers"]
    assert set(r["workers"]) == {"1", "2"}
    for n, run in r["workers"].items():
        assert run["ingest_workers"] == int(n)
        assert run["exact"] is True and run["exact_every_run"] is True, (n, run)
        assert run["lost_batches"] == 0 and run["per_s"] > 0
    assert r["speedup"] == r["workers"]["2"]["per_s"] / r["workers"]["1"]["per_s"]


def test_dynamo_applied_every_event_and_holds_the_truth(results: dict[str, Any]) -> None:
    _peer(results)
    r = results["e2e_ingest_dynamo"]
    # Its applied-events counter reached exactly the vLLM events published (warm-up and
    # measured part), none refused, and its /dump lists exactly the simulated pools.
    work = results["e2e_workload"]
    assert sum(r["events_applied"].values()) == work["wire_events"] + work["wire_events_warmup"]
    assert r["refused_events"] == 0
    assert r["exact"] is True and r["blocks_off"] == 0
    assert r["per_s"] > 0 and r["runs_per_s"] == [r["per_s"]]


def test_serve_is_given_as_a_ratio_to_dynamo(results: dict[str, Any]) -> None:
    _peer(results)
    theirs = results["e2e_ingest_dynamo"]["per_s"]
    for case, target in (("e2e_ingest_memory", 2.0), ("e2e_ingest_sqlite", 1.5)):
        r = results[case]
        assert r["vs_dynamo"] == pytest.approx(r["per_s"] / theirs)
        assert r["target_vs_dynamo"] == target and r["meets_target"] == (r["vs_dynamo"] >= target)


def test_naive_baseline_received_every_batch(results: dict[str, Any]) -> None:
    r = results["e2e_naive"]
    assert r["complete"] is True
    assert r["gaps"] == 0
    assert r["per_s"] > 0


@pytest.mark.parametrize("side", ["kvindex", "kvindex_python", "dynamo"])
def test_lookups_answered_exactly_idle_and_under_load(results: dict[str, Any], side: str) -> None:
    if side == "dynamo":
        _peer(results)
    case = results["e2e_lookup"]
    assert case["entries"] == SMOKE.lookup_instances * SMOKE.lookup_blocks
    r = case[side]
    # Every answer gave each instance's depth of its prompt, as the fill holds it.
    assert r["exact"] is True and r["wrong_answers"] == 0
    for phase in ("idle", "loaded"):
        assert r[phase]["count"] == SMOKE.lookups
        assert 0 < r[phase]["p50_ms"] <= r[phase]["p99_ms"] <= r[phase]["max_ms"]
    assert r["floor_idle"]["count"] == SMOKE.gets and r["floor_idle"]["p50_ms"] > 0
    if side != "dynamo":  # what serve says a lookup took inside, from its /metrics
        assert 0 < r["idle"]["in_service_mean_ms"] < r["idle"]["max_ms"]
        # the heap's growth by its allocators' statistics, the core's C within it
        assert 0 < r["core_bytes_per_entry"] <= r["heap_bytes_per_entry"] * 1.5
    assert r["load_achieved_per_s"] > 0
    assert r["bytes_per_entry"] is None or r["bytes_per_entry"] >= 0


def test_lookup_ratios_are_to_dynamo_in_the_same_run(results: dict[str, Any]) -> None:
    _peer(results)
    case = results["e2e_lookup"]
    ours, theirs = case["kvindex"], case["dynamo"]
    for phase in ("idle", "loaded", "floor_idle"):
        ratio = ours[phase]["p50_ms"] / theirs[phase]["p50_ms"]
        assert ours[phase]["p50_vs_dynamo"] == pytest.approx(ratio)
        python = case["kvindex_python"][phase]["p50_ms"]
        assert ours[phase]["p50_vs_python"] == pytest.approx(ours[phase]["p50_ms"] / python)
    assert isinstance(ours["meets_target"], bool)


def test_every_marker_became_visible(results: dict[str, Any]) -> None:
    r = results["e2e_freshness"]
    assert r["markers"] == int(SMOKE.fresh_seconds / SMOKE.marker_every)
    assert r["markers_seen"] == r["markers"]
    assert 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["resolution_ms"] > 0


def test_warm_restart_loaded_every_block(results: dict[str, Any]) -> None:
    r = results["e2e_warm_restart"]
    assert r["blocks"] == SMOKE.warm_blocks
    # blocks_listed_seconds is only reached once /v1/instances counts every block.
    assert 0 < r["healthz_seconds"] <= r["blocks_listed_seconds"]
    assert r["cold_healthz_seconds"] > 0
    # The same store with the snapshot read in Python, started alternately: best of N each.
    assert 0 < r["python_healthz_seconds"] <= r["python_blocks_listed_seconds"]
    runs = SMOKE.ingest_runs
    assert len(r["healthz_runs_seconds"]) == len(r["python_healthz_runs_seconds"]) == runs
    assert r["healthz_seconds"] == min(r["healthz_runs_seconds"])


def test_routing_requests_answered_exactly_beside_their_baselines(
    results: dict[str, Any],
) -> None:
    """Every kind of request (plain lookup, with a model, by prompt text, route) answered
    each prompt as the fill holds it; each cost read against its baseline of the same run;
    the word-level tokenizer gives back the fill's token ids exactly."""
    r = results["e2e_routing"]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    http = r["http"]
    for kind in ("lookup", "lookup_model", "prompt", "route"):
        assert http[kind]["count"] == SMOKE.lookups, kind
        assert http[kind]["wrong_answers"] == 0, kind
        assert 0 < http[kind]["p50_ms"] <= http[kind]["p99_ms"]
    for kind, base in (("prompt", "lookup_model"), ("route", "lookup_model")):
        ratio = http[kind]["p50_ms"] / http[base]["p50_ms"]
        assert http[kind]["p50_vs_baseline"] == pytest.approx(ratio)
    alone = r["tokenize"]
    assert alone["word_level"]["exact"] and alone["word_level"]["tokens_per_prompt"] == 512 * 16
    assert alone["bpe"]["us_per_token"] > 0


def test_table_rows_render_every_case(results: dict[str, Any]) -> None:
    rows = e2e.table_rows(results)
    assert len(rows) == 16
    assert "x 1 worker" in rows[3][1] and rows[3][2].startswith("1 worker ")
    assert rows[4][1].startswith("memory ") and "SQLite" in rows[4][1]  # serve's CPU
    assert "% of batches in C" in rows[5][1] and "every batch in Python" in rows[5][2]
    assert "KVINDEX_C_INGEST=0" in rows[1][2]  # SQLite's same-run Python-path baseline
    assert "Python" in rows[11][2]  # the warm restart beside the Python snapshot load
    for row in rows:
        assert len(row) == 4 and all(isinstance(cell, str) and cell for cell in row)
        assert not row[1].startswith(("failed", "not run")), row
        assert "NOT EXACT" not in row[1] and "WRONG" not in row[1], row
    if results["e2e_peer"]["available"]:
        assert "x Dynamo" in rows[0][1] and "Dynamo standalone" in rows[0][2]


def test_table_rows_survive_failed_and_skipped_cases() -> None:
    skipped = {"skipped": "ai-dynamo-runtime is not installed (pip install -e '.[bench]')"}
    results = {
        "e2e_ingest_memory": {"error": "BenchError: serve exited with 2"},
        "e2e_ingest_redis": {"skipped": "redis-server is not installed"},
        "e2e_ingest_dynamo": skipped,
        "e2e_lookup": {"kvindex": {"error": "BenchError: timed out"}, "dynamo": skipped},
    }
    rows = e2e.table_rows(results)
    assert len(rows) == 16
    assert [row[1] for row in rows[12:]] == ["not run"] * 4  # routing and the chat case
    assert rows[0][1].startswith("failed: BenchError")
    assert "Dynamo standalone skipped: ai-dynamo-runtime is not installed" in rows[0][2]
    assert rows[2][1] == "skipped: redis-server is not installed"
    assert rows[3][1] == "not run"  # the ingest-workers case
    assert rows[4][1] == "memory failed: BenchError: serve exited with 2; SQLite not run"
    assert rows[5][2] == "SQLite with every batch in Python not run"
    assert rows[6][1] == "failed: BenchError: timed out"
    assert rows[6][2].startswith("Dynamo standalone skipped")
    assert rows[10][1] == "not run"


def test_a_missing_dynamo_indexer_is_a_reason_not_a_failure(monkeypatch: Any) -> None:
    monkeypatch.setattr(dynamo.importlib.util, "find_spec", lambda name: None)
    assert dynamo.standalone_status() == {
        "available": False,
        "reason": "ai-dynamo-runtime is not installed (pip install -e '.[bench]')",
    }


def test_best_run_keeps_the_fastest_completed_run() -> None:
    runs = [
        {"per_s": 2.0, "exact": True},
        {"error": "BenchError: timed out"},
        {"per_s": 3.0, "exact": False},
    ]
    best = best_run(runs)
    assert best["per_s"] == 3.0 and best["runs_per_s"] == [2.0, None, 3.0]
    assert best["exact_every_run"] is False
    assert best_run([{"error": "x"}]) == {"error": "x"}
