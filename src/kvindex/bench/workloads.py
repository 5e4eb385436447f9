"""The bench's workloads: a steady-state event stream from the simulator (ingest), and a
filled fleet with 512-block prompts to look up (lookups and memory).

Ingest: `kvindex.sim.Simulation` (what `kvindex simulate` publishes) with no restarts,
resets or CPU tier, so the stream is pure steady state: once every instance's GPU pool is
full (the warm-up), each stored block evicts one, so stores ≈ removes, with chains of 1-32
blocks per event, shared system prompts and conversations that wander between instances.
The simulator is Python (~150k block events/s here), so a generated workload is kept on
disk under `cache_dir()`, keyed by its parameters and a digest of the simulator's source.

Fill: millions of (instance, block) entries cannot come from the simulator in reasonable
time (20M entries would take minutes to generate and a gigabyte to cache), so `fill()`
draws the same shape directly with numpy: shared system prompts, long shared documents
held to different depths, and per-instance conversations (some also held, in part, by a
second instance). Every chain is deterministic by (seed, what it is), so the lookup
prompts can name blocks that instances hold to differing depths without storing the fill.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

from kvindex.bench.common import BLOCK, cache_dir
from kvindex.sim import SimBatch, SimConfig, Simulation, WireFormat
from kvindex.wire import BlockHash

__all__ = [
    "Batch",
    "FillSpec",
    "FillStore",
    "IngestSpec",
    "IngestWorkload",
    "Prompt",
    "fill",
    "ingest_workload",
    "prompts",
]

Batch = tuple[int, int, bytes]
"""One published batch: the instance's number, its seq and the payload (vLLM 0.33 wire, or
SGLang's for an `IngestSpec` of format "sglang")."""

_CACHE_FORMAT = 2
_CACHE_MIN_SECONDS = 1.0  # cheaper workloads are generated again rather than kept


# -- ingest: the simulator's steady state ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class IngestSpec:
    instances: int
    events: int = 0  # measured block events (at least), after the warm-up ...
    batches: int = 0  # ... or measured batches (the bench's cases use events)
    seed: int = 0
    gpu_blocks: int = 1024  # per instance: the steady-state size of each instance's cache
    format: WireFormat = "0.33"  # or "sglang" (the engines case: SGLang's page shapes)
    page_size: int = 16  # tokens per block

    def __post_init__(self) -> None:
        if self.events <= 0 and self.batches <= 0:
            raise ValueError("an ingest workload needs events or batches")

    def more(self, events: int, batches: int) -> bool:
        """Whether the measured part needs more batches."""
        return (self.events > 0 and events < self.events) or (
            self.batches > 0 and batches < self.batches
        )

    def config(self) -> SimConfig:
        # No restarts, prefix-cache resets or CPU tier: a steady GPU stream, as a throughput
        # case wants (the incidents are the correctness tests' business).
        return SimConfig(
            instances=self.instances,
            seed=self.seed,
            format=self.format,
            block_size=self.page_size,
            gpu_blocks=self.gpu_blocks,
            restart_every=0,
            reset_every=0,
            cpu_every=0,
        )


@dataclass(slots=True)
class IngestWorkload:
    spec: IngestSpec
    names: list[str]
    warmup: list[Batch]  # until every instance's pool is full (applied untimed)
    measured: list[Batch]
    counts: list[int]  # block events of each measured batch
    stores: int  # block stores in `measured`
    removes: int  # block removes in `measured`
    truth: list[set[int]]  # per instance, the hashes its pool holds at the end
    generation_seconds: float = 0.0
    cached: bool = False
    events: int = field(init=False)

    def __post_init__(self) -> None:
        self.events = self.stores + self.removes

    def slices(self, n: int) -> list[tuple[list[Batch], int]]:
        """The measured batches cut into `n` consecutive slices of about equal block
        events, each with its number of block events."""
        out: list[tuple[list[Batch], int]] = []
        start = done = 0
        for i, count in enumerate(self.counts):
            done += count
            if done * n >= self.events * (len(out) + 1) or i == len(self.counts) - 1:
                out.append((self.measured[start : i + 1], sum(self.counts[start : i + 1])))
                start = i + 1
        return [s for s in out if s[1]]


def ingest_workload(spec: IngestSpec, use_cache: bool = True) -> IngestWorkload:
    """The workload of `spec`, from the disk cache when an earlier run generated it."""
    path = cache_dir() / f"ingest-{_cache_key(spec)}.msgpack"
    if use_cache and path.exists():
        try:
            workload = _decode(spec, path.read_bytes())
            workload.cached = True
            return workload
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError, ValueError):
            pass  # a torn or stale file: generate again
    start = time.perf_counter()
    workload = _generate(spec)
    workload.generation_seconds = time.perf_counter() - start
    if use_cache and workload.generation_seconds >= _CACHE_MIN_SECONDS:
        _write_atomic(path, _encode(workload))
    return workload


