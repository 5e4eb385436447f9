"""Keep an SQLite table of the blocks a vLLM instance holds, as it changes.

    python examples/sqlite_backup.py tcp://HOST:5557 --replay tcp://HOST:5558 --db kv.sqlite
    sqlite3 kv.sqlite 'SELECT block_hash, lora_name, copies FROM blocks LIMIT 5'

One row per (instance, DP rank, KV group, medium, block hash); `copies` counts the physical
copies vLLM announced, so removing one copy of a duplicated block keeps the row. Hashes are
text as kvindex writes them (an int as decimal, a digest as hex). The subscriber's checkpoint
is saved in the same transaction as the rows, so a restarted backup resumes where it
stopped (and the subscriber tells us if the engine restarted meanwhile).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import time

from _common import add_endpoint_options, add_stop_options, follow, show_notice

from kvindex import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Checkpoint,
    Delivery,
    Lost,
    Notice,
    Restarted,
    SourceKey,
    Subscriber,
    render_hash,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    instance    TEXT NOT NULL,
    dp_rank     INTEGER NOT NULL,
    group_idx   INTEGER NOT NULL,      -- KV cache group (0 unless a hybrid model)
    medium      TEXT NOT NULL,         -- GPU unless the event says otherwise
    block_hash  TEXT NOT NULL,
    parent_hash TEXT,                  -- NULL for the first block of a prompt
    token_ids   TEXT,                  -- JSON list; NULL for hash-only (offload) events
    block_size  INTEGER,
    lora_name   TEXT,
    copies      INTEGER NOT NULL,
    stored_at   REAL NOT NULL,         -- the publisher's batch time
    PRIMARY KEY (instance, dp_rank, group_idx, medium, block_hash)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    instance TEXT NOT NULL, dp_rank INTEGER NOT NULL, next_seq INTEGER NOT NULL,
    last_digest INTEGER, PRIMARY KEY (instance, dp_rank)
);
"""

UPSERT = """
INSERT INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?)
ON CONFLICT DO UPDATE SET copies = copies + 1,
    token_ids = coalesce(token_ids, excluded.token_ids)
"""
KEY = "instance = ? AND dp_rank = ? AND group_idx = ? AND medium = ? AND block_hash = ?"


def store(db: sqlite3.Connection, src: SourceKey, event: BlockStored, ts: float) -> None:
    size = event.block_size
    parent = event.parent_block_hash
    for i, h in enumerate(event.block_hashes):
        tokens = event.token_ids[i * size : (i + 1) * size] if size else []
        db.execute(
            UPSERT,
            (
                *src,
                event.group_idx or 0,
                event.medium or "GPU",
                render_hash(h),
                None if parent is None else render_hash(parent),
                json.dumps(tokens) if tokens else None,
                size,
                event.lora_name,
                ts,
            ),
        )
        parent = h  # the chain: each block's parent is the block before it


def remove(db: sqlite3.Connection, src: SourceKey, event: BlockRemoved) -> None:
    for h in event.block_hashes:
        key = (*src, event.group_idx or 0, event.medium or "GPU", render_hash(h))
        db.execute(f"UPDATE blocks SET copies = copies - 1 WHERE {KEY}", key)
        db.execute(f"DELETE FROM blocks WHERE copies <= 0 AND {KEY}", key)


def clear(db: sqlite3.Connection, src: SourceKey) -> None:
    db.execute("DELETE FROM blocks WHERE instance = ? AND dp_rank = ?", src)


def apply(db: sqlite3.Connection, sub: Subscriber, item: Delivery) -> None:
    with db:  # one transaction per batch: rows and checkpoint change together
        for event in item.batch.events:
            if isinstance(event, BlockStored):
                store(db, item.source, event, item.batch.ts)
            elif isinstance(event, BlockRemoved):
                remove(db, item.source, event)
            elif isinstance(event, AllBlocksCleared):
                clear(db, item.source)
        save_checkpoint(db, item.source, sub.checkpoint(item.source))


def save_checkpoint(db: sqlite3.Connection, src: SourceKey, cp: Checkpoint) -> None:
    db.execute(
        "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?)",
        (*src, cp.next_seq, cp.last_digest),
    )


def load_checkpoints(db: sqlite3.Connection, name: str) -> dict[SourceKey, Checkpoint]:
    rows = db.execute(
        "SELECT dp_rank, next_seq, last_digest FROM checkpoints WHERE instance = ?", (name,)
    )
    return {SourceKey(name, rank): Checkpoint(seq, digest) for rank, seq, digest in rows}


def open_db(path: str, name: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")  # readers (sqlite3 CLI) don't block the writer
    db.execute("PRAGMA synchronous = NORMAL")
    db.executescript(SCHEMA)
    if not load_checkpoints(db, name):
        # Nothing to resume from: rows left by an earlier run can't be trusted.
        with db:
            db.execute("DELETE FROM blocks WHERE instance = ?", (name,))
    return db


def report(db: sqlite3.Connection, prefix: str = "") -> None:
    rows, copies = db.execute("SELECT count(*), coalesce(sum(copies), 0) FROM blocks").fetchone()
    at = time.strftime("%X")
    print(f"{prefix}{rows} blocks ({copies} copies) in the table at {at}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_endpoint_options(parser)
    parser.add_argument("--db", default="kvindex-backup.sqlite", help="SQLite file")
    add_stop_options(parser)
    args = parser.parse_args()
    db = open_db(args.db, args.name)
    resume = load_checkpoints(db, args.name)
    with Subscriber(args.endpoint, replay=args.replay, name=args.name, resume=resume) as sub:
        try:
            for item in follow(sub, args):
                match item:
                    case Delivery():
                        apply(db, sub, item)
                    case Restarted():  # a new engine: its cache is empty
                        show_notice(item)
                        with db:
                            clear(db, item.source)
                            save_checkpoint(db, item.source, sub.checkpoint(item.source))
                    case Lost():
                        show_notice(item)
                        print("! the table may now miss or keep blocks wrongly (incomplete)")
                    case Notice():
                        show_notice(item)
                    case None:
                        report(db)
        except KeyboardInterrupt:
            pass
    report(db, prefix="final: ")
    db.close()


if __name__ == "__main__":
    main()
