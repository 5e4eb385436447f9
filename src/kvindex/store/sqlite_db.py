"""The SQLite file: schema, reading a warm start, and the writes of the writer process.

Tables (see docs/store.md):
- `log`: every applied batch as vLLM sent it (raw msgpack), plus restart and removal
  markers, in apply order. Appending one row per batch is what keeps persistence cheap.
- `sources`: per publisher, the next seq it needs, the checksum of the last batch applied
  (to recognise a restarted engine on resume) and its lost-batch count.
- `blocks`: the compacted state as of log row `meta.snapshot_log_id`: one row per
  (publisher, group, medium, hash) with its copies, parent, tokens, block size and LoRA.
- `cache_blocks`: a view of `blocks` for people and SQL tools (hashes as text).
- `instances`: instances added at runtime (POST /v1/instances), so they come back.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import msgspec

from kvindex.store.rows import BlockRow, hash_key, key_hash
from kvindex.subscriber.messages import SourceKey
from kvindex.subscriber.state import Checkpoint
from kvindex.wire import render_hash

SCHEMA_VERSION = "1"

KIND_BATCH, KIND_RESTART, KIND_REMOVE = 0, 1, 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sources (
    instance TEXT NOT NULL,
    rank INTEGER NOT NULL,
    next_seq INTEGER NOT NULL,
    last_digest INTEGER,
    lost_since_restart INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (instance, rank)
);
CREATE TABLE IF NOT EXISTS log (
    id INTEGER PRIMARY KEY,
    instance TEXT NOT NULL,
    rank INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    seq INTEGER,
    payload BLOB
);
CREATE TABLE IF NOT EXISTS blocks (
    instance TEXT NOT NULL,
    rank INTEGER NOT NULL,
    grp INTEGER NOT NULL,
    medium TEXT NOT NULL,
    hkey BLOB NOT NULL,
    block_hash TEXT NOT NULL,
    parent_key BLOB,
    parent_hash TEXT,
    token_ids TEXT,
    block_size INTEGER NOT NULL,
    lora_name TEXT,
    copies INTEGER NOT NULL,
    stored_at REAL,
    PRIMARY KEY (instance, rank, grp, medium, hkey)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS instances (name TEXT PRIMARY KEY, spec TEXT NOT NULL);
CREATE VIEW IF NOT EXISTS cache_blocks AS
    SELECT instance, rank, grp AS group_idx, medium, block_hash, parent_hash, token_ids,
           block_size, lora_name AS lora, copies,
           datetime(stored_at, 'unixepoch') AS stored_at
    FROM blocks;
"""


class StoreError(RuntimeError):
    """The store can't be opened or used; the message says why, in one line."""


def connect(path: Path | str, *, create: bool = True) -> sqlite3.Connection:
    path = Path(path)
    if not create and not path.exists():
        raise StoreError(f"no store at {path}")
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=30000")
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "meta" not in tables:
            db.close()
            raise StoreError(f"{path} is not a kvindex store (it has other tables)")
        if create:
            db.executescript(SCHEMA)
            db.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema', ?), ('snapshot_log_id', '0')",
                (SCHEMA_VERSION,),
            )
        _check_schema(db, path)
    except (sqlite3.Error, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise StoreError(f"cannot open SQLite store {path}: {reason}") from None
    return db


def _check_schema(db: sqlite3.Connection, path: Path) -> None:
    try:
        row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    except sqlite3.Error:
        raise StoreError(f"{path} is not a kvindex store") from None
    if row is None or row[0] != SCHEMA_VERSION:
        raise StoreError(f"{path}: unsupported store schema {row and row[0]!r}")


def snapshot_log_id(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM meta WHERE key = 'snapshot_log_id'").fetchone()
    return int(row[0]) if row else 0


def read_blocks(db: sqlite3.Connection) -> Iterator[BlockRow]:
    decode_tokens = msgspec.json.Decoder(list[int])
    cursor = db.execute(
        "SELECT instance, rank, grp, medium, hkey, parent_key, token_ids, block_size,"
        " lora_name, copies, stored_at FROM blocks"
    )
    for inst, rank, grp, medium, hkey, pkey, tokens, size, lora, copies, stored in cursor:
        yield BlockRow(
            SourceKey(inst, rank),
            grp,
            medium,
            key_hash(hkey),
            None if pkey is None else key_hash(pkey),
            None if tokens is None else decode_tokens.decode(tokens),
            size,
            lora,
            copies,
            stored or 0.0,
        )


def read_log(db: sqlite3.Connection, after: int) -> Iterator[tuple[int, str, int, int, int, bytes]]:
    yield from db.execute(
        "SELECT id, instance, rank, kind, seq, payload FROM log WHERE id > ? ORDER BY id", (after,)
    )


def read_checkpoints(db: sqlite3.Connection) -> dict[SourceKey, Checkpoint]:
    rows = db.execute(
        "SELECT instance, rank, next_seq, last_digest, lost_since_restart FROM sources"
    )
    return {SourceKey(i, r): Checkpoint(n, d, lost) for i, r, n, d, lost in rows}


def read_instances(db: sqlite3.Connection) -> dict[str, str]:
    return dict(db.execute("SELECT name, spec FROM instances"))


def block_row_values(row: BlockRow) -> tuple[object, ...]:
    """The `blocks` columns of a row, in INSERT order."""
    parent = row.parent_hash
    return (
        row.source.instance,
        row.source.rank,
        row.group,
        row.medium,
        hash_key(row.block_hash),
        render_hash(row.block_hash),
        None if parent is None else hash_key(parent),
        None if parent is None else render_hash(parent),
        None if row.token_ids is None else json.dumps(row.token_ids, separators=(",", ":")),
        row.block_size,
        row.lora_name,
        row.copies,
        row.stored_at,
    )


UPSERT_BLOCK = (
    "INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT (instance, rank, grp, medium, hkey) DO UPDATE SET copies = excluded.copies,"
    # a row first seen hash-only (an offload copy) gains its tokens when a store brings them
    " token_ids = coalesce(blocks.token_ids, excluded.token_ids),"
    " parent_key = CASE WHEN blocks.token_ids IS NULL THEN excluded.parent_key"
    " ELSE blocks.parent_key END,"
    " parent_hash = CASE WHEN blocks.token_ids IS NULL THEN excluded.parent_hash"
    " ELSE blocks.parent_hash END,"
    " block_size = CASE WHEN blocks.token_ids IS NULL THEN excluded.block_size"
    " ELSE blocks.block_size END"
)
