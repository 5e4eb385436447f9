"""`kvindex analyze`: why the caches hit and miss, from a recording (`kvindex record`).

Prints a summary; `--html` writes the full report (tables and plots, one self-contained
file) and `--json` its numbers. A recording without a single batch is refused in one line
(exit 2) rather than drawn as an empty report.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from kvindex.cli.common import UsageError, positive_int
from kvindex.recording import RecordingError

if TYPE_CHECKING:
    from kvindex.analysis import Report

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="analyse a recording: re-stores, prefixes, what-if cache sizes",
        description="Analyse a recording (kvindex record): blocks held, store/remove rates, "
        "lifetimes, recompute waste, prefix popularity, what-if cache sizes and routing.",
    )
    p.add_argument("file", metavar="FILE", help="recording file")
    p.add_argument("--html", metavar="REPORT.html", type=Path, help="write the HTML report")
    p.add_argument("--json", metavar="OUT.json", type=Path, help="write the numbers as JSON")
    p.add_argument(
        "--top", type=positive_int, default=15, metavar="N", help="shared prefixes listed"
    )
    p.set_defaults(run=run)


def _write(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise UsageError(f"can't write {path}: {exc.strerror or exc}") from None


def _nothing_to_analyse(path: str, report: Report) -> str:
    """Why an empty report is refused: what the file held instead of batches."""
    kinds: dict[str, int] = {}
    for counts in report.notices.values():
        for kind, n in counts.items():
            kinds[kind] = kinds.get(kind, 0) + n
    held = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "nothing"
    damage = f"; {report.damage}" if report.damage else ""
    return f"{path} holds no batches to analyse (notices: {held}{damage})"


def run(args: argparse.Namespace) -> int:
    # Imported here: matplotlib and numpy are only needed by this command.
    from kvindex.analysis import analyze
    from kvindex.analysis.summary import print_summary

    try:
        report = analyze(args.file, top=args.top)
    except RecordingError as exc:
        raise UsageError(str(exc)) from None
    if not report.batches:
        raise UsageError(_nothing_to_analyse(args.file, report))
    # The files first: the summary goes to a terminal or a pipe that may close early.
    written = []
    if args.json is not None:
        _write(args.json, report.to_json())
        written.append(f"numbers: {args.json}")
    if args.html is not None:
        from kvindex.analysis.html import render_html

        _write(args.html, render_html(report).encode())
        written.append(f"report: {args.html}")
    console = Console(highlight=False)
    print_summary(report, console)
    for line in written:
        console.print(line)
    return 0
