"""The end-to-end cases' rows in the bench table."""

from __future__ import annotations

from typing import Any

__all__ = ["table_rows"]


def table_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(case, kvindex, baseline, target) rows for the bench table."""
    memory = results.get("e2e_ingest_memory", {})
    vs_memory = _rate(memory, "serve, memory store")
    return [
        (
            "e2e ingest: ZMQ -> serve, memory store (block events/s)",
            _ingest(memory),
            _rate(results.get("e2e_naive", {}), "naive SUB consumer"),
            ">= 0.8 M/s",
        ),
        (
            "e2e ingest: ZMQ -> serve, SQLite store (until committed)",
            _ingest(results.get("e2e_ingest_sqlite", {})),
            vs_memory,
            ">= 0.5 M/s",
        ),
        (
            "e2e ingest: ZMQ -> serve, Redis store (until in Redis)",
            _ingest(results.get("e2e_ingest_redis", {})),
            vs_memory,
            ">= 0.3 M/s",
        ),
        _lookup_row(results.get("e2e_lookup_http", {})),
        _fresh_row(results.get("e2e_freshness", {})),
        _warm_row(results.get("e2e_warm_restart", {})),
    ]


def _failed(case: dict[str, Any]) -> str | None:
    if not case:
        return "not run"
    if "error" in case:
        return f"failed: {str(case['error'])[:160]}"
    if "skipped" in case:
        return f"skipped: {case['skipped']}"
    return None


def _rate(case: dict[str, Any], label: str) -> str:
    return _failed(case) or f"{label} {case['per_s'] / 1e6:.2f} M/s"


def _ingest(case: dict[str, Any]) -> str:
    failed = _failed(case)
    if failed:
        return failed
    text = f"{case['per_s'] / 1e6:.2f} M/s"
    if "persist_lag_seconds" in case:
        text += f" (applied {case['applied_per_s'] / 1e6:.2f} M/s)"
    trouble = [f"{k} {case[k]}" for k in ("gaps", "replayed_batches", "lost_batches") if case[k]]
    if not case["exact"]:
        trouble.append("NOT EXACT")
    return text + (f" [{', '.join(trouble)}]" if trouble else "")


def _lookup_row(case: dict[str, Any]) -> tuple[str, str, str, str]:
    name = "e2e POST /v1/lookup, 512-block prompt, during ingest at 200k/s"
    target = "p99 <= 2 ms"
    failed = _failed(case)
    if failed:
        return (name, failed, "-", target)
    loaded, idle = case["loaded"], case["idle"]
    ours = f"p50 {loaded['p50_ms']:.2f} ms, p99 {loaded['p99_ms']:.2f} ms"
    ours += f" (load {case['load_achieved_per_s'] / 1e3:.0f}k/s)"
    if not case["answers_correct"]:
        ours += " [WRONG ANSWERS]"
    return (name, ours, f"idle: p50 {idle['p50_ms']:.2f} ms, p99 {idle['p99_ms']:.2f} ms", target)


def _fresh_row(case: dict[str, Any]) -> tuple[str, str, str, str]:
    name = "e2e freshness: publish -> visible over HTTP, at 100k/s"
    target = "p99 <= 10 ms"
    failed = _failed(case)
    if failed:
        return (name, failed, "-", target)
    ours = f"p50 {case['p50_ms']:.2f} ms, p99 {case['p99_ms']:.2f} ms"
    missing = case["markers"] - case["markers_seen"]
    if missing:
        ours += f" [{missing} markers never seen]"
    return (name, ours, f"resolution {case['resolution_ms']:.2f} ms (one poll)", target)


def _warm_row(case: dict[str, Any]) -> tuple[str, str, str, str]:
    target = "<= 3 s (1M blocks)"
    name = f"e2e warm restart: serve on a {case.get('blocks', 0):,}-block SQLite store"
    failed = _failed(case)
    if failed:
        return (name, failed, "-", target)
    ours = f"{case['healthz_seconds']:.2f} s to healthz"
    ours += f", {case['blocks_listed_seconds']:.2f} s to all blocks counted"
    return (name, ours, f"empty memory store: {case['cold_healthz_seconds']:.2f} s", target)
