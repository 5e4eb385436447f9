"""The bench's table (stdout, and the README's benchmark section) from its results.

`python -m kvindex.bench.report --readme README.md [--results bench/results.json]`
replaces the text between `<!-- bench:start -->` and `<!-- bench:end -->` in the README
with the table of the last run, the machine it ran on and its date.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "METHOD",
    "entries_curve",
    "main",
    "print_table",
    "readme_section",
    "rewrite_readme",
    "rows",
    "target_rows",
]

METHOD = (
    "ingest: after an untimed warm-up to steady state, the measured stream is fed in N "
    "slices of equal block events, each timed, and the best slice counts (disturbances on "
    "a shared machine only ever slow a slice down); lookups: p50/p99 of each round over "
    "the same 512-block prompts, median over N rounds; memory: resident-set delta of "
    "building the index in a fresh process, one per consumer and size"
)
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
Row = tuple[str, str, str, str]


def _m(per_s: float) -> str:
    return f"{per_s / 1e6:.2f} M/s" if per_s >= 1e5 else f"{per_s / 1e3:.0f} k/s"


def _instances(n: int) -> str:
    return f"{n} instance" if n == 1 else f"{n} instances"


def _entries(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def _skipped(d: dict[str, Any]) -> str | None:
    if "skipped" in d:
        return f"skipped: {d['skipped']}"
    if "error" in d:
        return f"error: {d['error']}"
    return None


def _off(d: dict[str, Any]) -> str:
    n = d.get("mismatched_blocks")
    return "" if n is None else " exact" if n == 0 else f" {n:,} blocks off"


def _ingest_rows(results: dict[str, Any]) -> list[Row]:
    out = []
    for case in results.get("ingest", {}).get("cases", []):
        ours, naive = case["kvindex"], case["naive"]
        ratio = case["ratio_vs_naive"]
        out.append(
            (
                f"ingest in process (decode + apply), {_instances(case['instances'])}",
                f"{_m(ours['per_s'])},{_off(ours)} ({ratio:.2f}x naive)",
                f"naive {_m(naive['per_s'])},{_off(naive)}",
                ">= 3x naive",
            )
        )
    return out


def _store_rows(results: dict[str, Any]) -> list[Row]:
    stores = results.get("stores", {})
    ingest = results.get("ingest", {}).get("cases", [])
    memory = {c["instances"]: c["kvindex"]["per_s"] for c in ingest}
    out = []
    for kind, label, target in (
        ("sqlite", "SQLite", ">= 0.5 M/s"),
        ("redis", "Redis", ">= 0.3 M/s"),
    ):
        case = stores.get(kind)
        if case is None:
            continue
        mem = memory.get(case["instances"])
        out.append(
            (
                f"ingest in process + {label} store, {_instances(case['instances'])}"
                " (until persisted)",
                _skipped(case) or _m(case["per_s"]),
                "-" if mem is None else f"memory store {_m(mem)}",
                target,
            )
        )
    return out


def _page_shape_rows(results: dict[str, Any]) -> list[Row]:
    shapes = results.get("page_shapes", {})
    found = shapes.get("cases", [])
    if not found:
        return []
    base = found[0]
    out = []
    for case in found:
        per_token = case.get("bytes_per_token")
        memory = "" if per_token is None else f", {per_token:.1f} B/token held"
        out.append(
            (
                f"ingest by page shape: {case['engine']} page {case['page_size']}, "
                f"{_instances(case['instances'])}",
                f"{_m(case['per_s'])} blocks = {_m(case['tokens_per_s'])} tokens,"
                f"{_off(case)}{memory}",
                "baseline"
                if case is base
                else f"{case['tokens_per_s'] / base['tokens_per_s']:.2f}x the tokens/s of "
                f"{base['engine']} page {base['page_size']}",
                "-",
            )
        )
    return out


def _drain_rows(results: dict[str, Any]) -> list[Row]:
    """The drain case (bench/drain.py): the C path beside the Python path, same run."""
    drain = results.get("drain")
    if not drain or "error" in drain or "runs" not in drain:
        return []
    runs = drain["runs"]
    c1, py1 = runs.get("c-1"), runs.get("python-1")
    if c1 is None or py1 is None:
        return []
    what = (
        f"drain of {drain['block_events']:,} queued block events, {drain['instances']} publishers"
    )
    out: list[Row] = [
        (
            f"{what}: 1 worker, ordinary batches in C",
            f"{_m(c1['per_s'])}, {c1['cpu_seconds_per_m_events']:.2f} CPU s/M events",
            f"Python path {_m(py1['per_s'])}, {py1['cpu_seconds_per_m_events']:.2f} CPU s/M events",
            "-",
        )
    ]
    c2, py2 = runs.get("c-2"), runs.get("python-2")
    if c2 is not None and py2 is not None:
        out.append(
            (
                f"{what}: 2 workers vs 1 ({drain['cpus']} cores)",
                f"{c2['per_s'] / c1['per_s']:.2f}x",
                f"Python path {py2['per_s'] / py1['per_s']:.2f}x",
                ">= 1.8x",
            )
        )
    c2s = runs.get("c-2-sharded")
    if c2s is not None:
        out.append(
            (
                f"{what}: 2 workers vs 1, the index in 2 shards (a worker each)",
                f"{c2s['per_s'] / c1['per_s']:.2f}x ({_m(c2s['per_s'])})",
                f"one index: {c2['per_s'] / c1['per_s']:.2f}x" if c2 is not None else "-",
                ">= 1.8x",
            )
        )
    c4s = runs.get("c-4-in-2-shards")
    if c2s is not None and c4s is not None:
        out.append(
            (
                f"{what}: 4 workers in 2 shards (two a shard) vs 2 (one a shard)",
                f"{c4s['per_s'] / c2s['per_s']:.2f}x ({_m(c4s['per_s'])})",
                f"2 workers {_m(c2s['per_s'])}",
                "-",
            )
        )
    out.append(
        (
            "GIL held per ordinary batch on the ingest path (measured)",
            f"{c1['gil_us_per_batch']:.2f} us",
            f"Python path {py1['gil_us_per_batch']:.2f} us",
            "<= 1 us",
        )
    )
    c1s, py1s = runs.get("c-1-sqlite"), runs.get("python-1-sqlite")
    if c1s is not None and py1s is not None:
        out.append(
            (
                "the same, a SQLite store recording every batch (1 worker)",
                f"{c1s['gil_us_per_batch']:.2f} us, {_m(c1s['per_s'])}",
                f"Python path {py1s['gil_us_per_batch']:.2f} us, {_m(py1s['per_s'])}",
                "<= 1 us",
            )
        )
    amdahl = drain.get("c_amdahl")
    if amdahl and c1.get("serial_fraction") is not None:
        locked, gil = amdahl["16"]["gil_and_lock"], amdahl["64"]["gil_and_lock"]
        out.append(
            (
                "ingest's serial part (GIL + the index's write lock), Amdahl at 16 / 64 cores",
                f"{c1['serial_fraction']:.2f}: {locked:.1f}x / {gil:.1f}x",
                f"GIL alone {c1['gil_fraction']:.3f}: {amdahl['16']['gil_only']:.1f}x / "
                f"{amdahl['64']['gil_only']:.1f}x",
                "-",
            )
        )
    return out


def _warm_rows(results: dict[str, Any]) -> list[Row]:
    warm = results.get("warm_restart")
    if not warm or "error" in warm:
        return []
    rows: list[Row] = [
        (
            f"warm restart: load a {warm['blocks']:,}-block SQLite store into a fresh index",
            f"{warm['load_seconds']:.2f} s",
            f"Python's loader: {warm['python_load_seconds']:.2f} s"
            if "python_load_seconds" in warm
            else "-",
            "-",
        )
    ]
    if "healthz_seconds" in warm:
        rows.append(
            (
                "warm restart: `serve` on it to healthz ok (the snapshot loaded in "
                + ("C)" if warm["loader"] == "c" else "Python)"),
                f"{warm['healthz_seconds']:.2f} s",
                f"Python's loader: {warm['python_healthz_seconds']:.2f} s",
                "<= 1 s to healthz (1M blocks)",
            )
        )
    return rows


def _latency(d: dict[str, Any]) -> str:
    lat = d["lookup"]
    return f"p50 {lat['p50_us']:,.0f} us, p99 {lat['p99_us']:,.0f} us"


_RADIX = "Dynamo RadixTree (in process)"


def _lookup_row(case: dict[str, Any]) -> Row:
    ours, naive, dyn = case["kvindex"], case["naive"], case["dynamo"]
    agree = "" if case.get("matches_agree", True) else " (MATCHES DIFFER)"
    theirs = _skipped(dyn) or _latency(dyn)
    name = (
        f"lookup of a 512-block prompt, {_instances(case['instances'])} x "
        f"{case['per_instance']:,} blocks ({_entries(case['entries'])} entries){agree}"
    )
    naive_text = _skipped(naive) or f"{_latency(naive)} (given the hashes)"
    return (
        name,
        _skipped(ours) or _latency(ours),
        f"naive {naive_text}; {_RADIX} {theirs}",
        "p50 <= 30 us, p99 <= 100 us (at 64 x 100k)",
    )


def _memory_row(case: dict[str, Any]) -> Row:
    ours, naive, dyn = case["kvindex"], case["naive"], case["dynamo"]

    def per(d: dict[str, Any]) -> str:
        return _skipped(d) or f"{d['bytes_per_entry']:.0f} B"

    mine = per(ours)
    if "memory_vs_dynamo" in case:
        mine += f" ({case['memory_vs_dynamo']:.2f}x Dynamo)"
    sharing = ours.get("entries_per_node")
    share = "" if sharing is None else f", {sharing:.2f} entries per tree node"
    return (
        f"memory per (instance, block) entry, {_entries(case['entries'])} entries{share}",
        mine,
        f"naive dict of sets {per(naive)}; {_RADIX} {per(dyn)}",
        "<= 1.0x Dynamo (at >= 1.28M entries)",
    )


def entries_curve(lookup: dict[str, Any]) -> list[dict[str, Any]]:
    """The cases of growing total entries: the `entries` cases and the instance-curve
    cases with the same number of instances, by entries."""
    by_entries = lookup.get("entries", [])
    instances = {c["instances"] for c in by_entries}
    same = [c for c in lookup.get("instances", []) if c["instances"] in instances]
    unique = {c["entries"]: c for c in same + by_entries}
    return [unique[e] for e in sorted(unique)]


def _lookup_rows(results: dict[str, Any]) -> list[Row]:
    lookup = results.get("lookup", {})
    out = [_lookup_row(c) for c in lookup.get("instances", [])]
    out += [_lookup_row(c) for c in lookup.get("entries", [])]
    out += [_memory_row(c) for c in entries_curve(lookup)]
    return out


def _e2e_rows(results: dict[str, Any]) -> list[Row]:
    e2e = results.get("e2e")
    if e2e is None:
        return []
    reason = _skipped(e2e)
    if reason is None and importlib.util.find_spec("kvindex.bench.e2e") is not None:
        try:
            table_rows: Callable[[dict[str, Any]], list[Row]] = importlib.import_module(
                "kvindex.bench.e2e"
            ).table_rows
            return [(str(a), str(b), str(c), str(d)) for a, b, c, d in table_rows(e2e)]
        except Exception as exc:  # results of another version of the e2e cases
            reason = f"error: cannot tabulate ({type(exc).__name__}: {exc})"[:200]
    return [("end to end (ZMQ into serve, HTTP, freshness, restart)", reason or "-", "-", "-")]


def _error_rows(results: dict[str, Any]) -> list[Row]:
    sections = ("ingest", "stores", "page_shapes", "drain", "warm_restart", "lookup")
    return [
        (f"{name}: the section failed", f"error: {results[name]['error']}", "-", "-")
        for name in sections
        if isinstance(results.get(name), dict) and "error" in results[name]
    ]


def rows(results: dict[str, Any]) -> list[Row]:
    """(case, kvindex, baseline, target) for every case of a results dict."""
    out: list[Row] = _error_rows(results)
    parts = (
        _ingest_rows,
        _store_rows,
        _page_shape_rows,
        _drain_rows,
        _warm_rows,
        _lookup_rows,
        _e2e_rows,
    )
    for part in parts:
        out += part(results)
    return out


# -- issue 23's targets, each with its ratio and whether it is met --------------------------

TargetRow = tuple[str, str, str, str, str, str]  # case, kvindex, baseline, ratio, target, met


def _met(ok: bool | None) -> str:
    return "-" if ok is None else "met" if ok else "NOT met"


def _exact_word(ok: bool | None) -> str:
    return "" if ok is None else ", exact" if ok else ", NOT EXACT"


def _ms(value: float) -> str:
    return f"{value:.2f} ms"


def _e2e_case(results: dict[str, Any], key: str) -> dict[str, Any]:
    e2e = results.get("e2e")
    case = e2e.get(key) if isinstance(e2e, dict) else None
    return case if isinstance(case, dict) else {}


def _shard_targets(results: dict[str, Any]) -> list[TargetRow]:
    """Issue 23 item 2's lookup and memory targets, over an index in shards (bench/shards.py):
    each count of shards beside one index, same run."""
    shards = results.get("shards")
    if not isinstance(shards, dict) or not shards.get("runs", {}).get("1"):
        return []
    runs, one = shards["runs"], shards["runs"]["1"]
    size = f"{shards['instances']} x {shards['blocks'] // 1000}k"
    out: list[TargetRow] = []
    for n, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        if n == "1":
            continue
        p50, p99 = run["p50_us"], run["p99_us"]
        out.append(
            (
                f"in-process lookup of a 512-block prompt at {size}, the index in {n} shards",
                f"p50 {p50:.0f} us, p99 {p99:.0f} us{_exact_word(run.get('exact'))}",
                f"one index p50 {one['p50_us']:.0f} us, p99 {one['p99_us']:.0f} us",
                f"{p50 / one['p50_us']:.2f}x / {p99 / one['p99_us']:.2f}x",
                "p50 <= 30 us, p99 <= 100 us",
                _met(p50 <= 30 and p99 <= 100),
            )
        )
    last = runs[max(runs, key=int)]
    out.append(
        (
            f"core bytes per entry at {size}, the index in {max(runs, key=int)} shards",
            f"{last['bytes_per_entry']:.1f} B",
            f"one index {one['bytes_per_entry']:.1f} B",
            f"{last['bytes_per_entry'] / one['bytes_per_entry']:.2f}x",
            "within 1.0x Dynamo's (one index: see the memory rows)",
            "-",
        )
    )
    return out


DRAIN_TARGET = "drain, 2 workers vs 1, memory store (in process)"


def _drain_targets(results: dict[str, Any]) -> list[TargetRow]:
    drain = results.get("drain")
    runs = drain.get("runs", {}) if isinstance(drain, dict) else {}
    c1, c2, py1 = runs.get("c-1"), runs.get("c-2"), runs.get("python-1")
    out: list[TargetRow] = []
    c2s = runs.get("c-2-sharded")
    if c1 and c2s:
        ratio = c2s["per_s"] / c1["per_s"]
        exact = c1["mismatched_blocks"] == 0 and c2s["mismatched_blocks"] == 0
        out.append(
            (
                f"{DRAIN_TARGET}: serve's default, the index in 2 shards (a worker each)",
                f"2 workers {_m(c2s['per_s'])}{_exact_word(exact)}",
                f"1 worker {_m(c1['per_s'])}",
                f"{ratio:.2f}x",
                ">= 1.8x",
                _met(ratio >= 1.8 and exact),
            )
        )
    if c1 and c2:
        ratio = c2["per_s"] / c1["per_s"]
        exact = c1["mismatched_blocks"] == 0 and c2["mismatched_blocks"] == 0
        out.append(
            (
                "the same, one index (--index-shards 1): both workers write one index",
                f"2 workers {_m(c2['per_s'])}{_exact_word(exact)}",
                f"1 worker {_m(c1['per_s'])}",
                f"{ratio:.2f}x",
                "-",
                "-",
            )
        )
    if c1 and py1:
        gil = c1["gil_us_per_batch"]
        out.append(
            (
                "GIL held per ordinary batch on the ingest path (drain, 1 worker)",
                f"{gil:.2f} us",
                f"every batch in Python {py1['gil_us_per_batch']:.2f} us",
                f"{gil / py1['gil_us_per_batch']:.3f}x",
                "<= 1 us",
                _met(gil <= 1.0),
            )
        )
    c1s, py1s = runs.get("c-1-sqlite"), runs.get("python-1-sqlite")
    if c1s and py1s:
        gil = c1s["gil_us_per_batch"]
        out.append(
            (
                "GIL held per ordinary batch, a SQLite store recording (drain, 1 worker)",
                f"{gil:.2f} us{_exact_word(c1s['mismatched_blocks'] == 0)}",
                f"every batch in Python {py1s['gil_us_per_batch']:.2f} us",
                f"{gil / py1s['gil_us_per_batch']:.3f}x",
                "<= 1 us",
                _met(gil <= 1.0),
            )
        )
    serve = _e2e_case(results, "e2e_ingest_memory")
    python = _e2e_case(results, "e2e_ingest_sqlite_python")
    if "serve_gil_us_per_batch" in serve:
        gil = serve["serve_gil_us_per_batch"]
        base = "-"
        ratio_text = "-"
        if "serve_gil_us_per_batch" in python:
            theirs = python["serve_gil_us_per_batch"]
            base = f"serve, SQLite, every batch in Python {theirs:.2f} us"
            ratio_text = f"{gil / theirs:.3f}x" if theirs else "-"
        out.append(
            (
                "GIL held per batch in serve (e2e ingest, memory store)",
                f"{gil:.2f} us",
                base,
                ratio_text,
                "<= 1 us",
                _met(gil <= 1.0),
            )
        )
    return out


def _ingest_targets(results: dict[str, Any]) -> list[TargetRow]:
    dynamo = _e2e_case(results, "e2e_ingest_dynamo")
    out: list[TargetRow] = []
    for key, label, target in (
        ("memory", "e2e ingest, 4 publishers -> serve, memory store", 2.0),
        ("sqlite", "e2e ingest, the same, SQLite store (until committed)", 1.5),
    ):
        case = _e2e_case(results, f"e2e_ingest_{key}")
        if "per_s" not in case:
            continue
        theirs = f"Dynamo {_m(dynamo['per_s'])}" if "per_s" in dynamo else "Dynamo -"
        ratio = case.get("vs_dynamo")
        out.append(
            (
                label,
                f"{_m(case['per_s'])}{_exact_word(case.get('exact'))}",
                theirs + _exact_word(dynamo.get("exact")),
                "-" if ratio is None else f"{ratio:.2f}x",
                f">= {target:g}x Dynamo",
                _met(None if ratio is None else ratio >= target),
            )
        )
    memory = _e2e_case(results, "e2e_ingest_memory")
    cpu, theirs_cpu = (
        memory.get("serve_cpu_seconds_per_m_events"),
        dynamo.get("cpu_seconds_per_m_events"),
    )
    if cpu is not None:
        out.append(
            (
                "serve CPU seconds per M block events (e2e ingest, memory store)",
                f"{cpu:.2f} s",
                "-" if theirs_cpu is None else f"Dynamo {theirs_cpu:.2f} s",
                "-" if not theirs_cpu else f"{cpu / theirs_cpu:.2f}x",
                "- (what predicts 16 cores)",
                "-",
            )
        )
    return out


def _lookup_targets(results: dict[str, Any]) -> list[TargetRow]:
    case = _e2e_case(results, "e2e_lookup")
    ours, theirs = case.get("kvindex", {}), case.get("dynamo", {})
    if not isinstance(ours, dict) or "idle" not in ours or "idle" not in theirs:
        return []
    size = f"{case.get('instances', '?')} x {case.get('per_instance', 0) / 1e3:g}k"
    exact = _exact_word(ours.get("exact"))
    out: list[TargetRow] = []
    for phase, stat, label, target in (
        ("idle", "p50", f"POST /v1/lookup 512 blocks, {size}, idle, p50", 0.5),
        ("loaded", "p50", "the same under a 200k/s stream, p50", 0.5),
        ("loaded", "p99", "the same under a 200k/s stream, p99", 0.8),
    ):
        mine, peer = ours[phase][f"{stat}_ms"], theirs[phase][f"{stat}_ms"]
        ratio = mine / peer
        out.append(
            (
                label,
                f"{_ms(mine)}{exact}",
                f"Dynamo {_ms(peer)}{_exact_word(theirs.get('exact'))}",
                f"{ratio:.2f}x",
                f"<= {target:g}x Dynamo",
                _met(ratio <= target),
            )
        )
    rss, heap, peer_rss = (
        ours.get("bytes_per_entry"),
        ours.get("heap_bytes_per_entry"),
        theirs.get("bytes_per_entry"),
    )
    for value, how in ((rss, "RSS"), (heap, "allocator statistics")):
        if value is None or not peer_rss:
            continue
        ratio = value / peer_rss
        out.append(
            (
                f"e2e memory per entry ({how}), {size}",
                f"{value:.0f} B",
                f"Dynamo {peer_rss:.0f} B (RSS)",
                f"{ratio:.2f}x",
                "<= 1.0x Dynamo",
                _met(ratio <= 1.0),
            )
        )
    return out


def _warm_targets(results: dict[str, Any]) -> list[TargetRow]:
    out: list[TargetRow] = []
    suite = results.get("warm_restart")
    if isinstance(suite, dict) and "healthz_seconds" in suite and "python_healthz_seconds" in suite:
        seconds, theirs, blocks = (
            suite["healthz_seconds"],
            suite["python_healthz_seconds"],
            suite["blocks"],
        )
        out.append(
            (
                f"warm restart, {_entries(blocks)}-block SQLite store (built in process), "
                "serve to healthz",
                f"{seconds:.2f} s",
                f"snapshot read in Python {theirs:.2f} s",
                f"{seconds / theirs:.2f}x",
                "<= 1.0 s (1M blocks)",
                _met(seconds <= 1.0) if blocks >= 1_000_000 else f"n/a ({_entries(blocks)})",
            )
        )
    return out + _e2e_warm_targets(results)


def _e2e_warm_targets(results: dict[str, Any]) -> list[TargetRow]:
    case = _e2e_case(results, "e2e_warm_restart")
    if "healthz_seconds" not in case:
        return []
    seconds, blocks = case["healthz_seconds"], case["blocks"]
    if "python_healthz_seconds" in case:
        theirs = case["python_healthz_seconds"]
        base, ratio = f"snapshot read in Python {theirs:.2f} s", f"{seconds / theirs:.2f}x"
    else:
        base, ratio = f"empty memory store {case['cold_healthz_seconds']:.2f} s", "-"
    met = _met(seconds <= 1.0) if blocks >= 1_000_000 else f"n/a ({_entries(blocks)})"
    return [
        (
            f"e2e warm restart, {_entries(blocks)}-block SQLite store (built by serve), "
            "serve to healthz",
            f"{seconds:.2f} s",
            base,
            ratio,
            "<= 1.0 s (1M blocks)",
            met,
        )
    ]


def target_rows(results: dict[str, Any]) -> list[TargetRow]:
    """Issue 23's targets: (case, kvindex, baseline, ratio, target, met) from a results
    dict, each figure beside the baseline measured in the same run."""
    return [
        *_drain_targets(results),
        *_ingest_targets(results),
        *_lookup_targets(results),
        *_shard_targets(results),
        *_warm_targets(results),
    ]


def _machine_line(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    memory = f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    return (
        f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores{memory}), "
        f"Python {m.get('python', '?')}, {m.get('platform', '?')}"
    )


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"kvindex bench ({results.get('mode', '?')} mode; baselines measured in the same run)"
    table = Table(title=title, caption=_machine_line(results))
    for col in ("case", "kvindex", "baseline", "target"):
        table.add_column(col)
    for row in rows(results):
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide rows rather than 80 columns
        console = Console(width=170)
    targets = target_rows(results)
    if targets:
        summary = Table(title="issue 23's targets (each beside its baseline, same run)")
        for col in ("case", "kvindex", "baseline", "ratio", "target", "met"):
            summary.add_column(col)
        for target in targets:
            summary.add_row(*target)
        console.print(summary)
    console.print(table)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def readme_section(results: dict[str, Any], plots_dir: str) -> str:
    """The README's benchmark section: machine, date, table and plots."""
    mode = results.get("mode", "full")
    command = "make bench" if mode == "full" else f"python -m kvindex.bench --{mode}"
    date = str(results.get("date", "?"))[:10]
    lines = [
        f"Last run: {date}, `{command}` ({mode} mode) on {_machine_line(results)}.",
        f"Every baseline was measured in the same run. Method: {results.get('method', METHOD)}.",
        *_apart_lines(results),
        *_target_lines(results),
        "",
        "| case | kvindex | baseline | target |",
        "| --- | --- | --- | --- |",
    ]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows(results)]
    plots = results.get("plots") or []
    if plots:
        links = ", ".join(f"[{Path(p).stem.replace('_', ' ')}]({plots_dir}/{p})" for p in plots)
        lines += ["", f"Plots: {links}."]
    return "\n".join(lines)


