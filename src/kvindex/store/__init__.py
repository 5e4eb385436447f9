"""`kvindex.store`: where the fleet's state persists (memory, SQLite, Redis)."""

from __future__ import annotations

from pathlib import Path

from kvindex.store.base import LoadResult, MemoryStore, Store
from kvindex.store.sqlite_db import StoreError

__all__ = ["DEFAULT_STORE_URL", "LoadResult", "MemoryStore", "Store", "StoreError", "open_store"]

DEFAULT_STORE_URL = "sqlite:///kvindex.sqlite"


def open_store(url: str) -> Store:
    """A store for `memory`, `sqlite:///PATH` (relative) or `sqlite:////ABS/PATH`, or
    `redis://HOST:PORT/DB`. Raises StoreError with a one-line reason."""
    if url == "memory":
        return MemoryStore()
    if url.startswith("sqlite:///"):
        from kvindex.store.sqlite import SQLiteStore

        path = url[len("sqlite:///") :]
        if not path:
            raise StoreError(f"store URL {url!r} has no path (sqlite:///PATH)")
        return SQLiteStore(Path(path))
    if url.startswith("redis://"):
        try:
            from kvindex.store.redis import RedisStore  # type: ignore[import-not-found]
        except ImportError:
            raise StoreError("the Redis store is not available in this build") from None
        store: Store = RedisStore(url)
        return store
    raise StoreError(f"unknown store URL {url!r} (memory, sqlite:///PATH, redis://HOST:PORT/DB)")
