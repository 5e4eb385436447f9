"""The SQLite file: schema, reading a warm start, and the writes of the writer process.

Tables (see docs/store.md):
- `log`: every applied batch as vLLM sent it (raw msgpack), plus restart and removal
  markers, in apply order. Appending one row per batch is what keeps persistence cheap.
- `sources`: per publisher, the next seq it needs, the checksum of the last batch applied
  (to recognise a restarted engine on resume) and its lost-batch count.
- `runs`: the compacted state as of log row `meta.snapshot_log_id`, one row per run of
  blocks stored together (see snapshot.py): ready-encoded events for a fast load, and the
  blocks as JSON for SQL.
- `cache_blocks`: a view of `runs`, one row per block, for people and SQL tools.
- `instances`: instances added at runtime (POST /v1/instances), so they come back.

Schema 1 (kvindex before runs: one `blocks` row per block) is migrated in place the first
time the service or its writer opens the file; reading it (export, stats) works as is.

Nothing is written to a file before it is known to be a kvindex store (or new): a foreign
SQLite file is refused as it is, and a damaged one is named with what to do about it.
Seqs are whole numbers up to 2**64 - 1 and SQLite's integers stop at 2**63 - 1: the few
that don't fit are stored as 9-byte big-endian blobs (see `sql_seq`), read back exactly.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvindex.store.base import StoreError
from kvindex.store.rows import BlockRow, key_hash
from kvindex.subscriber.messages import SourceKey
from kvindex.subscriber.state import Checkpoint

if TYPE_CHECKING:
    from kvindex.store.snapshot import MirrorRow, SnapshotPlan, Stored

SCHEMA_VERSION = "2"

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
CREATE TABLE IF NOT EXISTS instances (name TEXT PRIMARY KEY, spec TEXT NOT NULL);
"""

# The snapshot (schema 2): one row per run, and a view with one row per block.
RUNS_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run INTEGER PRIMARY KEY,
    instance TEXT NOT NULL,
    rank INTEGER NOT NULL,
    grp INTEGER NOT NULL,
    medium TEXT NOT NULL,
    block_size INTEGER NOT NULL,
    lora_name TEXT,
    stored_at REAL NOT NULL,
    placed INTEGER NOT NULL,  -- 0 hash-only, 1 tokens but not in the prefix tree, 2 in it
    n_events INTEGER NOT NULL,
    keys BLOB NOT NULL,
    events BLOB NOT NULL,
    blocks TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_by_source ON runs (instance, rank);
CREATE VIEW IF NOT EXISTS cache_blocks AS
    SELECT r.instance, r.rank, r.grp AS group_idx, r.medium,
           json_extract(b.value, '$[0]') AS block_hash,
           json_extract(b.value, '$[1]') AS parent_hash,
           json_extract(b.value, '$[2]') AS token_ids, r.block_size, r.lora_name AS lora,
           json_extract(b.value, '$[3]') AS copies,
           datetime(r.stored_at, 'unixepoch') AS stored_at
    FROM runs AS r, json_each(r.blocks) AS b;
"""


SQLITE_HEADER = b"SQLite format 3\x00"
_MAX_SQL_INT = 2**63 - 1


def sql_seq(value: int) -> int | bytes:
    """A seq as SQLite can hold it exactly: an integer, or past 2**63 - 1 a 9-byte blob."""
    return value if value <= _MAX_SQL_INT else value.to_bytes(9, "big")


def seq_of(value: int | bytes | None) -> int:
    """A seq stored by `sql_seq`, back."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    return 0 if value is None else value


def damaged(path: Path | str, exc: BaseException) -> StoreError:
    """The one-line error for a store SQLite can't read, with what to do about it."""
    url = f"sqlite:///{path}"
    return StoreError(
        f"the store {path} is damaged ({exc}): see `kvindex store check {url}`, or set it "
        f"aside and start empty with `kvindex store check --reset {url}`"
    )


def read_failure(path: Path | str, exc: sqlite3.DatabaseError) -> StoreError:
    """A read that failed: the store is damaged, or (locked, unreadable) can't be read."""
    if isinstance(exc, sqlite3.OperationalError):
        return StoreError(f"cannot read SQLite store {path}: {exc}")
    return damaged(path, exc)


