"""`kvindex.store`: where the fleet's state persists (memory, SQLite, Redis)."""

from __future__ import annotations

from pathlib import Path

from kvindex.store.base import LoadResult, MemoryStore, SharedStore, Store, StoreError
from kvindex.store.rows import BlockRow

__all__ = [
    "DEFAULT_STORE_URL",
    "LoadResult",
    "MemoryStore",
    "SharedStore",
    "Store",
    "StoreError",
    "open_store",
    "read_store",
]

DEFAULT_STORE_URL = "sqlite:///kvindex.sqlite"


def open_store(url: str) -> Store:
    """A store for `memory`, `sqlite:///PATH[?synchronous=full]` (relative) or
    `sqlite:////ABS/PATH`, or `redis://HOST:PORT/DB`. Raises StoreError with a one-line
    reason."""
    if url == "memory":
        return MemoryStore()
    if url.startswith("sqlite:///"):
        from kvindex.store.sqlite import SQLiteStore, WriterOptions

        path, _, query = url[len("sqlite:///") :].partition("?")
        if not path:
            raise StoreError(f"store URL {url!r} has no path (sqlite:///PATH)")
        return SQLiteStore(Path(path), WriterOptions(synchronous=_synchronous(url, query)))
    if url.startswith(("redis://", "redis+sentinel://")):
        from kvindex.store.redis import RedisStore

        return RedisStore(url)
    raise StoreError(f"unknown store URL {url!r} (memory, sqlite:///PATH, redis://HOST:PORT/DB)")


def _synchronous(url: str, query: str) -> str:
    """A SQLite URL's one option: `synchronous=normal` (the default) or `full`."""
    if not query:
        return "normal"
    key, _, value = query.partition("=")
    if key != "synchronous" or value not in ("normal", "full"):
        raise StoreError(
            f"store URL {url!r}: the only option is synchronous=normal|full, not {query!r}"
        )
    return value


def read_store(url: str) -> tuple[list[BlockRow], LoadResult]:
    """Every block a store holds now, and its checkpoints: offline, without a service
    (safe while one runs). Raises StoreError."""
    if url.startswith("sqlite:///") and url != "sqlite:///":
        from kvindex.store.sqlite import current_rows

        path, _, query = url[len("sqlite:///") :].partition("?")
        _synchronous(url, query)  # a reader writes nothing: the option is only checked
        return current_rows(Path(path))
    if url.startswith(("redis://", "redis+sentinel://")):
        from kvindex.store.redis import current_rows as redis_rows

        return redis_rows(url)
    if url == "memory":
        raise StoreError("the memory store keeps nothing to read (use sqlite:///PATH or redis://)")
    open_store(url)  # raises the precise error for a malformed URL
    raise StoreError(f"cannot read store {url!r}")
