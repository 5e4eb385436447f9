"""Following interop drivers with kvindex's own Subscriber into a FleetIndex."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvindex.index import FleetIndex
from kvindex.store.protocol import AppliedBatch, Group, RestartMark
from kvindex.store.sqlite import SQLiteStore, WriterOptions
from kvindex.store.sqlite.writer import SQLiteWriter
from kvindex.subscriber import Delivery, Restarted, SourceKey, Subscriber
from kvindex.wire.publisher import encode_batch


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


def restarted_through_store(items: list[Any], path: Path) -> FleetIndex:
    """What a warm restart gives: every item written through the SQLite store's writer
    (the code of its writer process, in process), compacted to a snapshot, loaded into a
    new index."""
    writer = SQLiteWriter(str(path), WriterOptions(0.01, 1e9, 1_000_000))
    try:
        for item in items:
            if isinstance(item, Delivery):
                payload = item.payload or encode_batch(item.batch.events, item.batch.ts)
                rank = item.source.rank
                writer.commit([Group(0, [AppliedBatch(item.instance, rank, item.seq, payload)])])
            elif isinstance(item, Restarted):
                writer.commit([Group(0, [RestartMark(item.source.instance, item.source.rank)])])
        writer.compact()
    finally:
        writer.close()
    index = FleetIndex()
    SQLiteStore(path).load(index)
    return index
