"""A SQLite store's snapshot into the compiled index in C, without the GIL (`_snapload.c`).

The same batches as the Python loader (kvindex.store.snapshot's `replay`, the reference),
applied in the same order, so the index it makes is the same; it only does the work where
it leaves the GIL to other threads (serve imports its web stack meanwhile). `load_in_c`
answers None when it can't do it, and the caller loads in Python: the pure index, an
extension not built (no libsqlite3 headers at install), or a snapshot it does not take
as the reference would (it then applied nothing).

`KVINDEX_SNAPSHOT_LOAD=python` makes every load take the Python path (A/B and tests).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

from kvindex.index import FleetIndex
from kvindex.subscriber.messages import SourceKey

__all__ = ["available", "load_in_c"]

log = logging.getLogger("kvindex.store")


def _module() -> ModuleType | None:
    if os.environ.get("KVINDEX_SNAPSHOT_LOAD") == "python":
        return None
    try:
        from kvindex.store.sqlite import _snapload  # type: ignore[attr-defined]
    except ImportError:
        return None
    module: ModuleType = _snapload
    return module


def available(index: FleetIndex) -> bool:
    """Whether `load_in_c` can load into `index`."""
    return _module() is not None and hasattr(index, "register_publisher")


def load_in_c(path: Path | str, index: FleetIndex) -> int | None:
    """Load the snapshot of the store at `path` into `index` (nothing of it loaded yet);
    the blocks it holds, or None if it must be loaded in Python (nothing applied then).
    Raises what the Python loader raises for the batches it is handed back (WireError), and
    sqlite3's errors."""
    module = _module()
    register = getattr(index, "register_publisher", None)
    if module is None or register is None:
        return None
    capsule, core = index.ingest_api()  # type: ignore[attr-defined]

    def bit(instance: str, rank: int) -> int | tuple[int, int]:
        """The publisher's bit (with an index in shards: its bit and its shard)."""
        number: int | tuple[int, int] = register(SourceKey(instance, rank))
        return number

    answer = module.load(str(path), capsule, core, bit)
    if answer[0] == "fallback":
        log.debug("the snapshot is loaded in Python: %s", answer[1])
        return None
    _, sources, rest = answer
    blocks = 0
    for instance, rank, held, ts, counts, applied in sources:
        blocks += held
        if applied:
            index.applied_in_c(SourceKey(instance, rank), None, ts, counts)  # type: ignore[attr-defined]
    for instance, rank, payload in rest:  # batches the fast parser left to Python, in order
        index.apply_payload(SourceKey(instance, rank), payload)
    return blocks
