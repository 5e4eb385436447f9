"""A simulated vLLM fleet as a stream of encoded batches, without sockets.

`Simulation(config)` steps its engines in turn (one engine step = at most one published
batch, as in vLLM) and yields `SimBatch`es (an instance, DP rank, seq and the payload as
that vLLM generation encodes it) and `SimRestart`s (an engine process restarted: its seqs
begin again at 0 and its cache is empty). Everything is decided by the seed, timestamps
included unless a clock is given, so the same config gives the same bytes: benchmarks
and tests use it directly, `SimulatedPublishers` publishes it over ZeroMQ.

`reference()` is the truth the index must reproduce: per publisher (instance, DP rank) and
(group, medium), every hash held and its number of physical copies, in wire form.

`format="sglang"` publishes what SGLang 0.5.23 does (`encoding`): page size 1 or 16
(`block_size`), salted conversations (`cache_salt`), HiCache's host tier (`CPU_PINNED`)
and storage tier (`DISK`, `disk_blocks`), pages with their tokens on every tier.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from kvindex.sim.encoding import (
    FORMATS,
    HASH_KINDS,
    HashKind,
    WireFormat,
    cpu_hash,
    encode_step,
    medium_name,
    sglang_hash,
)
from kvindex.sim.encoding import wire_hash as _wire_hash
from kvindex.sim.engine import (
    CPU,
    DISK,
    GPU,
    Engine,
    EngineSpec,
    Offloaded,
    Removed,
    SimEvent,
    Stored,
)
from kvindex.sim.workload import Workload, WorkloadShape
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import BlockHash
from kvindex.wire.pools import PoolCopies, PoolKey

__all__ = ["Reference", "SimBatch", "SimConfig", "SimItem", "SimRestart", "Simulation", "payloads"]

Reference = dict[SourceKey, PoolCopies]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What to simulate. Incidents are given as mean numbers of batches between two."""

    instances: int = 3
    dp: int = 1
    format: WireFormat = "0.33"
    hashes: HashKind = "int"
    seed: int = 0
    block_size: int = 16
    gpu_blocks: int = 1024
    cpu_blocks: int = 4096
    cpu_every: int = 2  # instances 1, 1 + cpu_every, ... have a CPU tier; 0: none
    disk_blocks: int = 0  # a disk tier under each CPU tier (SGLang's HiCache storage); 0: none
    salt_share: float | None = None  # salted conversations; None: 0.2 for sglang, else 0
    max_running: int = 6
    restart_every: int = 4000  # batches (fleet-wide) between engine restarts; 0: never
    reset_every: int = 3000  # batches between prefix-cache resets; 0: never
    name_prefix: str = "vllm"
    workload: WorkloadShape = field(default_factory=WorkloadShape)

    def __post_init__(self) -> None:
        if self.instances < 1 or self.dp < 1:
            raise ValueError("instances and dp must be at least 1")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}")
        if self.hashes not in HASH_KINDS:
            raise ValueError(f"hashes must be one of {', '.join(HASH_KINDS)}")
        if self.block_size < 1 or self.gpu_blocks < 8:
            raise ValueError("block_size must be >= 1 and gpu_blocks >= 8")
        counts = (self.restart_every, self.reset_every, self.cpu_every, self.cpu_blocks)
        if min(*counts, self.disk_blocks) < 0:
            raise ValueError(
                "restart_every, reset_every, cpu_every, cpu_blocks, disk_blocks must be >= 0"
            )
        if self.format == "sglang" and self.hashes != "int":
            raise ValueError("SGLang publishes int hashes only")
        if self.disk_blocks and self.format != "sglang":
            raise ValueError("a disk tier is simulated for the sglang format only")
        if self.salt_share is not None and not 0.0 <= self.salt_share <= 1.0:
            raise ValueError("salt_share must be between 0 and 1")

    @property
    def is_sglang(self) -> bool:
        return self.format == "sglang"

    @property
    def salts(self) -> float:
        """The share of conversations under a cache_salt."""
        if self.salt_share is not None:
            return self.salt_share
        return 0.2 if self.is_sglang else 0.0

    def name(self, instance: int) -> str:
        return f"{self.name_prefix}-{instance}"

    def has_cpu_tier(self, instance: int) -> bool:
        every = self.cpu_every
        return bool(every and self.cpu_blocks) and instance % every == 1 % every


@dataclass(frozen=True, slots=True)
class SimBatch:
    """One published batch: which publisher sent it, its seq and the payload bytes."""

    instance: str
    rank: int
    seq: int
    ts: float
    payload: bytes
    stored: int  # blocks stored (all media)
    removed: int  # blocks removed

    @property
    def source(self) -> SourceKey:
        return SourceKey(self.instance, self.rank)


@dataclass(frozen=True, slots=True)
class SimRestart:
    """Every DP rank of `instance` restarted: seqs from 0, caches empty."""

    instance: str


SimItem = SimBatch | SimRestart


