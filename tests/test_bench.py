"""The benchmark suite compares like with like, and its pipeline writes what it promises.

No timing is asserted (the machine is shared); what is: the workloads are what they claim
(steady state, partial hits), every consumer ends where the truth is, the consumers agree
on every lookup, and a smoke run writes a JSON with every case, valid PNGs and the table.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import io
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kvindex import bench
from kvindex.bench import report, suite, workloads
from kvindex.bench.cases import run_probe
from kvindex.bench.consumers import Kvindex, Naive
from kvindex.bench.plan import PLANS, Plan, plan_from
from kvindex.bench.workloads import FillSpec, IngestSpec, fill, ingest_workload, prompts
from kvindex.cli import build_parser

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    # Tests must neither read a developer's cached workloads nor leave files behind.
    monkeypatch.setenv("KVINDEX_BENCH_CACHE", str(tmp_path_factory.mktemp("bench-cache")))


def _small_workload() -> workloads.IngestWorkload:
    return ingest_workload(IngestSpec(4, events=4_000, gpu_blocks=64), use_cache=False)


def test_ingest_workload_is_steady_state_and_consumers_reach_the_truth() -> None:
    w = _small_workload()
    assert w.events >= 4_000 and len(w.warmup) > 0
    # Every pool is full before the measured part: each stored block evicts one.
    assert abs(w.stores - w.removes) <= 0.1 * w.events
    ours, naive = Kvindex(4), Naive(4)
    for consumer in (ours, naive):
        consumer.feed(w.warmup)
        consumer.feed(w.measured)
    assert ours.held() == w.truth  # exact, block for block, on every instance
    for held, truth in zip(naive.held(), w.truth, strict=True):
        # The naive consumer forgets a block vLLM holds twice at its first eviction, and
        # never invents one: otherwise the two agree.
        assert held <= truth and len(truth - held) <= 0.01 * len(truth)
    assert sum(map(len, w.truth)) > 4 * 32  # the pools hold something worth comparing


def test_slices_cut_the_measured_stream_into_equal_parts() -> None:
    w = _small_workload()
    slices = w.slices(3)
    assert [b for part, _ in slices for b in part] == w.measured
    assert sum(events for _, events in slices) == w.events
    assert len(slices) == 3 and min(e for _, e in slices) > w.events / 6


def test_generated_workloads_are_cached_by_their_parameters(monkeypatch: Any) -> None:
    monkeypatch.setattr(workloads, "_CACHE_MIN_SECONDS", 0.0)
    spec = IngestSpec(2, events=500, gpu_blocks=32)
    first = ingest_workload(spec)
    again = ingest_workload(spec)
    assert not first.cached and again.cached
    assert again.measured == first.measured and again.truth == first.truth
    assert not ingest_workload(IngestSpec(2, events=500, gpu_blocks=32, seed=1)).cached


def test_fill_has_the_entries_it_claims_and_prompts_partly_hit() -> None:
    spec = FillSpec(6, 800)
    ours, naive = Kvindex(6), Naive(6)
    ours.build(fill(spec))
    naive.build(fill(spec))
    assert ours.index.entries() == spec.entries == sum(map(len, naive.held()))
    assert spec.entries / ours.index.tree_nodes() > 1.0  # shared prefixes share nodes
    partial = 0
    for p in prompts(spec, 10):
        assert len(p.tokens) == 512 * 16 and len(p.hashes) == 512
        depths = ours.depths(ours.query(p.tokens.tolist(), p.hashes))
        assert depths == naive.depths(naive.query(p.tokens.tolist(), p.hashes))
        partial += any(0 < d < 512 for d in depths) and len(set(depths)) > 1
    assert partial >= 8  # hits of differing lengths across instances, not misses


def test_probe_reports_memory_and_lookups_of_one_consumer() -> None:
    # In a fresh process, as the suite runs it: in this one, freed memory would be reused.
    out = run_probe("kvindex", FillSpec(3, 300), prompts=6, rounds=2)
    assert out["entries"] == 900 and out["tree_nodes"] > 0
    assert out["rss_delta_bytes"] > 0 and out["bytes_per_entry"] > 0
    lookup = out["lookup"]
    assert lookup["rounds"] == 2 and 0 < lookup["p50_us"] <= max(lookup["round_p99_us"])
    assert lookup["mean_best_match_blocks"] > 0


def test_a_missing_dynamo_is_a_reason_not_a_failure(monkeypatch: Any) -> None:
    from kvindex.bench import consumers

    def missing() -> Any:
        raise ModuleNotFoundError("No module named 'dynamo'")

    monkeypatch.setattr(consumers, "dynamo_api", missing)
    status = consumers.dynamo_status()
    assert status == {
        "available": False,
        "reason": "ai-dynamo-runtime is not installed (pip install -e '.[bench]')",
    }


def test_missing_e2e_module_is_skipped_with_a_notice(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "kvindex.bench.e2e", None)
    assert suite._e2e(PLANS["smoke"], tmp_path) == {"skipped": "kvindex.bench.e2e is not there"}


def _fake_e2e() -> types.ModuleType:
    """A stand-in for `kvindex.bench.e2e` (written elsewhere), with its interface."""
    module = types.ModuleType("kvindex.bench.e2e")
    module.__spec__ = importlib.machinery.ModuleSpec("kvindex.bench.e2e", None)
    calls: list[dict[str, Any]] = []

    def run_e2e(plan: Plan, workdir: Path, dynamo: bool) -> dict[str, Any]:
        calls.append({"plan": plan, "workdir": workdir, "dynamo": dynamo})
        return {"ingest_zmq": {"per_s": 123_456.0}}

    def table_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
        per_s = results["ingest_zmq"]["per_s"]
        return [("fake e2e ingest through ZMQ", f"{per_s:.0f}/s", "-", ">= 0.8 M/s")]

    module.run_e2e = run_e2e  # type: ignore[attr-defined]
    module.table_rows = table_rows  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    return module


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, types.ModuleType]:
    """One `--smoke` run of the whole suite (with a stand-in e2e module): its results
    path and what it printed."""
    out = tmp_path_factory.mktemp("bench") / "results.json"
    fake = _fake_e2e()
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "kvindex.bench.e2e", fake)
    mp.setenv("KVINDEX_BENCH_CACHE", str(out.parent / "cache"))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            assert bench.main(["--smoke", "--out", str(out)]) == 0
    finally:
        mp.undo()
    return out, printed.getvalue(), fake


def test_smoke_run_has_every_case_with_real_figures(smoke_run: Any) -> None:
    out, _, fake = smoke_run
    data = json.loads(out.read_text())
    plan = PLANS["smoke"]
    assert data["mode"] == "smoke" and data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert data["method"] == report.METHOD
    cases = data["ingest"]["cases"]
    assert [c["instances"] for c in cases] == list(plan.ingest_instances)
    for case in cases:
        for name in ("kvindex", "naive"):
            assert case[name]["per_s"] > 0 and len(case[name]["slices_per_s"]) == plan.slices
        assert case["kvindex"]["mismatched_blocks"] == 0  # exact against the simulator
        assert case["target"] == {"ratio_vs_naive": 3.0}
        assert case["meets_target"] == (case["ratio_vs_naive"] >= 3.0)
        assert abs(case["stores"] - case["removes"]) <= 0.1 * case["block_events"]
        assert "dynamo" not in case  # its binding measures itself, not Dynamo: see e2e
    for kind in ("sqlite", "redis"):
        store = data["stores"][kind]
        assert store.get("per_s", 0) > 0 or "skipped" in store, store
        assert store["target"]["per_s"] > 0
    shapes = data["page_shapes"]["cases"]  # SGLang page 1 and 16 beside vLLM page 16
    assert [(c["engine"], c["page_size"]) for c in shapes] == [
        ("vLLM", 16),
        ("SGLang", 16),
        ("SGLang", 1),
    ]
    for case in shapes:
        assert case["mismatched_blocks"] == 0 and case["per_s"] > 0
        assert case["tokens_per_s"] == case["per_s"] * case["page_size"]
        assert case["bytes_per_token"] > 0
        assert case["gpu_tokens_per_instance"] == shapes[0]["gpu_tokens_per_instance"]
    drain = data["drain"]  # queued first, then timed: C path and Python path, 1 and 2 workers
    assert drain["workers"][:2] == [1, 2]
    for name, run in drain["runs"].items():
        assert run["mismatched_blocks"] == 0 and run["lost_batches"] == 0, name
        assert run["batches"] == drain["batches"] and run["per_s"] > 0
        assert run["batches_in_c"] == (run["batches"] if name.startswith("c-") else 0)
    if "c-1" in drain["runs"]:
        assert (
            drain["runs"]["c-1"]["gil_us_per_batch"] < drain["runs"]["python-1"]["gil_us_per_batch"]
        )
        assert "c-2-sharded" in drain["runs"]  # the index split by instance, exact (above)
        assert drain["c_sharded_two_vs_one"] > 0
        assert "c-4-in-2-shards" in drain["runs"]  # two workers a shard, exact (above)
        assert drain["c_two_workers_a_shard_vs_one"] > 0
        shards = data["shards"]  # lookups over 2 and 4 shards beside one index, checked
        assert sorted(shards["runs"], key=int) == ["1", "2", "4"]
        assert all(run["exact"] and run["p50_us"] > 0 for run in shards["runs"].values())
    warm = data["warm_restart"]
    assert warm["loaded_blocks"] == warm["blocks"] > 0 and warm["load_seconds"] > 0
    assert warm["loaded_blocks_python"] == warm["blocks"] and warm["python_load_seconds"] > 0
    assert warm["healthz_seconds"] > 0 and warm["python_healthz_seconds"] > 0  # serve's start
    lookup = data["lookup"]
    sizes = [(c["instances"], c["per_instance"]) for c in lookup["instances"]]
    assert sizes == list(plan.lookup_instances)
    assert [(c["instances"], c["per_instance"]) for c in lookup["entries"]] == list(
        plan.lookup_entries
    )
    for case in lookup["instances"] + lookup["entries"]:
        assert case["matches_agree"], case["compared"]  # every consumer matched the same
        assert case["kvindex"]["lookup"]["p99_us"] > 0 and case["naive"]["lookup"]["p50_us"] > 0
        assert case["kvindex"]["bytes_per_entry"] > 0 and case["kvindex"]["entries_per_node"] >= 1
        assert case["naive"]["bytes_per_entry"] > 0
        assert case["target"]["p50_us"] == 30 and case["target"]["p99_us"] == 100
        assert case["memory_target"]["vs_dynamo"] == 1.0
        if "bytes_per_entry" in case["dynamo"]:
            ratio = case["kvindex"]["bytes_per_entry"] / case["dynamo"]["bytes_per_entry"]
            assert case["memory_vs_dynamo"] == pytest.approx(ratio)
        assert case["memory_meets_target"] is None  # judged from 1.28M entries only
    assert data["e2e"] == {"ingest_zmq": {"per_s": 123_456.0}}
    assert fake.calls and fake.calls[0]["plan"] == plan


def test_smoke_run_writes_valid_plots(smoke_run: Any) -> None:
    out, _, _ = smoke_run
    data = json.loads(out.read_text())
    assert data["plots"] == ["ingest_scaling.png", "lookup_scaling.png", "memory.png"]
    for name in data["plots"]:
        png = (out.parent / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert width > 400 and height > 300


def test_smoke_run_prints_the_table_with_the_e2e_rows(smoke_run: Any) -> None:
    out, printed, _ = smoke_run
    assert "kvindex bench (smoke mode" in printed
    for text in (
        "ingest in process",
        "SQLite store",
        "by page shape: SGLang page 1",
        "warm restart",
        "lookup of a 512-block",
    ):
        assert text in printed
    assert "memory per (instance, block) entry" in printed
    assert "fake e2e ingest through ZMQ" in printed and "123456/s" in printed
    assert f"written: {out}" in printed


def test_readme_section_is_rewritten_between_its_markers(
    smoke_run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    out, _, fake = smoke_run
    monkeypatch.setitem(sys.modules, "kvindex.bench.e2e", fake)
    readme = tmp_path / "README.md"
    before, after = "# x\n\n## Tests and benchmarks\n\nintro\n", "\n\n## Layout\n\nrest\n"
    readme.write_text(before + f"{report.START}\nold table\n{report.END}" + after)
    assert report.main(["--readme", str(readme), "--results", str(out)]) == 0
    text = readme.read_text()
    assert text.startswith(before) and text.endswith(report.END + after)
    assert "old table" not in text
    assert "| case | kvindex | baseline | target |" in text
    assert "Intel" in text or json.loads(out.read_text())["machine"]["cpu"] in text
    assert json.loads(out.read_text())["date"][:10] in text
    assert "| fake e2e ingest through ZMQ | 123456/s | - | >= 0.8 M/s |" in text
    plots_dir = Path(os.path.relpath(out.parent, tmp_path)).as_posix()
    assert f"({plots_dir}/ingest_scaling.png)" in text
    # Rewriting again replaces the section rather than adding to it.
    report.main(["--readme", str(readme), "--results", str(out)])
    assert readme.read_text() == text


def run_apart(
    smoke_run: Any, tmp_path: Path, monkeypatch: Any, case: str
) -> tuple[dict[str, Any], dict[str, Any], str, Path]:
    """`--only CASE` into a copy of the smoke run's results: the results before and after,
    what it printed, and the copy's path."""
    out = smoke_run[0]
    mine = tmp_path / "results.json"
    mine.write_text(out.read_text())
    monkeypatch.setenv("KVINDEX_BENCH_CACHE", str(tmp_path / "cache"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert bench.main(["--smoke", "--only", case, "--out", str(mine)]) == 0
    after = json.loads(mine.read_text())
    assert after.pop("runs_apart")[case]["mode"] == "smoke"
    return json.loads(out.read_text()), after, printed.getvalue(), mine


def test_one_case_runs_apart_into_the_last_results(
    smoke_run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """`--only routing` runs that case alone and puts it into the results file beside the
    last run's figures, which stay; the README says it ran apart, when and how."""
    before, after, printed, mine = run_apart(smoke_run, tmp_path, monkeypatch, "routing")
    routing = after["e2e"].pop("e2e_routing")
    assert "error" not in routing and "error" not in routing.get("http", {}), routing
    assert after == before  # the rest as the last run left it
    assert "e2e POST /v1/route" in printed
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.START}\n{report.END}\n")
    monkeypatch.setitem(sys.modules, "kvindex.bench.e2e", smoke_run[2])
    assert report.main(["--readme", str(readme), "--results", str(mine)]) == 0
    assert "The routing rows were run apart on " in readme.read_text()
    assert "`python -m kvindex.bench --only routing`" in readme.read_text()


def test_chat_lookup_runs_apart_exact_with_the_prefix_cache(
    smoke_run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """`--only chat_lookup` (issue 25): a chat's lookups by messages, by token ids with the
    model and by token ids, every answer exact, the history served by the prefix cache."""
    before, after, printed, _ = run_apart(smoke_run, tmp_path, monkeypatch, "chat_lookup")
    case = after["e2e"].pop("e2e_chat_lookup")
    assert "error" not in case, case
    for kind in ("messages", "token_ids_model", "token_ids"):
        assert case[kind]["wrong_answers"] == 0 and case[kind]["count"] > 0
    cache = case["tokenizer_cache"]
    assert cache["misses_total"] == case["chats"]  # each chat's first turn, then hits
    assert cache["hits_total"] == case["chats"] * (case["turns"] - 1)
    assert cache["bytes"] <= cache["max_bytes"]
    assert "e2e POST /v1/lookup by chat messages" in printed
    after["e2e"].pop("e2e_chat_lookup", None)
    before["e2e"].pop("e2e_chat_lookup", None)
    assert after == before


def test_ingest_workers_run_apart_into_the_last_results(
    smoke_run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """`--only ingest_workers` runs serve with 1 and with 2 ingest workers on the same
    stream and puts that case alone into the last results."""
    before, after, printed, _ = run_apart(smoke_run, tmp_path, monkeypatch, "ingest_workers")
    case = after["e2e"].pop("e2e_ingest_workers")
    assert after == before
    for n in ("1", "2"):
        assert case["workers"][n]["exact"] is True, case
        assert case["workers"][n]["ingest_workers"] == int(n)
    assert case["speedup"] > 0
    assert "2 workers vs 1" in printed


def test_page_shapes_run_apart_into_the_last_results(
    smoke_run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """`--only page_shapes` measures the three page shapes again (vLLM page 16 beside
    SGLang's page 16 and page 1) and replaces that section only."""
    before, after, _, _ = run_apart(smoke_run, tmp_path, monkeypatch, "page_shapes")
    shapes = after.pop("page_shapes")
    before.pop("page_shapes")
    assert "error" not in shapes, shapes
    assert after == before  # the rest as the last run left it
    shapes_run = [(c["format"], c["page_size"]) for c in shapes["cases"]]
    assert shapes_run == [("0.33", 16), ("sglang", 16), ("sglang", 1)]
    assert all(c["mismatched_blocks"] == 0 and c["per_s"] > 0 for c in shapes["cases"])


def test_drain_runs_apart_into_the_last_results(
    smoke_run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """`--only drain` measures the drain again (failed before: the option did not take
    it) and replaces that section only."""
    before, after, printed, _ = run_apart(smoke_run, tmp_path, monkeypatch, "drain")
    drain = after.pop("drain")
    before.pop("drain")
    assert "error" not in drain, drain
    assert after == before
    assert all(run["mismatched_blocks"] == 0 for run in drain["runs"].values())
    assert "GIL held per ordinary batch" in printed


def test_a_case_run_apart_on_another_kind_of_machine_says_which() -> None:
    """The README named every case run apart "same machine", also those run after the
    workplace moved to another kind of processor (failed before)."""
    amd = {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 23.5}
    intel = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "memory_gib": 23.5}
    results = {
        "machine": amd,
        "runs_apart": {
            "drain": {"date": "2026-12-05T08:31", "mode": "full", "machine": intel},
            "lookup": {"date": "2026-12-05T07:53", "mode": "full", "machine": dict(amd)},
        },
    }
    drain, lookup = report._apart_lines(results)
    assert "on Intel(R) Xeon(R) Processor (2 cores)" in drain and "same machine" not in drain
    assert "same machine" in lookup


def test_readme_without_markers_is_refused(smoke_run: Any, tmp_path: Path) -> None:
    out, _, _ = smoke_run
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert report.main(["--readme", str(readme), "--results", str(out)]) == 2
    assert readme.read_text() == "# no markers\n"


def test_kvindex_bench_command_takes_the_suites_options() -> None:
    args = build_parser().parse_args(["bench", "--quick", "--out", "x/r.json", "--no-dynamo"])
    assert args.quick and not args.smoke and args.out == "x/r.json" and args.no_dynamo
    plan = plan_from(args)
    assert plan == PLANS["quick"]
    args = build_parser().parse_args(["bench", "--smoke", "--entries", "1M,5M", "--repeats", "4"])
    plan = plan_from(args)
    assert plan.lookup_entries == ((64, 15_625), (64, 78_125)) and plan.slices == 4


def test_issue_23_targets_are_tabulated_with_ratio_and_verdict(
    smoke_run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """Each of issue 23's targets is a row with kvindex's figure, the baseline of the same
    run, their ratio and whether the target is met; the README gets them as a table."""
    data = json.loads(smoke_run[0].read_text())
    found = {row[0]: row for row in report.target_rows(data)}
    runs = data["drain"]["runs"]
    if "c-2-sharded" in runs:  # serve's default: a shard per worker
        drain = found[
            f"{report.DRAIN_TARGET}: serve's default, the index in 2 shards (a worker each)"
        ]
        assert drain[3] == f"{runs['c-2-sharded']['per_s'] / runs['c-1']['per_s']:.2f}x"
        assert drain[4] == ">= 1.8x" and drain[5] in ("met", "NOT met") and "exact" in drain[1]
    one = found["the same, one index (--index-shards 1): both workers write one index"]
    assert one[3] == f"{runs['c-2']['per_s'] / runs['c-1']['per_s']:.2f}x" and "exact" in one[1]
    gil = found["GIL held per ordinary batch on the ingest path (drain, 1 worker)"]
    assert gil[5] == ("met" if runs["c-1"]["gil_us_per_batch"] <= 1 else "NOT met")
    if "c-1-sqlite" in runs:
        assert (
            "met"
            in found["GIL held per ordinary batch, a SQLite store recording (drain, 1 worker)"][5]
        )
    warm = [row for name, row in found.items() if name.startswith("warm restart")]
    assert warm and warm[0][5].startswith("n/a")  # the smoke store is not 1M blocks

    e2e = {
        "e2e_ingest_memory": {"per_s": 2.1e6, "vs_dynamo": 2.1, "exact": True},
        "e2e_ingest_sqlite": {"per_s": 1.4e6, "vs_dynamo": 1.4, "exact": True},
        "e2e_ingest_dynamo": {"per_s": 1.0e6, "exact": True, "cpu_seconds_per_m_events": 0.8},
        "e2e_lookup": {
            "instances": 64,
            "per_instance": 20_000,
            "kvindex": {
                "exact": True,
                "idle": {"p50_ms": 0.2, "p99_ms": 1.0},
                "loaded": {"p50_ms": 0.3, "p99_ms": 4.0},
                "bytes_per_entry": 120.0,
                "heap_bytes_per_entry": 80.0,
            },
            "dynamo": {
                "exact": True,
                "idle": {"p50_ms": 0.5, "p99_ms": 2.0},
                "loaded": {"p50_ms": 1.0, "p99_ms": 4.0},
                "bytes_per_entry": 100.0,
            },
        },
        "e2e_warm_restart": {
            "blocks": 1_000_000,
            "healthz_seconds": 0.9,
            "python_healthz_seconds": 1.3,
            "cold_healthz_seconds": 0.5,
        },
    }
    rows = {row[0]: row[3:] for row in report.target_rows({"e2e": e2e})}
    assert rows["e2e ingest, 4 publishers -> serve, memory store"] == (
        "2.10x",
        ">= 2x Dynamo",
        "met",
    )
    assert rows["e2e ingest, the same, SQLite store (until committed)"][2] == "NOT met"
    assert rows["POST /v1/lookup 512 blocks, 64 x 20k, idle, p50"] == (
        "0.40x",
        "<= 0.5x Dynamo",
        "met",
    )
    assert rows["the same under a 200k/s stream, p99"] == ("1.00x", "<= 0.8x Dynamo", "NOT met")
    assert rows["e2e memory per entry (RSS), 64 x 20k"][::2] == ("1.20x", "NOT met")
    assert rows["e2e memory per entry (allocator statistics), 64 x 20k"][::2] == ("0.80x", "met")
    warm_row = "e2e warm restart, 1M-block SQLite store (built by serve), serve to healthz"
    assert rows[warm_row] == ("0.69x", "<= 1.0 s (1M blocks)", "met")

    monkeypatch.setitem(sys.modules, "kvindex.bench.e2e", smoke_run[2])
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.START}\n{report.END}\n")
    assert report.main(["--readme", str(readme), "--results", str(smoke_run[0])]) == 0
    text = readme.read_text()
    assert "| case | kvindex | baseline | ratio | target | met |" in text
    assert f"| {report.DRAIN_TARGET}" in text
