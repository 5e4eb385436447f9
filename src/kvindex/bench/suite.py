"""`python -m kvindex.bench` / `kvindex bench` / `make bench`: the whole suite.

Three modes: the default (full: every case at the issue's sizes, 10-20 minutes), `--quick`
(the same cases, smaller: under 2 minutes, what CI can run) and `--smoke` (seconds: the
whole pipeline on toy sizes, for the tests). Writes `results.json` and the plots beside it
and prints the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvindex.bench import cases, plots, report
from kvindex.bench.common import machine_info
from kvindex.bench.consumers import dynamo_status
from kvindex.bench.plan import PLANS, EndToEnd, Plan, add_arguments, plan_from
from kvindex.bench.workloads import FillSpec, IngestSpec, IngestWorkload, ingest_workload
from kvindex.sim import WireFormat

__all__ = ["PLANS", "Plan", "add_arguments", "main", "run", "run_suite"]


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _timed(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, timed; a section that raises is recorded as an error, and the run goes on
    (the other sections' figures are still worth having)."""
    start = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:
        traceback.print_exc()
        value = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    results["elapsed_seconds"][name] = round(time.perf_counter() - start, 2)
    return value


def run_suite(plan: Plan, workdir: Path, dynamo: bool = True, e2e: bool = True) -> dict[str, Any]:
    """Every case of `plan`; the results as `results.json` holds them."""
    status = dynamo_status() if dynamo else {"available": False, "reason": "--no-dynamo"}
    if status["available"]:
        status["max_entries"] = plan.dynamo_max_entries
    results: dict[str, Any] = {
        "format": 1,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": plan.mode,
        "plan": asdict(plan),
        "machine": machine_info(),
        "method": report.METHOD,
        "dynamo": status,
        "elapsed_seconds": {},
    }
    workloads: dict[int, IngestWorkload] = {}
    results["ingest"] = _timed(results, "ingest", lambda: _ingest(plan, workloads))
    results["stores"] = _timed(results, "stores", lambda: _stores(plan, workloads, workdir))
    workloads.clear()
    results["page_shapes"] = _timed(results, "page_shapes", lambda: _page_shapes(plan))
    results["drain"] = _timed(results, "drain", lambda: _drain(plan))
    results["shards"] = _timed(results, "shards", lambda: _shards(plan))
    results["warm_restart"] = _timed(results, "warm_restart", lambda: _warm(plan, workdir))
    results["lookup"] = _timed(results, "lookup", lambda: _lookups(plan, status))
    results["e2e"] = _timed(
        results, "e2e", lambda: _e2e(plan, workdir, dynamo) if e2e else _no_e2e()
    )
    return results


def _workload(plan: Plan, instances: int) -> IngestWorkload:
    spec = IngestSpec(instances, plan.ingest_events, gpu_blocks=plan.gpu_blocks)
    w = ingest_workload(spec)
    how = "cached" if w.cached else f"generated in {w.generation_seconds:.1f} s"
    _say(f"workload {instances} instances: {w.events:,} block events ({how})")
    return w


def _ingest(plan: Plan, keep: dict[int, IngestWorkload]) -> dict[str, Any]:
    out = []
    for n in plan.ingest_instances:
        w = _workload(plan, n)
        _say(f"ingest: {n} instances")
        out.append(cases.ingest_case(w, plan.slices))
        if n == plan.store_instances:
            keep[n] = w
    return {"cases": out}


PAGE_SHAPES: tuple[tuple[WireFormat, int], ...] = (("0.33", 16), ("sglang", 16), ("sglang", 1))


def _page_shapes(plan: Plan) -> dict[str, Any]:
    """vLLM page 16 (the baseline), SGLang page 16 and page 1: the same pool size in tokens
    and the same number of measured block events each."""
    instances = plan.store_instances
    out = []
    for fmt, page in PAGE_SHAPES:
        gpu_blocks = plan.gpu_blocks * 16 // page
        spec = IngestSpec(
            instances, plan.ingest_events, gpu_blocks=gpu_blocks, format=fmt, page_size=page
        )
        w = ingest_workload(spec)
        how = "cached" if w.cached else f"generated in {w.generation_seconds:.1f} s"
        _say(f"page shapes: {fmt} page {page}, {w.events:,} block events ({how})")
        out.append(w)
    return cases.page_shapes_case(out, plan.slices)