def _generate(spec: IngestSpec) -> IngestWorkload:
    sim = Simulation(spec.config())
    index = {name: i for i, name in enumerate(sim.names)}
    warmup: list[Batch] = []
    full: set[str] = set()
    stored = 0
    cap = 4 * spec.instances * spec.gpu_blocks  # a pool that never fills must not hang us
    while len(full) < spec.instances and stored < cap:
        item = sim.next_item()
        if isinstance(item, SimBatch):
            warmup.append((index[item.instance], item.seq, item.payload))
            stored += item.stored
            if item.removed:  # an eviction: that instance's pool is full
                full.add(item.instance)
    measured: list[Batch] = []
    counts: list[int] = []
    stores = removes = 0
    while spec.more(stores + removes, len(measured)):
        item = sim.next_item()
        if isinstance(item, SimBatch):
            measured.append((index[item.instance], item.seq, item.payload))
            counts.append(item.stored + item.removed)
            stores += item.stored
            removes += item.removed
    truth: list[set[int]] = [set() for _ in sim.names]
    for source, pools in sim.reference().items():
        for hashes in pools.values():
            truth[index[source.instance]].update(h for h in hashes if isinstance(h, int))
    return IngestWorkload(spec, sim.names, warmup, measured, counts, stores, removes, truth)


class _Cached(msgspec.Struct, array_like=True):
    format: int
    names: list[str]
    warmup: list[tuple[int, int, bytes]]
    measured: list[tuple[int, int, bytes]]
    counts: list[int]
    stores: int
    removes: int
    truth: list[list[int]]
    generation_seconds: float


def _encode(w: IngestWorkload) -> bytes:
    truth = [sorted(t) for t in w.truth]
    cached = _Cached(
        _CACHE_FORMAT,
        w.names,
        w.warmup,
        w.measured,
        w.counts,
        w.stores,
        w.removes,
        truth,
        w.generation_seconds,
    )
    return msgspec.msgpack.encode(cached)


def _decode(spec: IngestSpec, data: bytes) -> IngestWorkload:
    c = msgspec.msgpack.decode(data, type=_Cached)
    if c.format != _CACHE_FORMAT:
        raise ValueError("old cache format")
    truth = [set(t) for t in c.truth]
    w = IngestWorkload(spec, c.names, c.warmup, c.measured, c.counts, c.stores, c.removes, truth)
    w.generation_seconds = c.generation_seconds
    return w


def _cache_key(spec: IngestSpec) -> str:
    # The simulator's source is part of the key: a change to it changes the stream.
    sim_dir = Path(__file__).resolve().parent.parent / "sim"
    digest = hashlib.sha256(repr(spec).encode())
    for source in sorted(sim_dir.glob("*.py")):
        digest.update(source.read_bytes())
    return (
        f"{spec.instances}i-{spec.events}e{spec.batches}b-g{spec.gpu_blocks}-s{spec.seed}"
        f"-{spec.format}-p{spec.page_size}-{digest.hexdigest()[:16]}"
    )


