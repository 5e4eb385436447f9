"""`kvindex store check URL [--reset]`: is a SQLite store whole, and if not, set it aside.

`check` opens the file read-only: is it a kvindex store, does SQLite find it whole
(`PRAGMA integrity_check`), and can its snapshot and log be read back. It prints `ok` or
what is wrong (exit 0 / 1). With `--reset`, a store that is not whole is renamed
`PATH.damaged-TIME` (with its -wal and -shm files) so that the next `serve` starts empty
and catches up from the publishers; a store in use by a service is never touched.
"""

from __future__ import annotations

import argparse
import sqlite3
import time
from pathlib import Path
from typing import Any

from kvindex.cli.common import UsageError

__all__ = ["add_parser", "check", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "store",
        help="check a SQLite store, and set a damaged one aside",
        description="Check that a SQLite store is whole (read-only); with --reset, rename a "
        "damaged one so that the next serve starts empty.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True, help="check")
    c = verbs.add_parser("check", help="check a SQLite store (read-only)")
    c.add_argument("url", metavar="URL", help="sqlite:///PATH")
    c.add_argument(
        "--reset", action="store_true", help="if it is damaged, rename it PATH.damaged-TIME"
    )
    p.set_defaults(run=run)


def _path(url: str) -> Path:
    if not url.startswith("sqlite:///") or url == "sqlite:///":
        raise UsageError(f"{url!r}: only a SQLite store can be checked (sqlite:///PATH)")
    path = Path(url[len("sqlite:///") :])
    if not path.exists():
        raise UsageError(f"no store at {path}")
    return path


def check(path: Path) -> str | None:
    """What is wrong with the store at `path`, or None if it is whole."""
    from kvindex.store import StoreError, read_store

    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = [r[0] for r in db.execute("PRAGMA integrity_check")]
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return f"{path}: {exc}"
    if rows != ["ok"]:
        return f"{path}: " + "; ".join(rows[:3]) + (" ..." if len(rows) > 3 else "")
    try:
        read_store(f"sqlite:///{path}")
    except StoreError as exc:
        return str(exc)
    return None


def _set_aside(path: Path) -> Path:
    from kvindex.store import StoreError
    from kvindex.store.sqlite.owner import OwnerLock

    owner = OwnerLock(path)
    try:
        owner.acquire(orphan_wait=0)
    except StoreError as exc:
        raise UsageError(f"{exc}: not reset") from None
    try:
        aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        for suffix in ("-wal", "-shm", ""):
            part = path.with_name(path.name + suffix)
            if part.exists():
                part.rename(aside.with_name(aside.name + suffix))
        return aside
    finally:
        owner.release()


def run(args: argparse.Namespace) -> int:
    path = _path(args.url)
    problem = check(path)
    if problem is None:
        print(f"{path}: ok")
        return 0
    print(problem)
    if args.reset:
        aside = _set_aside(path)
        print(f"set aside as {aside}: the next serve starts empty and catches up")
        return 0
    return 1
