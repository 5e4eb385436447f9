"""`kvindex record`: follow publishers and write every batch to a recording file.

Every batch goes in gap-free (the Subscriber fills gaps from the replay endpoint), byte for
byte, with its instance, DP rank, seq and receive time, and so do the notices (restart,
lost batches, ...). Segments are flushed about once a second, so the file is readable up
to a second before any kill. Ctrl+C or SIGTERM: the last segment is written, exit 0. An
existing file is continued, from where each instance stopped if its replay still has it.
A new source starts at its next batch (`--from now`) or with its whole replay buffer
(`--from oldest`). A progress line every 10 s (`--progress`) says how it goes.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import zmq
from rich.console import Console

from kvindex.cli.common import UsageError, positive_int, positive_seconds
from kvindex.cli.signals import stop_signals
from kvindex.recording import RecordingError, Writer
from kvindex.recording.recorder import Limits, record
from kvindex.subscriber import Delivery, InstanceSpec, Item, SpecError

__all__ = ["PROGRESS_EVERY", "add_parser", "instance_specs", "run"]

PROGRESS_EVERY = 10.0  # seconds between two progress lines


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "record",
        help="record publishers' event streams to a file",
        description="Record every batch of vLLM KV-event publishers (gap-free, with seqs, "
        "receive times and raw payloads) to an appendable, zstd-compressed file.",
    )
    p.add_argument(
        "endpoint", nargs="*", metavar="ENDPOINT", help="PUB endpoint(s), e.g. tcp://host:5557"
    )
    p.add_argument(
        "--replay",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="replay endpoint, one per ENDPOINT in order",
    )
    p.add_argument("--topic", default="", help="topic for the ENDPOINTs (default: all)")
    p.add_argument("--dp", type=positive_int, default=1, metavar="N", help="DP ranks per ENDPOINT")
    p.add_argument("--name", default="vllm", help="instance name (several ENDPOINTs: NAME-i)")
    p.add_argument(
        "--instance",
        metavar="SPEC",
        action="append",
        default=[],
        help="NAME=PUB_ENDPOINT[,replay=EP][,topic=T][,dp=N]; repeatable",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="recording file (appended to)")
    p.add_argument(
        "--from",
        dest="start",
        choices=("now", "oldest"),
        default="now",
        help="now (default): start at each publisher's next batch; oldest: first take "
        "everything its replay buffer still holds. A source the file already has "
        "continues where the file stopped either way",
    )
    p.add_argument("--duration", type=positive_seconds, metavar="S", help="stop after S seconds")
    p.add_argument("--max-batches", type=positive_int, metavar="N", help="stop after N batches")
    p.add_argument(
        "--flush-interval",
        type=positive_seconds,
        default=1.0,
        metavar="S",
        help="write a segment at least every S seconds (default: 1)",
    )
    p.add_argument(
        "--progress",
        type=positive_seconds,
        default=PROGRESS_EVERY,
        metavar="S",
        help=f"seconds between two progress lines (default: {PROGRESS_EVERY:g})",
    )
    p.add_argument(
        "--quiet", action="store_true", help="no notices and no progress, only the summary"
    )
    p.set_defaults(run=run)


def instance_specs(args: argparse.Namespace) -> list[InstanceSpec]:
    """The instances to follow: positional endpoints, then --instance specs."""
    if len(args.replay) > max(len(args.endpoint), 1) or (args.replay and not args.endpoint):
        raise UsageError("give at most one --replay per ENDPOINT")
    several = len(args.endpoint) > 1
    specs: list[InstanceSpec] = []
    try:
        for i, endpoint in enumerate(args.endpoint):
            name = f"{args.name}-{i}" if several else args.name
            replay = args.replay[i] if i < len(args.replay) else None
            specs.append(InstanceSpec(name, endpoint, replay, args.topic, args.dp))
        specs.extend(InstanceSpec.parse(text) for text in args.instance)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    if not specs:
        raise UsageError("nothing to record: give an ENDPOINT or --instance SPEC")
    names = [spec.name for spec in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"instance {twice[0]!r} is given twice")
    return specs


class RecordProgress:
    """A line on stderr every `--progress` seconds: batches so far, rate, bytes written."""

    def __init__(self, console: Console, writer: Writer, args: argparse.Namespace) -> None:
        self.console = console
        self.writer = writer
        self.duration: float | None = args.duration
        self.every: float = args.progress
        self.started = time.monotonic()
        self.next_at = self.started + self.every

    def __call__(self, batches: int) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + self.every
        took = now - self.started
        of = f" of {self.duration:g}" if self.duration is not None else ""
        self.console.print(
            f"recording: {batches:,} batches in {took:.0f}{of} s "
            f"({batches / took:,.1f}/s), {self.writer.size:,} bytes written"
        )


def _notices(console: Console, quiet: bool) -> Any:
    def show(item: Item) -> None:
        if not quiet and not isinstance(item, Delivery):
            console.print(f"▶ {item.source!r}: {item.describe()}", style="yellow")

    return show


def run(args: argparse.Namespace) -> int:
    specs = instance_specs(args)
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        writer = Writer(args.out, flush_interval=args.flush_interval)
    except RecordingError as exc:
        raise UsageError(str(exc)) from None
    start_size = writer.size
    with writer, stop_signals("record") as stop:
        kept = len(writer.checkpoints)
        resumed = f", continuing {kept} recorded sources" if kept else ""
        console.print(f"recording {len(specs)} instances to {args.out}{resumed}")
        sys.stderr.flush()
        try:
            record(
                specs,
                writer,
                limits=Limits(args.duration, args.max_batches),
                stop=stop,
                on_item=_notices(console, args.quiet),
                catch_up=args.start == "oldest",
                tick=None if args.quiet else RecordProgress(console, writer, args),
            )
        except zmq.ZMQError as exc:
            raise UsageError(f"can't follow the publishers: {exc}") from None
    written = writer.size - start_size
    ratio = writer.raw_bytes / written if written else 0.0
    console.print(
        f"recorded {writer.batches} batches, {writer.notices} notices: {written} bytes "
        f"in {writer.segments} segments ({ratio:.1f}x compressed) to {args.out}"
    )
    return 0