def _target_lines(results: dict[str, Any]) -> list[str]:
    """Issue 23's targets as a table of their own, above the whole table."""
    targets = target_rows(results)
    if not targets:
        return []
    lines = [
        "",
        "Issue 23's targets (ratio = kvindex / the baseline beside it, same run):",
        "",
        "| case | kvindex | baseline | ratio | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in targets]


def _apart_lines(results: dict[str, Any]) -> list[str]:
    """Cases run apart (`--only CASE`) after that run: when, where, and how to run them
    again."""
    return [
        f"The {case} rows were run apart on {str(run.get('date', '?'))[:10]} "
        f"(`python -m kvindex.bench --only {case}`, {run.get('mode', '?')} mode, "
        f"{_where(run.get('machine'), results.get('machine'))}), each beside its own "
        "baseline in that run."
        for case, run in sorted((results.get("runs_apart") or {}).items())
    ]


def _where(machine: Any, main: Any) -> str:
    """ "same machine", or the machine a case ran apart on when it is another kind."""
    if not isinstance(machine, dict) or not isinstance(main, dict):
        return "same machine"
    keys = ("cpu", "cores", "memory_gib")
    if all(machine.get(k) == main.get(k) for k in keys):
        return "same machine"
    return f"on {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores)"


def rewrite_readme(readme: Path, results_path: Path) -> None:
    """Replace the README's text between the bench markers with the section."""
    results = json.loads(results_path.read_text())
    text = readme.read_text()
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{readme} has no {START} ... {END} markers")
    plots_dir = os.path.relpath(results_path.parent, readme.parent)
    section = readme_section(results, Path(plots_dir).as_posix())
    readme.write_text(text[: start + len(START)] + "\n" + section + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvindex.bench.report",
        description="print the bench table, or write it into the README",
    )
    parser.add_argument("--results", default="bench/results.json", metavar="PATH")
    parser.add_argument("--readme", metavar="PATH", help="rewrite this README's bench section")
    args = parser.parse_args(argv)
    results_path = Path(args.results)
    if not results_path.exists():
        print(f"no results at {results_path}: run `make bench` first", file=sys.stderr)
        return 2
    if args.readme:
        try:
            rewrite_readme(Path(args.readme), results_path)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(f"rewrote the bench section of {args.readme}")
        return 0
    print_table(json.loads(results_path.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