def _drain(plan: Plan) -> dict[str, Any]:
    """The drain case (bench/drain.py): the end-to-end ingest stream's size, queued first."""
    from kvindex.bench.drain import drain_case

    e2e = plan.e2e
    spec = IngestSpec(e2e.ingest_instances, e2e.ingest_events, gpu_blocks=plan.gpu_blocks)
    w = ingest_workload(spec)
    _say(f"drain: {w.spec.instances} publishers, {w.events:,} block events queued, then timed")
    return drain_case(w, rounds=e2e.ingest_runs)


def _shards(plan: Plan) -> dict[str, Any]:
    """The lookup over an index in shards beside one index (kvindex.bench.shards): the
    issue 23 target's case, 64 x 100k, in full mode; smaller ones in the others."""
    from kvindex.bench.shards import shard_lookup_case

    instances, blocks = max(
        (case for case in plan.lookup_entries if case[1] <= 100_000), key=lambda c: c[0] * c[1]
    )
    counts = (1, 2, 4, 16) if plan.mode == "full" else (1, 2, 4)
    _say(f"shards: lookups over {counts} shards, {instances} x {blocks:,} blocks")
    return shard_lookup_case(instances, blocks, counts, reps=2000 if plan.mode == "full" else 100)


def _stores_only(plan: Plan) -> dict[str, Any]:
    """`--only stores`: the stores' section, and SQLite again with every batch handed over
    as an item (as before the C path served persistent stores), the forms interleaved."""
    w = _workload(plan, plan.store_instances)
    with tempfile.TemporaryDirectory(prefix="kvindex-bench-") as tmp:
        workdir = Path(tmp)
        items = cases.store_case("sqlite", w, plan.slices, workdir, bulk=False)
        out = _stores(plan, {plan.store_instances: w}, workdir)
    out["sqlite_items"] = items
    return out


def _warm(plan: Plan, workdir: Path) -> dict[str, Any]:
    _say(f"warm restart: {plan.warm_blocks:,} blocks")
    return cases.warm_restart_case(plan.warm_blocks, plan.warm_loads, workdir, plan.e2e.timeout)


def _warm_apart(plan: Plan) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvindex-bench-") as tmp:
        return _warm(plan, Path(tmp))


# In-process sections `--only` can run apart too.
IN_PROCESS_ONLY: dict[str, Callable[[Plan], dict[str, Any]]] = {
    "page_shapes": _page_shapes,
    "drain": _drain,
    "shards": _shards,
    "stores": _stores_only,
    "warm_restart": _warm_apart,
}


def _stores(plan: Plan, keep: dict[int, IngestWorkload], workdir: Path) -> dict[str, Any]:
    w = keep.get(plan.store_instances) or _workload(plan, plan.store_instances)
    _say(f"ingest with the SQLite and Redis stores: {w.spec.instances} instances")
    return {kind: cases.store_case(kind, w, plan.slices, workdir) for kind in ("sqlite", "redis")}


def _lookups(plan: Plan, status: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"instances": [], "entries": []}
    for key, sizes in (("instances", plan.lookup_instances), ("entries", plan.lookup_entries)):
        for instances, per in sizes:
            spec = FillSpec(instances, per)
            _say(f"lookup and memory: {instances} instances x {per:,} blocks")
            out[key].append(cases.lookup_case(spec, plan.prompts, plan.rounds, status))
    return out


def _no_e2e() -> dict[str, Any]:
    return {"skipped": "--no-e2e"}


