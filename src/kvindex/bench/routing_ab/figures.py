"""The routing bench's figures per policy, its table and its plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvindex.bench.routing_ab.replay import RunResult

__all__ = ["figures", "plot", "table"]


def figures(run: RunResult) -> dict[str, Any]:
    """One run's figures (times in seconds of the model)."""
    done = [j for j in run.jobs if not j.refused and j.first_token is not None]
    ttft = np.array([j.ttft for j in done], dtype=float)
    prompt = sum(len(j.prompt) for j in done)
    hits = sum(j.hit_tokens for j in done)
    start = min((j.at for j in run.jobs), default=0.0)
    end = max((j.finished or 0.0 for j in done), default=start)
    span = max(end - start, 1e-9)
    out: dict[str, Any] = {
        "requests": len(run.jobs),
        "refused": len(run.jobs) - len(done),
        "hit_tokens": hits,
        "prompt_tokens": prompt,
        "hit_rate": round(hits / prompt, 4) if prompt else 0.0,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p90": _pct(ttft, 90),
        "ttft_p99": _pct(ttft, 99),
        "ttft_mean": round(float(ttft.mean()), 4) if len(ttft) else None,
        "throughput_rps": round(len(done) / span, 3),
        "output_tokens_per_s": round(sum(len(j.output) for j in done) / span, 1),
        "makespan_s": round(span, 2),
        "per_engine": [e.jobs for e in run.engines],
        "wall_seconds": round(run.wall_seconds, 2),
    }
    if run.agreement is not None:
        equal, total = run.agreement
        out["oracle_decisions"] = round(equal / total, 4) if total else None
    if run.applied:
        out["applied"] = run.applied
    return out


def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def table(results: dict[str, dict[str, Any]], reference: str = "kvindex") -> list[str]:
    """Markdown rows: every policy's figures, and the reference's p90 as a ratio of each."""
    ref = results.get(reference, {})
    rows = [
        "| policy | hit rate (tokens) | TTFT p50 | TTFT p90 | TTFT p99 | throughput | "
        "requests per engine | kvindex p90 / this | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, f in results.items():
        if "error" in f:
            rows.append(f"| {name} | error: {f['error']} |  |  |  |  |  |  |  |")
            continue
        ratio = "-"
        if name != reference and ref.get("ttft_p90") and f.get("ttft_p90"):
            ratio = f"{ref['ttft_p90'] / f['ttft_p90']:.3f}x"
        spread = f"{min(f['per_engine'])}-{max(f['per_engine'])}"
        rows.append(
            f"| {name} | {f['hit_rate']:.1%} | {_s(f['ttft_p50'])} | {_s(f['ttft_p90'])} | "
            f"{_s(f['ttft_p99'])} | {f['throughput_rps']:.2f} req/s | {spread} | {ratio} | "
            f"{_notes(f, ref)} |"
        )
    return rows


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _notes(f: dict[str, Any], ref: dict[str, Any]) -> str:
    notes = []
    if "oracle_decisions" in f:
        notes.append(f"{f['oracle_decisions']:.1%} of decisions = oracle's")
    applied = f.get("applied")
    if applied:
        state = "exact" if applied["exact"] else f"{applied['blocks_off']} blocks off"
        silent = applied.get("engines_without_events")
        if silent:
            notes.append(f"{silent} engines without KV events (approximate)")
            state += " on the others"
        notes.append(f"serve's view at the end: {state} ({applied['batches']} batches)")
    if f.get("refused"):
        notes.append(f"{f['refused']} refused (larger than a pool)")
    if ref.get("hit_tokens") and "oracle_decisions" not in f and f.get("hit_tokens"):
        notes.append(f"kvindex hits {ref['hit_tokens'] / f['hit_tokens']:.3f}x this")
    return "; ".join(notes)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """TTFT p50/p90/p99 per policy (log scale) beside the hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, f in results.items() if "error" not in f]
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1.3]})
    width = 0.27
    x = np.arange(len(names))
    for k, (q, color) in enumerate((("p50", "#6baed6"), ("p90", "#2171b5"), ("p99", "#08306b"))):
        values = [max(results[n][f"ttft_{q}"] or 0.0, 1e-3) for n in names]
        ax.bar(x + (k - 1) * width, values, width, label=f"TTFT {q}", color=color)
    ax.set_yscale("log")
    ax.set_xticks(x, _labels(names), fontsize=8)
    ax.set_ylabel("modeled time to first token (s)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    hx.barh(_labels(names), [results[n]["hit_rate"] for n in names], color="#41ab5d")
    hx.set_xlim(0, 1)
    hx.set_xlabel("prefix hit rate (tokens)")
    hx.invert_yaxis()
    hx.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _labels(names: Sequence[str]) -> list[str]:
    return [n.replace("_", "\n") for n in names]
