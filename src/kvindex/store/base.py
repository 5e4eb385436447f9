"""What every store offers the service: `Store`, `SharedStore` for what a store that
several replicas share adds, and `StoreError`, which every store raises."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvindex.index import FleetIndex
from kvindex.runtime import MembershipFeed, StoreHealth
from kvindex.subscriber import Subscriber
from kvindex.subscriber.messages import Item, SourceKey
from kvindex.subscriber.spec import InstanceSpec
from kvindex.subscriber.state import Checkpoint


class StoreError(RuntimeError):
    """The store can't be opened or used; the message says why, in one line."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a warm start found: where each publisher stopped, and instances added at runtime."""

    checkpoints: dict[SourceKey, Checkpoint] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)  # name -> spec text
    blocks_restored: int = 0
    log_batches_replayed: int = 0
    seconds: float = 0.0


class Store(Protocol):
    """Persists what the service applies, so it can come back warm."""

    @property
    def url(self) -> str: ...

    def load(self, index: FleetIndex) -> LoadResult:
        """Fill `index` with the persisted state (before ingest starts)."""

    def start(self) -> None: ...

    def record(self, item: Item) -> None:
        """Called for every item the index applied, in order. Must not block."""

    def record_batches(
        self, source: SourceKey, first_seq: int, count: int, packed: bytes | memoryview
    ) -> None:
        """`count` consecutive batches of `source` the index applied (seqs first_seq,
        first_seq + 1, ...; the C path's of one read), their payloads `packed` as one
        msgpack array of bin (`protocol.pack_payloads`), in order with `record`'s items.
        Must not block."""

    def flush(self) -> None:
        """Hand over what `record` has queued (called after each read the ingest applied:
        a store may group records, but not hold them back waiting for more)."""

    def save_instance(self, spec: InstanceSpec) -> None: ...

    def remove_instance(self, name: str) -> None: ...

    def sync(self, timeout: float = 30.0) -> None:
        """Wait until everything recorded so far is durable."""

    def close(self, timeout: float = 30.0) -> None: ...

    def health(self) -> StoreHealth:
        """Whether the store persists now, and if not why (see StoreHealth)."""
        ...

    def shared(self) -> SharedStore | None:
        """The store as several replicas share it (Redis), or None (memory, SQLite)."""
        ...


class SharedStore(Store, Protocol):
    """A store several `serve` replicas share (Redis): each replica answers for the whole
    fleet, so the store also feeds it the batches the others ingest, and the instances
    they add and remove. The service builds its Fleet from these after `load`."""

    @property
    def subscriber(self) -> Subscriber:
        """The Fleet's Subscriber: the instances this replica ingests, plus the others'
        batches read from the shared store."""
        ...

    @property
    def membership(self) -> MembershipFeed:
        """Instances other replicas add and remove, for the Fleet to follow."""
        ...

    def share(self, specs: Iterable[InstanceSpec]) -> None:
        """Register the instances this replica was configured with, for the others (before
        `start`)."""


class MemoryStore:
    """`--store memory`: nothing persists; a restart starts cold."""

    url = "memory"

    def load(self, index: FleetIndex) -> LoadResult:
        return LoadResult()

    def start(self) -> None:
        pass

    def record(self, item: Item) -> None:
        pass

    def record_batches(
        self, source: SourceKey, first_seq: int, count: int, packed: bytes | memoryview
    ) -> None:
        pass

    def flush(self) -> None:
        pass

    def save_instance(self, spec: InstanceSpec) -> None:
        pass

    def remove_instance(self, name: str) -> None:
        pass

    def sync(self, timeout: float = 30.0) -> None:
        pass

    def close(self, timeout: float = 30.0) -> None:
        pass

    def health(self) -> StoreHealth:
        return StoreHealth(self.url)

    def shared(self) -> SharedStore | None:
        return None
