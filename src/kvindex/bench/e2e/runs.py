"""How the end-to-end cases' runs become figures: a run that fails is recorded, not raised;
the best of several runs; latency percentiles; ingest rates."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from kvindex.bench.common import percentile
from kvindex.bench.e2e.streams import SteadyStream

__all__ = ["attempt", "best_run", "ingest_figures", "summarize_ms"]


def attempt(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One run of a case; a failure is recorded (with its traceback), not raised."""
    started = time.monotonic()
    try:
        result = case()
    except Exception as exc:
        tb = traceback.format_exc(limit=4)
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}
    result["case_seconds"] = time.monotonic() - started
    return result


def best_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run that completed (with every run's rate beside it), or the error."""
    done = [r for r in runs if "per_s" in r]
    if not done:
        return runs[-1]
    best = dict(max(done, key=lambda r: float(r["per_s"])))
    best["runs_per_s"] = [r.get("per_s") for r in runs]
    best["exact_every_run"] = all(r.get("exact") for r in done)
    return best


def ingest_figures(work: SteadyStream, t0: float, applied: float, persisted: float | None) -> Any:
    """Block events per second from the first send until applied (and persisted)."""
    out: dict[str, Any] = {"block_events": work.events, "seconds": applied - t0}
    out["per_s"] = out["applied_per_s"] = work.events / (applied - t0)
    if persisted is not None:
        out["seconds"] = max(applied, persisted) - t0
        out["per_s"] = work.events / out["seconds"]
        out["persist_lag_seconds"] = max(0.0, persisted - applied)
    return out


def summarize_ms(seconds: Sequence[float], in_service_ms: float | None = None) -> Any:
    ordered = sorted(seconds)
    out = {
        "p50_ms": percentile(ordered, 0.5) * 1e3,
        "p99_ms": percentile(ordered, 0.99) * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "count": len(ordered),
    }
    if in_service_ms is not None:
        out["in_service_mean_ms"] = in_service_ms
    return out
