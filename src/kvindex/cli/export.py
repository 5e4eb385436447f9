"""`kvindex export --store URL [--format jsonl|csv] [--out FILE]`: every cached block.

One record per (instance, DP rank, KV cache group, medium, block hash), as of the store's
last committed batch, with the fields of the `cache_blocks` view. Safe while serve runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from kvindex.cli.common import UsageError
from kvindex.store import StoreError, read_store
from kvindex.store.rows import BlockRow
from kvindex.wire import render_hash

FIELDS = (
    "instance", "rank", "group_idx", "medium", "block_hash", "parent_hash", "token_ids",
    "block_size", "lora", "copies", "stored_at",
)  # fmt: skip


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="print every block a store holds (jsonl or csv)",
        description="Print every cached block a store holds, one record per (instance, DP "
        "rank, KV cache group, medium, block hash), as of its last committed batch. Safe "
        "while serve runs.",
    )
    p.add_argument("--store", required=True, metavar="URL", help="sqlite:///PATH or redis://...")
    p.add_argument(
        "--format", choices=("jsonl", "csv"), default="jsonl", help="output format (jsonl)"
    )
    p.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    p.set_defaults(run=run)


def record(row: BlockRow) -> dict[str, Any]:
    return {
        "instance": row.source.instance,
        "rank": row.source.rank,
        "group_idx": row.group,
        "medium": row.medium,
        "block_hash": render_hash(row.block_hash),
        "parent_hash": None if row.parent_hash is None else render_hash(row.parent_hash),
        "token_ids": row.token_ids,
        "block_size": row.block_size,
        "lora": row.lora_name,
        "copies": row.copies,
        "stored_at": row.stored_at,
    }


def sorted_rows(rows: Iterable[BlockRow]) -> list[BlockRow]:
    return sorted(rows, key=lambda r: (r.source, r.group, r.medium, r.stored_at))


@contextmanager
def _output(path: str | None) -> Iterator[TextIO]:
    if path is None:
        yield sys.stdout
        return
    try:
        f = open(path, "w", newline="", encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise UsageError(f"can't write {path}: {exc.strerror}") from None
    with f:
        yield f


def run(args: argparse.Namespace) -> int:
    try:
        rows, _ = read_store(args.store)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    with _output(args.out) as out:
        if args.format == "jsonl":
            for row in sorted_rows(rows):
                out.write(json.dumps(record(row), separators=(",", ":")) + "\n")
        else:
            writer = csv.DictWriter(out, fieldnames=FIELDS)
            writer.writeheader()
            for row in sorted_rows(rows):
                rec = record(row)
                rec["token_ids"] = (
                    "" if rec["token_ids"] is None else " ".join(map(str, rec["token_ids"]))
                )
                writer.writerow(rec)
    return 0
