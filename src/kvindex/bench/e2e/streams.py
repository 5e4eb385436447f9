"""What the end-to-end cases publish: the steady-state stream, the staged prompts, the
warm-restart store's chains and the freshness markers, each as (instance, payload) items
that the publisher child reads from a file."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvindex.bench.common import BLOCK
from kvindex.bench.plan import EndToEnd

__all__ = [
    "MARKER_BASE",
    "PROMPT_BLOCKS",
    "Item",
    "Staged",
    "Workload",
    "marker_payload",
    "read_items",
    "staged_prompts",
    "steady_state",
    "warm_items",
    "write_items",
]

PROMPT_BLOCKS = 512
MARKER_BASE = 7 * 10**18  # marker block hashes: far from the simulator's
WARM_BASE = 5 * 10**18  # warm-restart block hashes

# One batch to publish: (instance index, payload as vLLM sends it). The publisher child
# numbers each instance's batches from 0, in order.
Item = tuple[int, bytes]


@dataclass(slots=True)
class Workload:
    """The steady-state stream: `items[:warmup]` fill every instance's pool (sent
    untimed), the rest is what the cases time."""

    names: list[str]
    items: list[Item]
    warmup: int
    events: int  # block events in items[warmup:]
    reference: dict[str, set[str]]  # per instance: every block hash held at the end
    path: Path  # the items, as the publisher child reads them

    @property
    def measured(self) -> int:
        return len(self.items) - self.warmup

    @property
    def events_per_batch(self) -> float:
        return self.events / max(1, self.measured)


def steady_state(sizes: EndToEnd, workdir: Path) -> Workload:
    from kvindex.bench.workloads import IngestSpec, ingest_workload

    w = ingest_workload(IngestSpec(instances=sizes.instances, batches=sizes.batches))
    items = [(idx, payload) for idx, _, payload in (*w.warmup, *w.measured)]
    reference = {n: {str(h) for h in held} for n, held in zip(w.names, w.truth, strict=True)}
    path = workdir / "workload.msgpack"
    write_items(path, items)
    return Workload(list(w.names), items, len(w.warmup), w.events, reference, path)


def write_items(path: Path, items: Sequence[Item]) -> None:
    path.write_bytes(msgspec.msgpack.encode(list(items)))


def read_items(path: str | Path) -> list[Item]:
    return msgspec.msgpack.decode(Path(path).read_bytes(), type=list[Item])


@dataclass(slots=True)
class Staged:
    """512-block prompts, each held by every instance to its own depth."""

    prompts: list[list[int]]
    depth: list[list[int]]  # depth[p][i]: blocks of prompt p that instance i holds
    items: list[Item]


def staged_prompts(count: int, instances: int, seed: int = 3) -> Staged:
    from kvindex.wire import BlockHash, BlockStored
    from kvindex.wire.publisher import encode_batch

    rng = random.Random(seed)
    staged = Staged([], [], [])
    for _ in range(count):
        tokens = [rng.randrange(32_000) for _ in range(BLOCK * PROMPT_BLOCKS)]
        hashes: list[BlockHash] = [rng.getrandbits(62) for _ in range(PROMPT_BLOCKS)]
        depths = [rng.randrange(PROMPT_BLOCKS) for _ in range(instances)]
        staged.prompts.append(tokens)
        staged.depth.append(depths)
        for i, keep in enumerate(depths):
            if keep:
                event = BlockStored(hashes[:keep], None, tokens[: BLOCK * keep], BLOCK)
                staged.items.append((i, encode_batch([event])))
    return staged


def warm_items(blocks: int, instances: int) -> list[Item]:
    """`blocks` blocks in chains of 32 (one batch each), spread over the instances."""
    from kvindex.wire import BlockHash, BlockStored
    from kvindex.wire.publisher import encode_batch

    items: list[Item] = []
    stored = 0
    while stored < blocks:
        n = min(32, blocks - stored)
        first = len(items) * 32 * BLOCK
        tokens = list(range(first, first + BLOCK * n))
        hashes: list[BlockHash] = list(range(WARM_BASE + stored, WARM_BASE + stored + n))
        event = BlockStored(hashes, None, tokens, BLOCK, medium="GPU")
        items.append((len(items) % instances, encode_batch([event])))
        stored += n
    return items


def marker_payload(j: int) -> bytes:
    """Marker j: one block chained onto marker j - 1 (so a prefix lookup counts them)."""
    from kvindex.wire import BlockStored
    from kvindex.wire.publisher import encode_batch

    parent = MARKER_BASE + j - 1 if j else None
    return encode_batch([BlockStored([MARKER_BASE + j], parent, [j % 32_000] * BLOCK, BLOCK)])
