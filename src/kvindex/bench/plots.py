"""The scaling curves as PNGs (matplotlib, Agg), in the analysis report's style:
ingest rate by instances, lookup latency by instances and by entries, memory per entry.

Each figure puts kvindex beside its baselines and draws the target as a dashed line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from kvindex.analysis.plots import STYLE
from kvindex.bench.report import entries_curve

__all__ = ["render_all"]

_COLOR = {"kvindex": "#4C72B0", "naive": "#DD8452", "dynamo": "#55A868", "target": "#C44E52"}
_LABEL = {
    "kvindex": "kvindex",
    "naive": "naive (msgpack + dict of sets)",
    "dynamo": "Dynamo RadixTree (in process)",
}


@contextmanager
def _figure(columns: int = 1) -> Iterator[tuple[Figure, list[Axes]]]:
    with plt.rc_context(cast(Any, STYLE)):  # the analysis report's look
        fig, axes = plt.subplots(1, columns, figsize=(6.4 * columns * 0.8, 3.6), squeeze=False)
        try:
            yield fig, list(axes[0])
        finally:
            plt.close(fig)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png", bbox_inches="tight", facecolor="white")
    return path


def _target(ax: Axes, y: float, label: str) -> None:
    ax.axhline(y, color=_COLOR["target"], linestyle="--", linewidth=1, label=label)


def _count(x: float, _: object = None) -> str:
    if x >= 1e6:
        return f"{x / 1e6:g}M"
    if x >= 1e3:
        return f"{x / 1e3:g}k"
    return f"{x:g}"


def _ticks(ax: Axes, values: list[int]) -> None:
    """Ticks at the measured sizes, written 1, 8, 64, 256 or 128k, 1M."""
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(values))))
    ax.xaxis.set_major_formatter(FuncFormatter(_count))
    ax.xaxis.set_minor_locator(NullLocator())


def _legend_below(ax: Axes) -> None:
    # Below the axes: the curves of a scaling plot fill the whole box.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)


def _ok(d: dict[str, Any]) -> bool:
    return "skipped" not in d and "error" not in d


def ingest(results: dict[str, Any], path: Path) -> Path | None:
    cases = results.get("ingest", {}).get("cases", [])
    if not cases:
        return None
    with _figure() as (fig, (ax,)):
        for name in ("kvindex", "naive"):
            points = [(c["instances"], c[name]["per_s"] / 1e6) for c in cases if _ok(c[name])]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", color=_COLOR[name], label=_LABEL[name])
        counts = [c["instances"] for c in cases]
        target = [3 * c["naive"]["per_s"] / 1e6 for c in cases]  # issue 13: 3x naive
        ax.plot(counts, target, color=_COLOR["target"], linestyle="--", linewidth=1, label="target")
        ax.set_xscale("log", base=2)
        _ticks(ax, [c["instances"] for c in cases])
        ax.set_xlabel("instances")
        ax.set_ylabel("M block events / s")
        ax.set_ylim(bottom=0)
        ax.set_title("Ingest in process (decode + apply), steady state")
        _legend_below(ax)
        return _save(fig, path)


def _latency_panel(ax: Axes, cases: list[dict[str, Any]], x_key: str) -> None:
    for name in ("kvindex", "naive", "dynamo"):
        points = [(c[x_key], c[name]["lookup"]) for c in cases if "lookup" in c[name]]
        if not points:
            continue
        xs = [x for x, _ in points]
        ax.plot(
            xs,
            [lat["p99_us"] for _, lat in points],
            marker="o",
            color=_COLOR[name],
            label=f"{_LABEL[name]} p99",
        )
        if name == "kvindex":
            ax.plot(
                xs,
                [lat["p50_us"] for _, lat in points],
                marker="o",
                linestyle=":",
                color=_COLOR[name],
                label="kvindex p50",
            )
    _target(ax, 100.0, "target p99 100 us")
    ax.axhline(30.0, color=_COLOR["target"], linestyle=":", linewidth=1, label="target p50 30 us")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylabel("lookup latency, us")


def lookup(results: dict[str, Any], path: Path) -> Path | None:
    data = results.get("lookup", {})
    by_instances, by_entries = data.get("instances", []), entries_curve(data)
    if not by_instances and not by_entries:
        return None
    with _figure(columns=2) as (fig, (left, right)):
        _latency_panel(left, by_instances, "instances")
        left.set_xscale("log", base=2)
        _ticks(left, [c["instances"] for c in by_instances])
        left.set_xlabel("instances")
        left.set_title("Lookup of a 512-block prompt, by instances")
        _latency_panel(right, by_entries, "entries")
        _ticks(right, [c["entries"] for c in by_entries])
        right.set_xlabel("(instance, block) entries")
        right.set_title("... by entries")
        handles, labels = left.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=3, bbox_to_anchor=(0.5, -0.12))
        fig.tight_layout()
        return _save(fig, path)


def memory(results: dict[str, Any], path: Path) -> Path | None:
    cases = entries_curve(results.get("lookup", {}))
    if not cases:
        return None
    with _figure() as (fig, (ax,)):
        for name in ("kvindex", "naive", "dynamo"):
            points = [(c["entries"], c[name]["bytes_per_entry"]) for c in cases if _ok(c[name])]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", color=_COLOR[name], label=_LABEL[name])
        ax.set_xscale("log")
        _ticks(ax, [c["entries"] for c in cases])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("(instance, block) entries")
        ax.set_ylabel("bytes per entry (RSS delta)")
        ax.set_title("Memory per (instance, block) entry (target: at most Dynamo's)")
        _legend_below(ax)
        return _save(fig, path)


def render_all(results: dict[str, Any], directory: Path) -> list[Path]:
    """Write every figure there is data for into `directory`; their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    figures = (
        (ingest, "ingest_scaling.png"),
        (lookup, "lookup_scaling.png"),
        (memory, "memory.png"),
    )
    out = []
    for draw, name in figures:
        path = draw(results, directory / name)
        if path is not None:
            out.append(path)
    return out
