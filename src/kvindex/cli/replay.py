"""`kvindex replay`: republish a recording as vLLM-compatible publishers.

One publisher (PUB, and a replay ROUTER with `--replay-endpoint`) per recorded instance and
DP rank: on consecutive ports from `--pub` (an instance's ranks together, as vLLM binds
them) or where `--instance NAME=EP[,replay=EP]` puts a recorded instance. Payloads and seqs
are the recorded ones, restarts restart the publisher, and the pace is the batches' own
timestamps (when the engine published them) times `--speed`. It prints the `kvindex serve
--instance` flags that follow the replay, a progress line every 10 s, and at the end how
much it played, or where and why it stopped (a stop signal; damage in the file: exit 1).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import zmq
from rich.console import Console

from kvindex.cli.common import (
    UsageError,
    non_negative_seconds,
    positive_float,
    positive_int,
    positive_seconds,
)
from kvindex.cli.signals import Stop, stop_signals
from kvindex.recording import RecordingError
from kvindex.recording.replay import (
    ReplayPublisher,
    ReplayStats,
    Survey,
    Target,
    open_publishers,
    plan,
    replay,
    serve_specs,
    survey,
)
from kvindex.subscriber import InstanceSpec, SourceKey, SpecError

__all__ = ["PROGRESS_EVERY", "add_parser", "run"]

PROGRESS_EVERY = 10.0  # seconds between two progress lines


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="republish a recording as vLLM-compatible publishers",
        description="Republish a recording (kvindex record) as vLLM-compatible publishers, "
        "one per recorded instance and DP rank, at the recorded pace times --speed.",
    )
    p.add_argument("file", metavar="FILE", help="recording file")
    p.add_argument("--pub", metavar="ENDPOINT", help="first PUB endpoint (tcp://HOST:PORT)")
    p.add_argument("--replay-endpoint", metavar="ENDPOINT", help="first replay endpoint")
    p.add_argument(
        "--instance",
        metavar="SPEC",
        action="append",
        default=[],
        help="NAME=PUB_EP[,replay=EP]: where recorded instance NAME goes; repeatable",
    )
    pace = p.add_mutually_exclusive_group()
    pace.add_argument(
        "--speed", type=positive_float, default=1.0, metavar="N", help="N times the recorded pace"
    )
    pace.add_argument("--as-fast-as-possible", action="store_true", help="no pauses at all")
    p.add_argument(
        "--wait",
        type=non_negative_seconds,
        default=1.0,
        metavar="S",
        help="seconds between binding and the first batch, for subscribers to connect",
    )
    p.add_argument(
        "--hold",
        type=non_negative_seconds,
        default=2.0,
        metavar="S",
        help="seconds to keep serving replay requests after the last batch",
    )
    p.add_argument(
        "--buffer-steps", type=positive_int, default=10_000, metavar="N", help="replay buffer"
    )
    p.add_argument(
        "--progress",
        type=positive_seconds,
        default=PROGRESS_EVERY,
        metavar="S",
        help=f"seconds between two progress lines (default: {PROGRESS_EVERY:g})",
    )
    p.set_defaults(run=run)


def _targets(args: argparse.Namespace) -> tuple[list[Target], Survey]:
    try:
        specs = [InstanceSpec.parse(text) for text in args.instance]
        found = survey(args.file)
    except (SpecError, RecordingError) as exc:
        raise UsageError(str(exc)) from None
    if not found.batches:
        raise UsageError(f"{args.file} holds no batches to replay")
    try:
        return plan(found.sources, args.pub, args.replay_endpoint, specs), found
    except (ValueError, SpecError) as exc:
        raise UsageError(str(exc)) from None


def _open(targets: list[Target], args: argparse.Namespace) -> dict[SourceKey, ReplayPublisher]:
    try:
        return open_publishers(targets, args.buffer_steps)
    except zmq.ZMQError as exc:
        raise UsageError(f"can't bind the publishers: {exc}") from None


def _announce(
    console: Console, targets: list[Target], found: Survey, args: argparse.Namespace
) -> None:
    pace = "as fast as possible" if args.as_fast_as_possible else f"at {args.speed:g}x"
    console.print(
        f"replaying {args.file} ({found.batches:,} batches, {_clock(found.span)} of "
        f"recorded time) {pace} as {len(targets)} publishers:"
    )
    for t in targets:
        replay_text = f" (replay {t.replay_endpoint})" if t.replay_endpoint else ""
        console.print(f"  {t.source!r} -> {t.endpoint}{replay_text}")
    flags = " ".join(f"--instance {spec}" for spec in serve_specs(targets))
    console.print(f"follow it with: kvindex serve {flags}", soft_wrap=True)


class ReplayProgress:
    """A line every `--progress` seconds: batches sent of all, recorded time played."""

    def __init__(self, console: Console, found: Survey, every: float) -> None:
        self.console = console
        self.found = found
        self.every = every
        self.next_at = time.monotonic() + every

    def __call__(self, stats: ReplayStats) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + self.every
        total = self.found.batches
        self.console.print(
            f"replaying: {stats.batches:,} of {total:,} batches ({stats.batches / total:.0%}), "
            f"{_clock(stats.recorded_seconds)} of {_clock(self.found.span)} recorded time"
        )


def _clock(seconds: float) -> str:
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _ending(stats: ReplayStats, found: Survey, stop: Stop) -> str:
    """The last line: how much was replayed, and where and why it stopped if it did."""
    if stats.stopped is None:
        text = f"replayed {stats.batches:,} batches ({stats.restarts} restarts) in "
        text += f"{stats.elapsed:.1f} s"
        if stats.truncated:
            text += "; the file ends mid-segment (its recorder was cut off): played to there"
        return text
    where = f"replay stopped at batch {stats.batches:,}"
    if stop():  # else the damage cut the survey short too: no total to compare with
        where += f" of {found.batches:,}"
    if stats.last is not None:
        source, seq = stats.last
        where += f" ({source!r} seq {seq})"
    why = stop.reason if stop() and stop.reason else stats.stopped
    return f"{where} after {stats.elapsed:.1f} s: {why}"


def run(args: argparse.Namespace) -> int:
    targets, found = _targets(args)
    console = Console(highlight=False, soft_wrap=True)
    pubs = _open(targets, args)
    try:
        with stop_signals("replay") as stop:
            _announce(console, targets, found, args)
            _pause(args.wait, stop)
            speed = None if args.as_fast_as_possible else args.speed
            progress = ReplayProgress(console, found, args.progress)
            stats = replay(args.file, pubs, speed=speed, stop=stop, tick=progress)
            console.print(_ending(stats, found, stop))
            if stats.stopped is None:
                _pause(args.hold, stop)
    except RecordingError as exc:
        raise UsageError(str(exc)) from None
    finally:
        for pub in pubs.values():
            pub.close()
    damaged = stats.stopped is not None and not stop()
    return 1 if damaged else 0


def _pause(seconds: float, stop: Stop) -> None:
    stop.wait(max(0.0, seconds))
