"""`kvindex replay`: republish a recording as vLLM-compatible publishers.

One publisher (PUB, and a replay ROUTER with `--replay-endpoint`) per recorded instance and
DP rank: on consecutive ports from `--pub` (an instance's ranks together, as vLLM binds
them) or where `--instance NAME=EP[,replay=EP]` puts a recorded instance. Payloads and seqs
are the recorded ones, restarts restart the publisher, and the pace is the recorded one
times `--speed`. It prints the `kvindex serve --instance` flags that follow the replay.
"""

from __future__ import annotations

import argparse
from typing import Any

import zmq
from rich.console import Console

from kvindex.cli.common import (
    UsageError,
    non_negative_seconds,
    positive_float,
    positive_int,
)
from kvindex.cli.signals import Stop, stop_signals
from kvindex.recording import RecordingError
from kvindex.recording.replay import (
    ReplayPublisher,
    Target,
    open_publishers,
    plan,
    recorded_sources,
    replay,
    serve_specs,
)
from kvindex.subscriber import InstanceSpec, SourceKey, SpecError

__all__ = ["add_parser", "run"]


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
    p.set_defaults(run=run)


def _targets(args: argparse.Namespace) -> list[Target]:
    try:
        specs = [InstanceSpec.parse(text) for text in args.instance]
        sources = recorded_sources(args.file)
    except (SpecError, RecordingError) as exc:
        raise UsageError(str(exc)) from None
    if not sources:
        raise UsageError(f"{args.file} holds no batches to replay")
    try:
        return plan(sources, args.pub, args.replay_endpoint, specs)
    except (ValueError, SpecError) as exc:
        raise UsageError(str(exc)) from None


def _open(targets: list[Target], args: argparse.Namespace) -> dict[SourceKey, ReplayPublisher]:
    try:
        return open_publishers(targets, args.buffer_steps)
    except zmq.ZMQError as exc:
        raise UsageError(f"can't bind the publishers: {exc}") from None


def _announce(console: Console, targets: list[Target], args: argparse.Namespace) -> None:
    pace = "as fast as possible" if args.as_fast_as_possible else f"at {args.speed:g}x"
    console.print(f"replaying {args.file} {pace} as {len(targets)} publishers:")
    for t in targets:
        replay_text = f" (replay {t.replay_endpoint})" if t.replay_endpoint else ""
        console.print(f"  {t.source!r} -> {t.endpoint}{replay_text}")
    flags = " ".join(f"--instance {spec}" for spec in serve_specs(targets))
    console.print(f"follow it with: kvindex serve {flags}", soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    targets = _targets(args)
    console = Console(highlight=False, soft_wrap=True)
    pubs = _open(targets, args)
    try:
        with stop_signals("replay") as stop:
            _announce(console, targets, args)
            _pause(args.wait, stop)
            speed = None if args.as_fast_as_possible else args.speed
            stats = replay(args.file, pubs, speed=speed, stop=stop)
            console.print(
                f"replayed {stats.batches} batches ({stats.restarts} restarts) "
                f"in {stats.elapsed:.1f} s"
            )
            _pause(args.hold, stop)
    except RecordingError as exc:
        raise UsageError(str(exc)) from None
    finally:
        for pub in pubs.values():
            pub.close()
    return 0


def _pause(seconds: float, stop: Stop) -> None:
    stop.wait(max(0.0, seconds))
