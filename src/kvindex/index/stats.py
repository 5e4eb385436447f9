"""Counters and windowed rates of cache activity."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, fields


@dataclass(slots=True)
class CacheStats:
    """The classic counters: blocks stored, removed, clears, and blocks active now."""

    stored: int = 0
    removed: int = 0
    clears: int = 0
    batches: int = 0
    restarts: int = 0
    active: int = 0
    # How the index placed what it holds (see `FleetIndex`): blocks held with no place in
    # the prefix tree (no tokens, an unknown parent, a skipped position); blocks whose
    # extra keys had a shape this version doesn't know; unkeyed lower-tier stores that kept
    # the namespace of the publisher's other copy; entries moved when a keyed copy came.
    unplaced: int = 0
    unrecognised_keys: int = 0
    namespace_kept: int = 0
    namespace_moved: int = 0

    def merge(self, other: CacheStats) -> None:
        for f in fields(self):
            name = f.name
            setattr(self, name, getattr(self, name) + getattr(other, name))


class RateWindow:
    """Stores, removes and clears over a sliding window, in one-second buckets. Ingest
    threads add while requests read: a lock keeps the buckets whole."""

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self._buckets: deque[list[float]] = deque()  # [second, stored, removed, clears]
        self._now = time.monotonic
        self._lock = threading.Lock()

    def add(self, stored: int, removed: int, clears: int, now: float | None = None) -> None:
        with self._lock:
            self._add(stored, removed, clears, now)

    def _add(self, stored: int, removed: int, clears: int, now: float | None) -> None:
        second = float(int(self._now() if now is None else now))
        buckets = self._buckets
        if buckets and buckets[-1][0] == second:
            bucket = buckets[-1]
            bucket[1] += stored
            bucket[2] += removed
            bucket[3] += clears
        else:
            buckets.append([second, stored, removed, clears])
            self._expire(second)

    def _expire(self, now: float) -> None:
        buckets = self._buckets
        while buckets and buckets[0][0] <= now - self.window:
            buckets.popleft()

    def per_minute(self, now: float | None = None) -> dict[str, float]:
        """Rates per minute over the window (or over the time covered, if shorter)."""
        t = self._now() if now is None else now
        with self._lock:
            self._expire(float(int(t)))
            stored = sum(b[1] for b in self._buckets)
            removed = sum(b[2] for b in self._buckets)
            clears = sum(b[3] for b in self._buckets)
        scale = 60.0 / self.window
        return {
            "stores_per_minute": stored * scale,
            "removes_per_minute": removed * scale,
            "clears_per_minute": clears * scale,
            "net_growth_per_minute": (stored - removed) * scale,
            "window_seconds": self.window,
        }
