"""`kvindex stats --store URL [--json]`: what a store holds, per instance, offline."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

from kvindex.cli.common import UsageError
from kvindex.store import StoreError, read_store


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "stats",
        help="summarise what a store holds, per instance",
        description="Summarise what a store holds, offline: per instance, distinct blocks "
        "(by medium), copies, DP ranks and where each rank's stream continues.",
    )
    p.add_argument("--store", required=True, metavar="URL", help="sqlite:///PATH or redis://...")
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    p.set_defaults(run=run)


def summarise(url: str) -> dict[str, Any]:
    try:
        rows, loaded = read_store(url)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    per: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"blocks": set(), "by_medium": defaultdict(set), "copies": 0, "ranks": {}}
    )
    for row in rows:
        entry = per[row.source.instance]
        entry["blocks"].add(row.block_hash)
        entry["by_medium"][row.medium].add(row.block_hash)
        entry["copies"] += row.copies
    for source, checkpoint in loaded.checkpoints.items():
        per[source.instance]["ranks"][str(source.rank)] = {
            "next_seq": checkpoint.next_seq,
            "lost_since_restart": checkpoint.lost_since_restart,
        }
    instances = {
        name: {
            "blocks": len(e["blocks"]),
            "blocks_by_medium": {m: len(h) for m, h in sorted(e["by_medium"].items())},
            "copies": e["copies"],
            "ranks": e["ranks"],
            "incomplete": any(r["lost_since_restart"] for r in e["ranks"].values()),
        }
        for name, e in sorted(per.items())
    }
    return {
        "store": url,
        "instances": instances,
        "total_blocks": sum(i["blocks"] for i in instances.values()),
        "log_batches_not_compacted": loaded.log_batches_replayed,
        "instances_added_at_runtime": sorted(loaded.instances),
    }


def run(args: argparse.Namespace) -> int:
    summary = summarise(args.store)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvindex store {args.store}")
    for col in ("instance", "blocks", "by medium", "copies", "next seq per rank", "state"):
        table.add_column(col)
    for name, info in summary["instances"].items():
        media = ", ".join(f"{m} {n}" for m, n in info["blocks_by_medium"].items())
        seqs = ", ".join(f"{r}:{v['next_seq']}" for r, v in info["ranks"].items())
        state = "incomplete" if info["incomplete"] else "complete"
        table.add_row(name, str(info["blocks"]), media, str(info["copies"]), seqs, state)
    console = Console()
    console.print(table)
    console.print(
        f"{summary['total_blocks']} blocks; {summary['log_batches_not_compacted']} logged batches"
        " not yet in the snapshot"
    )
    return 0
