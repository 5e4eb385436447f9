"""What the end-to-end cases publish: the steady-state stream, a filled fleet with its
prompts, the warm-restart store's chains and the freshness markers, each as (instance,
payload) items that the publisher child reads from a file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvindex.bench.common import BLOCK

if TYPE_CHECKING:
    from kvindex.bench.workloads import FillSpec

__all__ = [
    "MARKER_BASE",
    "Filled",
    "Item",
    "SteadyStream",
    "filled",
    "marker_payload",
    "read_items",
    "steady_state",
    "warm_items",
    "wire_events",
    "write_items",
]

MARKER_BASE = 7 * 10**18  # marker block hashes: far from the simulator's
WARM_BASE = 5 * 10**18  # warm-restart block hashes

# One batch to publish: (instance index, payload as vLLM sends it). The publisher child
# numbers each instance's batches from 0, in order.
Item = tuple[int, bytes]


@dataclass(slots=True)
class SteadyStream:
    """The steady-state stream: `items[:warmup]` fill every instance's pool (sent
    untimed), the rest is what the cases time."""

    names: list[str]
    items: list[Item]
    warmup: int
    events: int  # block events in items[warmup:]
    reference: dict[str, set[str]]  # per instance: every block hash held at the end
    path: Path  # the items, as the publisher child reads them
    wire_warmup: int  # vLLM events in items[:warmup] (Dynamo counts events, not blocks)
    wire_total: int  # vLLM events in all items

    @property
    def measured(self) -> int:
        return len(self.items) - self.warmup

    @property
    def events_per_batch(self) -> float:
        return self.events / max(1, self.measured)


def steady_state(instances: int, events: int, workdir: Path, tag: str) -> SteadyStream:
    """The simulator's steady state on `instances` publishers, `events` measured block
    events after the warm-up; its items written to `workdir` for the publisher child."""
    from kvindex.bench.workloads import IngestSpec, ingest_workload

    w = ingest_workload(IngestSpec(instances=instances, events=events))
    items = [(idx, payload) for idx, _, payload in (*w.warmup, *w.measured)]
    reference = {n: {str(h) for h in held} for n, held in zip(w.names, w.truth, strict=True)}
    path = workdir / f"stream-{tag}.msgpack"
    write_items(path, items)
    warmup = len(w.warmup)
    counts = (wire_events(items[:warmup]), wire_events(items))
    return SteadyStream(list(w.names), items, warmup, w.events, reference, path, *counts)


def wire_events(items: Sequence[Item]) -> int:
    """How many vLLM events (not block events) `items` carry: what Dynamo's indexer counts."""
    decode = msgspec.msgpack.decode
    return sum(len(decode(payload)[1]) for _, payload in items)


def write_items(path: Path, items: Sequence[Item]) -> None:
    path.write_bytes(msgspec.msgpack.encode(list(items)))


def read_items(path: str | Path) -> list[Item]:
    return msgspec.msgpack.decode(Path(path).read_bytes(), type=list[Item])


@dataclass(slots=True)
class Filled:
    """A filled fleet (`workloads.fill`) as items, its 512-block prompts, and how many blocks
    of each prompt each instance holds (the truth every lookup answer is checked against)."""

    spec: FillSpec
    items: list[Item]
    prompts: list[list[int]]
    depth: list[list[int]]  # depth[p][i]: blocks of prompt p that instance i holds
    wire_events: int

    @property
    def entries(self) -> int:
        return self.spec.entries


def filled(spec: FillSpec, prompt_count: int) -> Filled:
    """The fill as vLLM 0.33 publishes it (one `BlockStored` a batch) and its prompts. The
    depths come from the naive consumer given each prompt's block hashes: the fill stores
    each block once per instance, so that count is exact."""
    from kvindex.bench.consumers import Naive
    from kvindex.bench.workloads import fill, prompts
    from kvindex.wire import BlockStored
    from kvindex.wire.publisher import encode_batch

    items: list[Item] = []
    naive = Naive(spec.instances)
    for s in fill(spec):
        event = BlockStored(s.hashes, s.parent, s.tokens, BLOCK, medium="GPU")
        items.append((s.instance, encode_batch([event])))
        naive.sets[s.instance].update(s.hashes)
    asked = prompts(spec, prompt_count)
    depth = [naive.depths(naive.query([], p.hashes)) for p in asked]
    return Filled(spec, items, [p.tokens.tolist() for p in asked], depth, len(items))


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
