"""What the example scripts share: the stop options and the loop around `Subscriber.poll`.

`follow()` yields the subscriber's items until `--max-batches` batches were delivered or
`--duration` seconds passed, and yields `None` every `--every` seconds (time for a report,
even when nothing arrived). Ctrl+C ends it in the caller, which prints its final report.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

from kvindex import Delivery, Subscriber
from kvindex.subscriber import Connection, Item, Notice


def add_stop_options(parser: argparse.ArgumentParser, every: float = 5.0) -> None:
    parser.add_argument("--max-batches", type=int, metavar="N", help="stop after N batches")
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    parser.add_argument(
        "--every", type=float, default=every, metavar="S", help=f"report every S s ({every})"
    )


def add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoint", metavar="ENDPOINT", help="PUB endpoint, tcp://HOST:5557")
    parser.add_argument("--replay", metavar="ENDPOINT", help="replay endpoint, tcp://HOST:5558")
    parser.add_argument("--name", default="vllm", help="instance name (default: vllm)")


def follow(sub: Subscriber, args: argparse.Namespace) -> Iterator[Item | None]:
    started = time.monotonic()
    stop = None if args.duration is None else started + args.duration
    next_report = started + args.every
    batches = 0
    while stop is None or time.monotonic() < stop:
        now = time.monotonic()
        wait = min(next_report, stop or next_report) - now
        for item in sub.poll(max(0.0, min(wait, 0.5))):
            yield item
            if isinstance(item, Delivery):
                batches += 1
                if args.max_batches is not None and batches >= args.max_batches:
                    return
        if time.monotonic() >= next_report:
            next_report += args.every
            yield None


def show_notice(notice: Notice) -> None:
    """Print what the subscriber tells about the stream (connections are just noise here)."""
    if not isinstance(notice, Connection):
        print(f"! {notice.source!r}: {notice.describe()}", flush=True)
