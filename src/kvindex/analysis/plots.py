"""The report's figures, drawn with matplotlib (Agg) as PNG bytes.

Each function takes the `Report` and returns a PNG, or None when there is nothing to draw.
One colour per source throughout the report (`colors`), so a reader can follow an
instance from figure to figure.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, PercentFormatter

from kvindex.analysis.report import Report

__all__ = ["FIGURES", "STYLE", "colors", "render_all"]

_PALETTE = (
    "#4C72B0",
    "#DD8452",
    "#55A868",
    "#C44E52",
    "#8172B3",
    "#937860",
    "#DA8BC3",
    "#8C8C8C",
    "#CCB974",
    "#64B5CD",
)
_MEDIUM_STYLE: dict[str, Any] = {"GPU": "-", "CPU": "--"}
STYLE: dict[str, Any] = {  # matplotlib rc settings; the bench's figures use them too
    "font.size": 9,
    "axes.titlesize": 10.5,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
    "axes.titlepad": 10,
    "axes.labelsize": 9,
    "axes.labelcolor": "#333333",
    "axes.edgecolor": "#B0B0B0",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#E6E6E6",
    "grid.linewidth": 0.8,
    "xtick.color": "#555555",
    "ytick.color": "#555555",
    "legend.frameon": False,
    "legend.fontsize": 8,
    "figure.dpi": 100,
    "savefig.dpi": 150,
}
_SIZE = (6.4, 3.3)


def colors(report: Report) -> dict[str, str]:
    return {row.name: _PALETTE[i % len(_PALETTE)] for i, row in enumerate(report.sources)}


@contextmanager
def _figure(rows: int = 1, height: float = _SIZE[1]) -> Iterator[tuple[Figure, list[Axes]]]:
    with plt.rc_context(cast(Any, STYLE)):
        fig, axes = plt.subplots(
            rows, 1, figsize=(_SIZE[0], height), sharex=rows > 1, squeeze=False
        )
        try:
            yield fig, [ax for (ax,) in axes]
        finally:
            plt.close(fig)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def _time_unit(duration: float) -> tuple[float, str]:
    if duration > 3 * 3600:
        return 3600.0, "hours"
    if duration > 600:
        return 60.0, "minutes"
    return 1.0, "seconds"


def _scaled(values: Sequence[float], unit: float) -> list[float]:
    return [v / unit for v in values]


def _titled(ax: Axes, title: str, legend: int = 0) -> None:
    """Title at the top left; a legend of `legend` entries between it and the plot."""
    if not legend:
        ax.set_title(title)
        return
    ncol = min(legend, 4)
    rows = -(-legend // ncol)
    ax.set_title(title, pad=8 + 15 * rows)
    ax.legend(
        loc="lower left",
        bbox_to_anchor=(0, 1.0),
        ncol=ncol,
        borderaxespad=0.3,
        handlelength=1.8,
        columnspacing=1.4,
    )


def _thousands(x: float, _: object) -> str:
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    if abs(x) >= 1e3:
        return f"{x / 1e3:g}k"
    return f"{x:g}"


def _counts_from_zero(*axes: Axes) -> None:
    """A y axis of counts: from 0, in thousands and millions."""
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(FuncFormatter(_thousands))


# -- figures ------------------------------------------------------------------------------


def occupancy(report: Report) -> bytes | None:
    if not any(report.occupancy.values()):
        return None
    unit, label = _time_unit(report.duration)
    palette = colors(report)
    with _figure() as (fig, (ax,)):
        n = 0
        for name, media in report.occupancy.items():
            for medium, steps in media.items():
                style = _MEDIUM_STYLE.get(medium, ":")
                ax.step(
                    _scaled(steps.t, unit),
                    steps.n,
                    where="post",
                    color=palette[name],
                    linestyle=style,
                    linewidth=1.4,
                    label=f"{name} · {medium}",
                )
                n += 1
        _titled(ax, "Blocks held over time", n)
        ax.set(xlabel=f"time ({label})", ylabel="blocks held")
        _counts_from_zero(ax)
        return _png(fig)


def rates(report: Report) -> bytes | None:
    r = report.rates
    if not r.stored:
        return None
    unit, label = _time_unit(report.duration)
    palette = colors(report)
    t = _scaled(r.t, unit)
    with _figure(2, 3.9) as (fig, (top, bottom)):
        for name in r.stored:
            color = palette[name]
            stored = [x / r.bin_seconds for x in r.stored[name]]
            removed = [x / r.bin_seconds for x in r.removed[name]]
            top.step(t, stored, where="post", color=color, linewidth=1.1, label=name)
            bottom.step(t, removed, where="post", color=color, linewidth=1.1)
        _titled(top, f"Store and remove rates (blocks/s, {r.bin_seconds:g} s bins)", len(r.stored))
        top.set_ylabel("stored")
        bottom.set(ylabel="removed", xlabel=f"time ({label})")
        _counts_from_zero(top, bottom)
        return _png(fig)


def restores(report: Report) -> bytes | None:
    r = report.rates
    if not report.restored_blocks:
        return None
    unit, label = _time_unit(report.duration)
    palette = colors(report)
    t = _scaled(r.t, unit)
    width = r.bin_seconds / unit
    with _figure() as (fig, (ax,)):
        base = [0.0] * len(t)
        for name, values in r.restored_tokens.items():
            ax.bar(
                t,
                values,
                width=width,
                bottom=base,
                align="edge",
                color=palette[name],
                label=name,
                linewidth=0,
            )
            base = [b + v for b, v in zip(base, values, strict=True)]
        _titled(ax, "Recompute waste: tokens re-stored after eviction", len(r.restored_tokens))
        ax.set(xlabel=f"time ({label})", ylabel=f"tokens per {r.bin_seconds:g} s")
        ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
        return _png(fig)


def routing(report: Report) -> bytes | None:
    rows = [row for row in report.sources if row.restored_tokens]
    if not rows:
        return None
    with _figure(height=0.9 + 0.42 * len(rows)) as (fig, (ax,)):
        names = [row.name for row in rows]
        held = [row.routable_tokens for row in rows]
        nowhere = [row.restored_tokens - row.routable_tokens for row in rows]
        ax.barh(names, held, color="#55A868", label="held by another instance")
        ax.barh(names, nowhere, left=held, color="#C9CCD1", label="held nowhere")
        for i, row in enumerate(rows):
            ax.text(
                row.restored_tokens,
                i,
                f"  {row.routable_share:.0%} routable",
                va="center",
                fontsize=8,
                color="#333333",
            )
        ax.invert_yaxis()
        _titled(ax, "What KV-aware routing would have saved (re-stored tokens)", 2)
        ax.set_xlabel("tokens re-stored")
        ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
        ax.grid(axis="y", visible=False)
        ax.set_xlim(right=max(row.restored_tokens for row in rows) * 1.25)
        return _png(fig)


def lifetimes(report: Report) -> bytes | None:
    lt = report.lifetimes
    if not lt.edges or not any(sum(c) for c in lt.counts.values()):
        return None
    palette = colors(report)
    with _figure() as (fig, (ax,)):
        for name, counts in lt.counts.items():
            if sum(counts):
                ax.stairs(counts, lt.edges, color=palette[name], linewidth=1.5, label=name)
        ax.set_xscale("log")
        _titled(ax, "Block lifetime: store to eviction", len(lt.counts))
        ax.set(xlabel="seconds held (log scale)", ylabel="blocks")
        ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
        return _png(fig)


def whatif(report: Report) -> bytes | None:
    curves = {k: c for k, c in report.whatif.items() if c.accesses}
    if not curves:
        return None
    palette = colors(report)
    peaks = {row.name: row.peak_gpu_blocks for row in report.sources}
    with _figure(2, 4.6) as (fig, (top, bottom)):
        for name, c in curves.items():
            rate = [n / c.accesses for n in c.restores]
            top.plot(c.sizes, rate, color=palette[name], linewidth=1.5, label=name)
            if c.observed_restores:
                bottom.plot(
                    c.sizes,
                    [a / c.observed_restores for a in c.avoided],
                    color=palette[name],
                    linewidth=1.5,
                )
            peak = peaks.get(name, 0)
            if peak in c.sizes:
                i = c.sizes.index(peak)
                top.plot([peak], [rate[i]], "o", color=palette[name], markersize=5)
        _titled(top, "What-if: LRU cache size (dots: the observed capacity)", len(curves))
        top.set_ylabel("re-store rate")
        top.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        bottom.set_ylabel("observed re-stores\navoided")
        bottom.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        bottom.set_xlabel("cache size (blocks, log scale)")
        bottom.set_xscale("log")
        bottom.xaxis.set_major_formatter(FuncFormatter(_thousands))
        for ax in (top, bottom):
            ax.set_ylim(-0.02, 1.02 if ax is bottom else None)
        top.set_ylim(bottom=0)
        return _png(fig)


def prefixes(report: Report) -> bytes | None:
    top = report.prefixes.top[:12]
    if not top:
        return None
    with _figure(height=0.9 + 0.3 * len(top)) as (fig, (ax,)):
        labels = [
            f"#{i + 1}  {row.tokens if row.tokens is not None else '?'} tok · "
            f"{len(row.instances)} inst"
            for i, row in enumerate(top)
        ]
        values = [row.continuations for row in top]
        ax.barh(labels, values, color="#4C72B0")
        for i, v in enumerate(values):
            ax.text(v, i, f" {v}", va="center", fontsize=8, color="#333333")
        ax.invert_yaxis()
        _titled(ax, "Most shared prefixes (distinct sequences that continue them)")
        ax.set_xlabel("sequences sharing the prefix")
        ax.grid(axis="y", visible=False)
        ax.set_xlim(right=max(values) * 1.15)
        return _png(fig)


def duplication(report: Report) -> bytes | None:
    held, shared = report.duplication["held"], report.duplication["shared"]
    if len(report.sources) < 2 or not held.t:
        return None
    unit, label = _time_unit(report.duration)
    with _figure() as (fig, (ax,)):
        t_held, t_shared = _scaled(held.t, unit), _scaled(shared.t, unit)
        ax.step(
            t_held,
            held.n,
            where="post",
            color="#4C72B0",
            linewidth=1.4,
            label="distinct blocks held in the fleet",
        )
        ax.fill_between(
            t_shared,
            shared.n,
            step="post",
            color="#DD8452",
            alpha=0.55,
            linewidth=0,
            label="held on two or more instances",
        )
        _titled(ax, "Cross-instance duplication (GPU)", 2)
        ax.set(xlabel=f"time ({label})", ylabel="blocks")
        _counts_from_zero(ax)
        return _png(fig)


FIGURES: dict[str, Callable[[Report], bytes | None]] = {
    "occupancy": occupancy,
    "rates": rates,
    "restores": restores,
    "routing": routing,
    "lifetimes": lifetimes,
    "whatif": whatif,
    "prefixes": prefixes,
    "duplication": duplication,
}


def render_all(report: Report) -> dict[str, bytes]:
    """Every figure that has something to show, by name."""
    out: dict[str, bytes] = {}
    for name, draw in FIGURES.items():
        png = draw(report)
        if png is not None:
            out[name] = png
    return out
