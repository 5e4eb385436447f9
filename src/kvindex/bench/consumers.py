"""The three consumers every case runs side by side on the same input.

- `Kvindex`: `BatchDecoder` + `FleetIndex`, what `kvindex serve` runs.
- `Naive`: the classic example's consumer: untyped `msgspec.msgpack.decode` and one set of
  hashes per instance. It is not exact (a block vLLM holds twice is forgotten at its first
  eviction) and cannot answer a token lookup (it has no tokens), so its lookups are handed
  the prompt's block hashes for free.
- `Dynamo`: NVIDIA Dynamo's KV router radix tree (`dynamo._core.RadixTree`, PyPI
  `ai-dynamo-runtime`, the `[bench]` extra) through its Python binding, for lookups and
  memory in process: each store of a fill is converted to Dynamo's `KvCacheEvent` JSON
  (block hashes plus the hash of each block's tokens, from Dynamo's own
  `compute_block_hash_for_seq`) and applied; a lookup hashes the prompt's tokens the same
  way and asks `find_matches`. (Not for ingest: through the binding every event is JSON
  and a call, which measures the binding, not Dynamo. Dynamo's standalone indexer is the
  end-to-end peer, `e2e.dynamo`.) Optional: `dynamo_api()` says why it is missing instead
  of failing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from kvindex.bench.common import BLOCK
from kvindex.bench.workloads import Batch, FillStore
from kvindex.index import FleetIndex
from kvindex.subscriber.messages import SourceKey
from kvindex.wire import BatchDecoder, BlockHash, BlockStored, EventBatch

__all__ = ["Dynamo", "Kvindex", "Naive", "dynamo_api", "dynamo_status"]


class Kvindex:
    name = "kvindex"

    def __init__(self, instances: int) -> None:
        self.index = FleetIndex()
        self.decoder = BatchDecoder()
        self.sources = [SourceKey(f"i{i}") for i in range(instances)]

    def feed(self, batches: Sequence[Batch]) -> None:
        apply, sources = self.index.apply_payload, self.sources
        for instance, seq, payload in batches:
            apply(sources[instance], payload, seq)

    def build(self, stores: Iterable[FillStore]) -> None:
        apply, sources = self.index.apply, self.sources
        for s in stores:
            event = BlockStored(s.hashes, s.parent, s.tokens, BLOCK, medium="GPU")
            apply(sources[s.instance], EventBatch(0.0, [event]))

    def held(self) -> list[set[Any]]:
        """Per instance, the hashes it holds now."""
        return [self.index.block_hashes(f"i{i}") for i in range(len(self.sources))]

    # A lookup is `query` (the timed part: what a router calls) then `depths` (matched
    # blocks per instance, in instance order, to check that the consumers agree).

    def query(self, tokens: list[int], hashes: list[BlockHash]) -> Any:
        return self.index.lookup(tokens)

    def depths(self, answer: Any) -> list[int]:
        depth = {row.instance: row.matched_blocks for row in answer}
        return [depth.get(f"i{i}", 0) for i in range(len(self.sources))]


class Naive:
    name = "naive"

    def __init__(self, instances: int) -> None:
        self.sets: list[set[Any]] = [set() for _ in range(instances)]

    def feed(self, batches: Sequence[Batch]) -> None:
        apply = self.apply
        for instance, _seq, payload in batches:
            apply(instance, payload)

    def apply(self, instance: int, payload: bytes) -> None:
        """One batch as vLLM sends it (what the end-to-end naive subscriber calls too)."""
        blocks = self.sets[instance]
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                blocks.update(event["block_hashes"])
            elif kind == "BlockRemoved":
                blocks.difference_update(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                blocks.clear()

    def build(self, stores: Iterable[FillStore]) -> None:
        held = self.sets
        for s in stores:
            held[s.instance].update(s.hashes)

    def held(self) -> list[set[Any]]:
        return self.sets

    def query(self, tokens: list[int], hashes: list[BlockHash]) -> Any:
        """Per instance, how many of the prompt's block hashes it holds, from the first."""
        out = []
        for blocks in self.sets:
            depth = 0
            for h in hashes:
                if h not in blocks:
                    break
                depth += 1
            out.append(depth)
        return out

    def depths(self, answer: Any) -> list[int]:
        return list(answer)


def dynamo_api() -> Any:
    """`dynamo._core`, or raise ImportError/OSError with the reason it can't be used."""
    # Dynamo logs every skipped event at WARN on stderr; the bench counts them instead.
    os.environ.setdefault("DYN_LOG", "error")
    return importlib.import_module("dynamo._core")


def dynamo_status() -> dict[str, Any]:
    """Whether the Dynamo baseline can run here: {"available", "version" or "reason"}."""
    try:
        core = dynamo_api()
        core.RadixTree()
    except Exception as exc:  # any failure to load a native extension means "skip"
        return {"available": False, "reason": _reason(exc)}
    try:
        version = importlib.metadata.version("ai-dynamo-runtime")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "available": True,
        "version": version,
        "api": "dynamo._core.RadixTree: apply_event(worker_id, KvCacheEvent JSON), "
        "find_matches(compute_block_hash_for_seq(tokens, block_size))",
    }


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError):
        return "ai-dynamo-runtime is not installed (pip install -e '.[bench]')"
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


class Dynamo:
    name = "dynamo"

    def __init__(self, instances: int) -> None:
        core = dynamo_api()
        self.core = core
        self.tree = core.RadixTree()
        self.instances = instances
        self.event_id = 0
        self.rejected = 0  # events Dynamo refused (a parent it doesn't know, a block twice)
        self.encode = msgspec.json.Encoder().encode

    def _apply(self, worker: int, data: Any) -> None:
        self.event_id += 1
        event = {"event_id": self.event_id, "data": data, "dp_rank": 0}
        try:
            self.tree.apply_event(worker, self.encode(event))
        except (RuntimeError, ValueError):
            self.rejected += 1

    def _stored(self, hashes: list[Any], parent: Any, tokens: list[int], lora: Any) -> Any:
        local = self.core.compute_block_hash_for_seq(tokens, BLOCK, lora_name=lora)
        blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, local, strict=False)]
        return {"stored": {"parent_hash": parent, "blocks": blocks}}

    def build(self, stores: Iterable[FillStore]) -> None:
        for s in stores:
            self._apply(s.instance, self._stored(s.hashes, s.parent, s.tokens, None))
        self.sync()

    def sync(self) -> None:
        # The binding hands events to a background thread; a query waits for them.
        self.tree.find_matches([0])

    def query(self, tokens: list[int], hashes: list[BlockHash]) -> Any:
        # A router has tokens: hashing them is part of Dynamo's lookup, as it is of ours.
        return self.tree.find_matches(self.core.compute_block_hash_for_seq(tokens, BLOCK))

    def depths(self, answer: Any) -> list[int]:
        scores = answer.scores
        return [scores.get((i, 0), 0) for i in range(self.instances)]