def _write_atomic(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError:
        pass  # a cache we can't write is only a slower next run


# -- fill: a large fleet's caches, for lookups and memory ------------------------------------


@dataclass(frozen=True, slots=True)
class FillSpec:
    instances: int
    per_instance: int  # blocks each instance holds
    seed: int = 0

    @property
    def entries(self) -> int:
        return self.instances * self.per_instance


class FillStore(NamedTuple):
    """One BlockStored event of the fill: a chain of 1-32 blocks under `parent`."""

    instance: int
    hashes: list[BlockHash]
    parent: BlockHash | None
    tokens: list[int]


class Prompt(NamedTuple):
    """A prompt to look up: its tokens and, for consumers that cannot hash tokens the way
    vLLM does (the naive one), the block hashes vLLM would give them."""

    kind: str  # "document" (a shared document, held to differing depths) or "conversation"
    tokens: np.ndarray
    hashes: list[BlockHash]


PROMPT_BLOCKS = 512
_SYSTEMS = 8  # shared system prompts, 4-48 blocks, Zipf-popular
_DOCUMENTS = 4  # shared 512-block documents (RAG contexts, few-shot sets)
_WANDER = 0.15  # share of conversations an instance holds that live on another one
_CONV_BLOCKS = (8, 200)
_VOCAB = 32_000


class _Chain(NamedTuple):
    tokens: np.ndarray  # BLOCK tokens per block
    hashes: list[BlockHash]


def _chain(seed: int, kind: int, a: int, b: int, blocks: int) -> _Chain:
    rng = np.random.default_rng([seed, kind, a, b])
    tokens = rng.integers(0, _VOCAB, size=blocks * BLOCK, dtype=np.int64)
    hashes = rng.integers(0, 2**64, size=blocks, dtype=np.uint64).tolist()
    return _Chain(tokens, hashes)


def _system(seed: int, s: int) -> _Chain:
    blocks = int(np.random.default_rng([seed, 1, s]).integers(4, 49))
    return _chain(seed, 2, s, 0, blocks)


def _document(seed: int, d: int) -> _Chain:
    return _chain(seed, 3, d, 0, PROMPT_BLOCKS)


def _conversation(seed: int, instance: int, k: int) -> tuple[int, _Chain]:
    """Conversation `k` of `instance`: which system prompt it starts from, and its own
    blocks after it."""
    rng = np.random.default_rng([seed, 4, instance, k])
    weights = 1.0 / np.arange(1, _SYSTEMS + 1)
    system = int(rng.choice(_SYSTEMS, p=weights / weights.sum()))
    blocks = int(rng.integers(_CONV_BLOCKS[0], _CONV_BLOCKS[1] + 1))
    return system, _chain(seed, 5, instance, k, blocks)


def _conversations_per_instance(spec: FillSpec) -> int:
    mean = (_CONV_BLOCKS[0] + _CONV_BLOCKS[1]) / 2
    return max(1, int(spec.per_instance * 0.6 / mean))


def fill(spec: FillSpec) -> Iterator[FillStore]:
    """Every store of the fill, instance by instance, `per_instance` blocks each."""
    systems = [_system(spec.seed, s) for s in range(_SYSTEMS)]
    documents = [_document(spec.seed, d) for d in range(_DOCUMENTS)]
    for i in range(spec.instances):
        yield from _fill_instance(spec, i, systems, documents)


def _fill_instance(
    spec: FillSpec, i: int, systems: list[_Chain], documents: list[_Chain]
) -> Iterator[FillStore]:
    rng = np.random.default_rng([spec.seed, 6, i])
    left = spec.per_instance
    held_systems: set[int] = set()
    for s, chain in enumerate(systems):
        # Popular system prompts are everywhere, as long as they leave room for the rest.
        if len(chain.hashes) <= left - spec.per_instance // 2:
            yield from _stores(rng, i, chain, None, 0, len(chain.hashes))
            held_systems.add(s)
            left -= len(chain.hashes)
    depth_cap = min(PROMPT_BLOCKS, spec.per_instance // (2 * _DOCUMENTS))
    for chain in documents:
        depth = min(left, int(rng.integers(0, depth_cap + 1)))
        yield from _stores(rng, i, chain, None, 0, depth)
        left -= depth
    per = _conversations_per_instance(spec)
    visited: set[tuple[int, int]] = set()  # another instance's conversations held here
    k = 0
    while left > 0:
        owner, conv = i, k
        if spec.instances > 1 and rng.random() < _WANDER:
            owner = int((i + rng.integers(1, spec.instances)) % spec.instances)
            conv = int(rng.integers(0, per))
            if (owner, conv) in visited:
                continue  # each block is stored once per instance: entries stay exact
            visited.add((owner, conv))
        else:
            k += 1
        system, chain = _conversation(spec.seed, owner, conv)
        # Under its system prompt where this instance holds it; a chain of its own otherwise.
        root = systems[system].hashes[-1] if system in held_systems else None
        blocks = len(chain.hashes) if owner == i else int(rng.integers(1, len(chain.hashes) + 1))
        blocks = min(blocks, left)
        yield from _stores(rng, i, chain, root, 0, blocks)
        left -= blocks


def _stores(
    rng: np.random.Generator, i: int, chain: _Chain, root: BlockHash | None, start: int, end: int
) -> Iterator[FillStore]:
    """`chain`'s blocks [start, end) as store events of 1-32 blocks, each under the last."""
    at = start
    while at < end:
        n = min(end - at, int(rng.integers(1, 33)))
        parent = chain.hashes[at - 1] if at else root
        tokens = chain.tokens[at * BLOCK : (at + n) * BLOCK].tolist()
        yield FillStore(i, chain.hashes[at : at + n], parent, tokens)
        at += n


def prompts(spec: FillSpec, count: int) -> list[Prompt]:
    """`count` 512-block prompts that partly hit: half are the shared documents (each
    instance holds a different-length prefix), half a conversation's history (deep on its
    instance, the system prompt elsewhere) followed by a new question."""
    rng = np.random.default_rng([spec.seed, 7])
    systems = [_system(spec.seed, s) for s in range(_SYSTEMS)]
    per = _conversations_per_instance(spec)
    out: list[Prompt] = []
    for n in range(count):
        if n % 2 == 0:
            doc = _document(spec.seed, int(rng.integers(0, _DOCUMENTS)))
            out.append(Prompt("document", doc.tokens, list(doc.hashes)))
            continue
        instance = int(rng.integers(0, spec.instances))
        system, conv = _conversation(spec.seed, instance, int(rng.integers(0, per)))
        head = systems[system]
        tail = _chain(spec.seed, 8, n, 0, PROMPT_BLOCKS)  # the new question and beyond
        tokens = np.concatenate([head.tokens, conv.tokens, tail.tokens])[: PROMPT_BLOCKS * BLOCK]
        hashes = (head.hashes + conv.hashes + tail.hashes)[:PROMPT_BLOCKS]
        out.append(Prompt("conversation", tokens, hashes))
    return out
