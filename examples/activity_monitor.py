"""Show how busy a vLLM instance's prefix cache is: blocks stored and removed, and cache
clears, per minute over a sliding window.

    python examples/activity_monitor.py tcp://HOST:5557 --replay tcp://HOST:5558 --every 5

Batches are placed in time by the publisher's own timestamp, so batches recovered by a
replay count when they happened, not when they arrived.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from typing import NamedTuple

from _common import add_endpoint_options, add_stop_options, follow, show_notice

from kvindex import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Delivery,
    EventBatch,
    Notice,
    Restarted,
    Subscriber,
)


class Tick(NamedTuple):
    ts: float
    stored: int
    removed: int
    clears: int


class Activity:
    def __init__(self, window: float) -> None:
        self.window = window
        self.ticks: deque[Tick] = deque()  # in arrival order; ts may go back after replays

    def add(self, batch: EventBatch) -> None:
        stored = removed = clears = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                removed += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                clears += 1
        self.ticks.append(Tick(batch.ts, stored, removed, clears))

    def restart(self) -> None:
        self.ticks.append(Tick(time.time(), 0, 0, 1))  # an engine restart empties the cache

    def per_minute(self, now: float) -> Tick:
        """Totals of the last `window` seconds, scaled to one minute."""
        # A publisher whose clock runs ahead of ours must not fall out of the window.
        now = max([now, *(t.ts for t in self.ticks)])
        start = now - self.window
        # Forget what left the window. A replayed (older) tick may sit behind newer ones:
        # the filter below skips it until it reaches the front.
        while self.ticks and self.ticks[0].ts < start:
            self.ticks.popleft()
        recent = [t for t in self.ticks if t.ts >= start]
        scale = 60.0 / self.window
        return Tick(
            now,
            round(sum(t.stored for t in recent) * scale),
            round(sum(t.removed for t in recent) * scale),
            round(sum(t.clears for t in recent) * scale),
        )

    def line(self, now: float) -> str:
        rate = self.per_minute(now)
        return (
            f"{time.strftime('%X')}  per minute (last {self.window:g} s): "
            f"stored {rate.stored}  removed {rate.removed}  clears {rate.clears}  "
            f"net {rate.stored - rate.removed:+d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_endpoint_options(parser)
    parser.add_argument("--window", type=float, default=60.0, help="window in seconds (60)")
    add_stop_options(parser)
    args = parser.parse_args()
    activity = Activity(args.window)
    with Subscriber(args.endpoint, replay=args.replay, name=args.name) as sub:
        try:
            for item in follow(sub, args):
                match item:
                    case Delivery():
                        activity.add(item.batch)
                    case Restarted():
                        show_notice(item)
                        activity.restart()
                    case Notice():
                        show_notice(item)
                    case None:
                        print(activity.line(time.time()), flush=True)
        except KeyboardInterrupt:
            pass
    print("final:", activity.line(time.time()), flush=True)


if __name__ == "__main__":
    main()
