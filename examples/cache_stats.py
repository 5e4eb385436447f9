"""Count what a vLLM instance's prefix cache does: blocks stored, removed, clears, and how
many blocks it holds now.

    python examples/cache_stats.py tcp://HOST:5557 --replay tcp://HOST:5558

vLLM sends one BlockStored per physical copy of a block and one BlockRemoved per evicted
copy, so "active" counts copies per hash: a hash stays cached until its last copy goes.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field

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
from kvindex.wire import BlockHash

# A block as vLLM counts it: DP rank, medium (GPU/CPU/...) and the hash.
Key = tuple[int, str, BlockHash]


@dataclass
class CacheStats:
    stored: int = 0  # blocks announced by BlockStored (every copy)
    removed: int = 0  # blocks announced by BlockRemoved
    clears: int = 0  # AllBlocksCleared events and engine restarts
    batches: int = 0
    copies: Counter[Key] = field(default_factory=Counter)

    @property
    def active(self) -> int:
        """Distinct blocks cached now."""
        return len(self.copies)

    def apply(self, rank: int, batch: EventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.stored += len(event.block_hashes)
                for h in event.block_hashes:
                    self.copies[rank, event.medium or "GPU", h] += 1
            elif isinstance(event, BlockRemoved):
                self.removed += len(event.block_hashes)
                for h in event.block_hashes:
                    self._drop_copy((rank, event.medium or "GPU", h))
            elif isinstance(event, AllBlocksCleared):
                self.clear(rank)

    def _drop_copy(self, key: Key) -> None:
        # A removal of a block we never saw stored (we joined late and the replay buffer
        # no longer had it) is counted but can't take anything away.
        if self.copies[key] <= 1:
            self.copies.pop(key, None)
        else:
            self.copies[key] -= 1

    def clear(self, rank: int) -> None:
        self.clears += 1
        for key in [k for k in self.copies if k[0] == rank]:
            del self.copies[key]

    def line(self) -> str:
        return (
            f"stored {self.stored}  removed {self.removed}  clears {self.clears}  "
            f"active {self.active} blocks  ({self.batches} batches)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_endpoint_options(parser)
    add_stop_options(parser)
    args = parser.parse_args()
    stats = CacheStats()
    with Subscriber(args.endpoint, replay=args.replay, name=args.name) as sub:
        try:
            for item in follow(sub, args):
                match item:
                    case Delivery():
                        stats.apply(item.rank, item.batch)
                    case Restarted():  # a new engine process: its cache starts empty
                        show_notice(item)
                        stats.clear(item.rank)
                    case Notice():
                        show_notice(item)
                    case None:
                        print(stats.line(), flush=True)
        except KeyboardInterrupt:
            pass
    print("final:", stats.line(), flush=True)


if __name__ == "__main__":
    main()
