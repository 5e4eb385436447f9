"""Time binning and thinning of the tracker's per-batch series, for tables and plots."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["bin_sum", "bin_width", "histogram", "log_edges", "percentile", "thin_steps"]

_NICE = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800)
_HOUR = 3600.0
_MIN_SECONDS = 1e-3

Floats = npt.NDArray[np.float64]


def bin_width(duration: float, max_bins: int = 120) -> float:
    """A round bin width (seconds) giving at most `max_bins` bins over `duration`."""
    for width in _NICE:
        if duration / width <= max_bins:
            return float(width)
    hours = 1.0
    while duration / (hours * _HOUR) > max_bins:
        hours *= 2
    return hours * _HOUR


def bin_sum(t: Sequence[float], values: Sequence[int], t0: float, width: float, n: int) -> Floats:
    """Sums of `values` per bin of `width` seconds from `t0` (n bins)."""
    if not len(t):
        return np.zeros(n, dtype=np.float64)
    idx = ((np.asarray(t, dtype=np.float64) - t0) // width).astype(np.int64)
    idx = np.clip(idx, 0, n - 1)
    sums = np.bincount(idx, weights=np.asarray(values, dtype=np.float64), minlength=n)
    return sums[:n].astype(np.float64)


def thin_steps(
    t: Sequence[float], v: Sequence[int], max_points: int = 1500
) -> tuple[list[float], list[int]]:
    """A step series cut to at most about `max_points` points: per time bucket, the last
    value and the bucket's peak (so a short peak stays visible)."""
    if len(t) <= max_points:
        return list(t), list(v)
    ts, vs = np.asarray(t, dtype=np.float64), np.asarray(v, dtype=np.int64)
    buckets = max_points // 2
    edges = np.linspace(ts[0], ts[-1], buckets + 1)
    idx = np.clip(np.searchsorted(edges, ts, side="right") - 1, 0, buckets - 1)
    order = np.argsort(idx, kind="stable")
    starts = np.flatnonzero(np.diff(idx[order], prepend=-1))
    ends = np.append(starts[1:], len(order))
    keep: set[int] = set()
    for start, end in zip(starts, ends, strict=True):
        sel = order[start:end]
        keep.add(int(sel[np.argmax(vs[sel])]))
        keep.add(int(sel[-1]))
    chosen = sorted(keep)
    return [float(ts[i]) for i in chosen], [int(vs[i]) for i in chosen]


def log_edges(lows: Sequence[float], highs: Sequence[float], bins: int = 40) -> list[float]:
    """Log-spaced histogram edges covering every series (values under 1 ms count as 1 ms)."""
    if not lows:
        return []
    lo, hi = max(min(lows), _MIN_SECONDS), max(max(highs), _MIN_SECONDS)
    if hi <= lo * 1.01:
        hi = lo * 1.5
    return [float(e) for e in np.geomspace(lo, hi, bins + 1)]


def histogram(values: Sequence[float], edges: Sequence[float]) -> list[int]:
    if not edges:
        return []
    v = np.maximum(np.asarray(values, dtype=np.float64), _MIN_SECONDS)
    counts, _ = np.histogram(v, bins=np.asarray(edges))
    return [int(c) for c in counts]


def percentile(values: Sequence[float], q: float) -> float | None:
    if not len(values):
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))