def _e2e(plan: Plan, workdir: Path, dynamo: bool = True) -> dict[str, Any]:
    """The end-to-end cases (`kvindex.bench.e2e`: ZMQ into `serve`, HTTP under load,
    freshness, warm restart to healthz), when that module is there."""
    if importlib.util.find_spec("kvindex.bench.e2e") is None:
        _say("end-to-end cases: skipped (kvindex.bench.e2e is not there)")
        return {"skipped": "kvindex.bench.e2e is not there"}
    _say("end-to-end cases")
    module = importlib.import_module("kvindex.bench.e2e")
    directory = workdir / "e2e"
    directory.mkdir(exist_ok=True)
    try:
        result: dict[str, Any] = module.run_e2e(plan, directory, dynamo=dynamo)
    except Exception as exc:  # one broken case must not lose the rest of the run
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return result


def run(args: argparse.Namespace) -> int:
    """Run the suite for parsed `args`; print the table; write the JSON and the plots."""
    plan = plan_from(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only == "routing_ab":  # a run and a file of its own (kvindex bench routing)
        from kvindex.bench.routing_ab.run import run_mode

        return run_mode(plan.mode, out.with_name("routing_ab.json"))
    if args.only:
        return _run_only(args.only, plan, out)
    _say(f"mode {plan.mode}; results to {out}")
    with tempfile.TemporaryDirectory(prefix="kvindex-bench-") as tmp:
        results = run_suite(plan, Path(tmp), dynamo=not args.no_dynamo, e2e=not args.no_e2e)
    results["plots"] = [p.name for p in plots.render_all(results, out.parent)]
    out.write_text(json.dumps(results, indent=2) + "\n")
    report.print_table(results)
    print(f"written: {out} and {', '.join(results['plots'])} in {out.parent}")
    return 0


def _run_only(case: str, plan: Plan, out: Path) -> int:
    """One end-to-end case (`--only`), its results put into `out`'s, which keeps the rest
    of the last run and says which case ran apart, when and in which mode."""
    from kvindex.bench.e2e.cases import ingest_workers_case, lookup_run
    from kvindex.bench.e2e.chat import chat_case
    from kvindex.bench.e2e.dynamo import standalone_status
    from kvindex.bench.e2e.routing import routing_case

    def lookup(sizes: EndToEnd, workdir: Path) -> dict[str, Any]:
        return lookup_run(sizes, workdir, standalone_status())

    cases: dict[str, Callable[[EndToEnd, Path], dict[str, Any]]] = {
        "routing": routing_case,
        "chat_lookup": chat_case,
        "ingest_workers": ingest_workers_case,
        "lookup": lookup,
    }
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"e2e": {}}
    _say(f"only the {case} case, mode {plan.mode}; into {out}")
    started = time.perf_counter()

    def into_e2e(name: str, value: dict[str, Any]) -> None:
        e2e = results.setdefault("e2e", {})
        if not isinstance(e2e, dict) or "skipped" in e2e or "error" in e2e:
            e2e = results["e2e"] = {}
        e2e[f"e2e_{name}"] = value

    if case in IN_PROCESS_ONLY:  # a section of its own, not an end-to-end case
        results[case] = IN_PROCESS_ONLY[case](plan)
        if case == "warm_restart":  # and the end-to-end case of the same name, with it
            from kvindex.bench.e2e.cases import case_warm
            from kvindex.bench.e2e.runs import attempt

            with tempfile.TemporaryDirectory(prefix="kvindex-bench-") as tmp:
                into_e2e(case, attempt(lambda: case_warm(plan.e2e, Path(tmp))))
    else:
        with tempfile.TemporaryDirectory(prefix="kvindex-bench-") as tmp:
            into_e2e(case, cases[case](plan.e2e, Path(tmp)))
    results.setdefault("runs_apart", {})[case] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": plan.mode,
        "machine": machine_info(),
        "seconds": round(time.perf_counter() - started, 2),
    }
    out.write_text(json.dumps(results, indent=2) + "\n")
    report.print_table(results)
    print(f"written: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvindex.bench", description=(__doc__ or "").split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
