"""Follow several vLLM instances and tell which of them hold each block.

    python examples/block_locations.py \\
        --instance a=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558 \\
        --instance b=tcp://10.0.0.6:5557,replay=tcp://10.0.0.6:5558

The question a KV-aware router asks. Blocks are matched by the hash each engine published
(engines of one model and configuration hash the same prefix the same way), and counted
per physical copy, so an instance keeps a block until it evicted its last copy.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict

from _common import add_stop_options, follow, show_notice

from kvindex import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Delivery,
    EventBatch,
    InstanceSpec,
    Notice,
    Restarted,
    SourceKey,
    Subscriber,
    render_hash,
)
from kvindex.subscriber import SpecError
from kvindex.wire import BlockHash


class Locations:
    def __init__(self) -> None:
        # Per publisher (instance, DP rank): copies of each hash it holds.
        self.held: defaultdict[SourceKey, Counter[BlockHash]] = defaultdict(Counter)

    def apply(self, source: SourceKey, batch: EventBatch) -> None:
        copies = self.held[source]
        for event in batch.events:
            if isinstance(event, BlockStored):
                copies.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                copies.subtract(event.block_hashes)
                for h in event.block_hashes:
                    if copies[h] <= 0:
                        del copies[h]
            elif isinstance(event, AllBlocksCleared):
                copies.clear()

    def clear(self, source: SourceKey) -> None:
        self.held.pop(source, None)

    def where(self) -> dict[BlockHash, set[str]]:
        """Each cached hash -> the instances holding at least one copy (any DP rank)."""
        out: defaultdict[BlockHash, set[str]] = defaultdict(set)
        for source, copies in self.held.items():
            for h in copies:
                out[h].add(source.instance)
        return out

    def report(self, top: int) -> list[str]:
        where = self.where()
        spread = Counter(len(names) for names in where.values())
        lines = [
            f"{len(where)} distinct blocks; "
            + ", ".join(f"{n} on {k} instance{'s' * (k > 1)}" for k, n in sorted(spread.items()))
        ]
        shared = sorted(where.items(), key=lambda kv: (-len(kv[1]), render_hash(kv[0])))
        for h, names in shared[:top]:
            lines.append(f"  {render_hash(h):>20}  {','.join(sorted(names))}")
        return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--instance",
        action="append",
        required=True,
        metavar="NAME=EP[,replay=EP]",
        help="an instance to follow (repeat for each)",
    )
    parser.add_argument("--top", type=int, default=5, help="most shared blocks to list")
    parser.add_argument("--list", action="store_true", help="list every block at the end")
    add_stop_options(parser)
    args = parser.parse_args()
    try:
        args.specs = [InstanceSpec.parse(text) for text in args.instance]
    except SpecError as exc:
        parser.error(str(exc))
    return args


def main() -> None:
    args = parse_args()
    locations = Locations()
    with Subscriber(instances=args.specs) as sub:
        try:
            for item in follow(sub, args):
                match item:
                    case Delivery():
                        locations.apply(item.source, item.batch)
                    case Restarted():  # that engine's cache is empty now
                        show_notice(item)
                        locations.clear(item.source)
                    case Notice():
                        show_notice(item)
                    case None:
                        print("\n".join(locations.report(args.top)), flush=True)
        except KeyboardInterrupt:
            pass
    top = sys.maxsize if args.list else args.top
    print("final: " + "\n".join(locations.report(top)), flush=True)


if __name__ == "__main__":
    main()