class Simulation:
    """Engines, a workload and incidents, stepped deterministically."""

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
        start_ts: float = 1_700_000_000.0,
        step_seconds: float = 0.05,
    ) -> None:
        self.config = config = config or SimConfig()
        self.rng = random.Random(config.seed)
        shape = config.workload
        if shape.block_size != config.block_size or shape.salt_share != config.salts:
            shape = replace(shape, block_size=config.block_size, salt_share=config.salts)
        self.workload = Workload(random.Random(self.rng.random()), config.instances, shape)
        self.engines: list[Engine] = []
        for i in range(config.instances):
            spec = EngineSpec(
                block_size=config.block_size,
                gpu_blocks=config.gpu_blocks,
                cpu_blocks=config.cpu_blocks if config.has_cpu_tier(i) else 0,
                disk_blocks=config.disk_blocks if config.has_cpu_tier(i) else 0,
                page_tiers=config.is_sglang,
                max_running=config.max_running,
            )
            for _ in range(config.dp):
                engine_rng = random.Random(self.rng.random())
                self.engines.append(Engine(len(self.engines), i, spec, engine_rng))
        self.seqs = [0] * len(self.engines)
        self.tick = 0
        self.batches = 0
        self.restarts = 0
        self.resets = 0
        self._clock = clock
        self._start_ts = start_ts
        self._step_seconds = step_seconds
        self._pending: list[SimItem] = []
        self._turn = 0

    # -- who is who ----------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [self.config.name(i) for i in range(self.config.instances)]

    def engine(self, instance: str, rank: int = 0) -> Engine:
        return self.engines[self.names.index(instance) * self.config.dp + rank]

    def source_of(self, engine: Engine) -> SourceKey:
        return SourceKey(self.config.name(engine.instance), engine.index % self.config.dp)

    # -- the stream ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[SimItem]:
        while True:
            yield self.next_item()

    def items(self, batches: int) -> Iterator[SimItem]:
        """The next items, up to and including the `batches`-th next batch."""
        done = 0
        while done < batches:
            item = self.next_item()
            done += isinstance(item, SimBatch)
            yield item

    def next_item(self) -> SimItem:
        while not self._pending:
            self._advance()
        return self._pending.pop(0)

    def _advance(self) -> None:
        self.tick += 1
        cfg = self.config
        if cfg.restart_every and self.rng.random() < 1.0 / cfg.restart_every:
            self._restart(self.rng.randrange(cfg.instances))
        if cfg.reset_every and self.rng.random() < 1.0 / cfg.reset_every:
            engine = self.rng.choice(self.engines)
            self._emit(engine, engine.reset_prefix_cache())
            self.resets += 1
        engine = self.engines[self._turn]
        self._turn = (self._turn + 1) % len(self.engines)
        events = engine.step(self.workload, self.tick)
        if events:
            self._emit(engine, events)

    def _restart(self, instance: int) -> None:
        for engine in self.engines:
            if engine.instance == instance:
                for request in engine.restart():
                    self.workload.aborted(request, self.tick)
                self.workload.forget_engine(engine.index)
                self.seqs[engine.index] = 0
        self.restarts += 1
        self._pending.append(SimRestart(self.config.name(instance)))

    def _emit(self, engine: Engine, events: list[SimEvent]) -> None:
        cfg = self.config
        ts = self._now()
        rank = engine.index % cfg.dp
        payload = encode_step(events, ts, rank, cfg.block_size, cfg.format, cfg.hashes)
        seq = self.seqs[engine.index]
        self.seqs[engine.index] = seq + 1
        self.batches += 1
        stored = sum(len(e.digests) for e in events if isinstance(e, Stored | Offloaded))
        removed = sum(len(e.digests) for e in events if isinstance(e, Removed))
        name = cfg.name(engine.instance)
        self._pending.append(SimBatch(name, rank, seq, ts, payload, stored, removed))

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        return self._start_ts + self.tick * self._step_seconds

    # -- the truth -----------------------------------------------------------------------

    def reference(self) -> Reference:
        """Per publisher and (group, medium): each hash held and its physical copies."""
        cfg = self.config
        out: Reference = {}
        for engine in self.engines:
            pools: dict[PoolKey, dict[BlockHash, int]] = {}
            if cfg.is_sglang:
                tiers = [
                    (GPU, engine.gpu_copies()),
                    (CPU, dict.fromkeys(engine.cpu_digests(), 1)),
                    (DISK, dict.fromkeys(engine.disk_digests(), 1)),
                ]
                for medium, held in tiers:
                    if held:
                        pools[(0, medium_name(medium, cfg.format))] = {
                            sglang_hash(d): n for d, n in held.items()
                        }
                out[self.source_of(engine)] = pools
                continue
            gpu = {_wire_hash(d, cfg.hashes): n for d, n in engine.gpu_copies().items()}
            if gpu:
                pools[(0, GPU)] = gpu
            cpu = {cpu_hash(d, cfg.hashes, cfg.format): 1 for d in engine.cpu_digests()}
            if cpu:
                pools[(0, CPU)] = cpu
            out[self.source_of(engine)] = pools
        return out

    def recent_prompts(self, limit: int = 12) -> list[dict[str, Any]]:
        """The latest prompts handed to the engines, newest first (for a lookup box)."""
        cfg = self.config
        recent = list(self.workload.recent)[-limit:]
        return [
            {
                "instance": cfg.name(p.instance),
                "lora_name": p.lora_name,
                "cache_salt": p.salt,
                "token_ids": p.token_ids,
                "kind": p.kind,
                "block_size": cfg.block_size,
                "age_batches": self.tick - p.tick,
            }
            for p in reversed(recent)
        ]


def payloads(config: SimConfig | None = None, batches: int = 1000) -> list[bytes]:
    """Just the payloads of `batches` batches (restarts left out): a benchmark's input."""
    sim = Simulation(config)
    return [item.payload for item in sim.items(batches) if isinstance(item, SimBatch)]