def check_ours(path: Path) -> None:
    """Refuse a file that is not a kvindex store (or empty, or new) without writing a byte
    to it: its first bytes, then its tables through a read-only connection."""
    try:
        with path.open("rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreError(f"cannot open SQLite store {path}: {exc.strerror or exc}") from None
    if not header:
        return  # empty: SQLite makes a new database of it
    if header != SQLITE_HEADER:
        raise StoreError(f"{path} is not a kvindex store (not an SQLite file)")
    try:
        ro = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = ro.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        finally:
            ro.close()
    except sqlite3.OperationalError as exc:
        raise StoreError(f"cannot open SQLite store {path}: {exc}") from None
    except sqlite3.DatabaseError as exc:
        raise damaged(path, exc) from None
    tables = {r[0] for r in rows}
    if tables and "meta" not in tables:
        raise StoreError(f"{path} is not a kvindex store (it has other tables)")


SYNCHRONOUS = ("normal", "full")  # `?synchronous=`: see docs/store.md


def connect(
    path: Path | str, *, create: bool = True, synchronous: str = "normal"
) -> sqlite3.Connection:
    """Open (with `create`: create or migrate) a store; StoreError with a one-line reason.
    `synchronous`: "normal" (a commit survives the process's death, kill -9, not a power
    loss) or "full" (it survives a power loss too: an fsync per commit)."""
    if synchronous not in SYNCHRONOUS:
        raise StoreError(f"synchronous={synchronous!r}: expected normal or full")
    path = Path(path)
    if not create and not path.exists():
        raise StoreError(f"no store at {path}")
    check_ours(path)
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        db.execute("PRAGMA busy_timeout=30000")
        if create:
            db.executescript(SCHEMA)
            db.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema', ?), ('snapshot_log_id', '0')",
                (SCHEMA_VERSION,),
            )
        version = schema_version(db, path)
        if create and version == "1":
            _migrate_v1(db)
        elif create:
            db.executescript(RUNS_SCHEMA)
    except sqlite3.OperationalError as exc:
        raise StoreError(f"cannot open SQLite store {path}: {exc}") from None
    except sqlite3.DatabaseError as exc:
        raise damaged(path, exc) from None
    except OSError as exc:
        raise StoreError(f"cannot open SQLite store {path}: {exc.strerror or exc}") from None
    return db


def schema_version(db: sqlite3.Connection, path: Path | str = "") -> str:
    """ "2", or "1" (an older store, still readable); StoreError for anything else."""
    try:
        row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    except sqlite3.Error:
        raise StoreError(f"{path} is not a kvindex store") from None
    if row is None or row[0] not in (SCHEMA_VERSION, "1"):
        raise StoreError(
            f"{path}: unsupported store schema {row and row[0]!r} (written by a newer kvindex?)"
        )
    return str(row[0])


def _migrate_v1(db: sqlite3.Connection) -> None:
    """Schema 1 -> 2: the `blocks` rows become runs, in one transaction (the log, the
    checkpoints and the snapshot's log position stay as they are)."""
    from kvindex.store.mirror import Mirror
    from kvindex.store.rows import events_from_rows
    from kvindex.store.snapshot import plan_changes

    mirror = Mirror()
    for source, batch in events_from_rows(read_blocks_v1(db)):
        mirror.apply_batch(source, batch)
    changes = mirror.take()
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("DROP VIEW IF EXISTS cache_blocks")
        db.execute("DROP TABLE blocks")
        for statement in RUNS_SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        write_snapshot(db, changes.removed, changes.cleared, plan_changes(mirror, changes, True))
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (SCHEMA_VERSION,))
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def snapshot_log_id(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM meta WHERE key = 'snapshot_log_id'").fetchone()
    return int(row[0]) if row else 0


def read_runs(db: sqlite3.Connection) -> Iterator[tuple[str, int, Stored]]:
    """Every run record, oldest first, as the loader needs it (see snapshot.replay)."""
    cursor = db.execute(
        "SELECT instance, rank, placed, keys, events, n_events, stored_at FROM runs ORDER BY run"
    )
    for instance, rank, placed, keys, events, n, ts in cursor:
        yield instance, rank, (placed, keys, events, n, ts)


def read_mirror_runs(db: sqlite3.Connection) -> Iterator[tuple[str, int, MirrorRow]]:
    """Every run record, oldest first, as a mirror loads it (see snapshot.load_runs)."""
    cursor = db.execute(
        "SELECT instance, rank, run, placed, grp, medium, block_size, lora_name, stored_at,"
        " keys, events, n_events FROM runs ORDER BY run"
    )
    for instance, rank, *record in cursor:
        yield instance, rank, tuple(record)  # type: ignore[misc]


def write_snapshot(
    db: sqlite3.Connection,
    removed: set[str],
    cleared: set[SourceKey],
    plans: dict[SourceKey, SnapshotPlan],
) -> None:
    """The writes of a snapshot (inside the caller's transaction): the records of removed
    instances and cleared publishers go, then each publisher's plan."""
    for name in removed:
        db.execute("DELETE FROM runs WHERE instance = ?", (name,))
    for source in cleared:
        db.execute("DELETE FROM runs WHERE instance = ? AND rank = ?", source)
    db.executemany(
        "DELETE FROM runs WHERE run = ?", [(i,) for plan in plans.values() for i in plan.deletes]
    )
    db.executemany(
        "INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        [
            (r.id, source[0], source[1], r.group, r.medium, r.size, r.lora, r.ts, r.rank,
             r.n_events, r.keys, r.events, r.blocks_json)
            for source, plan in plans.items()
            for r in plan.records
        ],
    )  # fmt: skip


def read_blocks_v1(db: sqlite3.Connection) -> Iterator[BlockRow]:
    """The snapshot of a schema 1 store, one row per block."""
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
    return {SourceKey(i, r): Checkpoint(seq_of(n), d, seq_of(lost)) for i, r, n, d, lost in rows}


def read_instances(db: sqlite3.Connection) -> dict[str, str]:
    return dict(db.execute("SELECT name, spec FROM instances"))
