"""A warm restart in a test: a stream of items through the SQLite store, back into an index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvindex.index import FleetIndex
from kvindex.store.protocol import AppliedBatch, Group, RestartMark
from kvindex.store.sqlite import SQLiteStore, WriterOptions
from kvindex.store.sqlite.writer import SQLiteWriter
from kvindex.subscriber import Delivery, Restarted
from kvindex.wire.publisher import encode_batch


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
