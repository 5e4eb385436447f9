"""Following interop drivers with kvindex's own Subscriber into a FleetIndex."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvindex.index import FleetIndex
from kvindex.subscriber import SourceKey, Subscriber


def run_until(
    sub: Subscriber, index: FleetIndex, done: Callable[[], bool], timeout: float
) -> list[Any]:
    """Feed everything the subscriber produces into the index until `done()` or timeout."""
    items: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done():
        for item in sub.poll(0.05):
            index.handle(item)
            items.append(item)
    return items


def caught_up(sub: Subscriber, name: str, batches: int) -> bool:
    """The subscriber applied all `batches` of that instance and is not replaying."""
    stats = sub.stats(SourceKey(name))
    return stats.last_seq == batches - 1 and not sub._sources[SourceKey(name)].state.replaying
