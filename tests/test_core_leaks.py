"""The compiled core frees what it no longer needs: its C allocations, counted.

Every malloc/calloc/realloc/free of the core goes through csrc/alloc.h, so
`kvindex.index._core.allocated()` is exactly the (bytes, blocks) the C holds. Churn
(stores of every shape over many publishers, removals, clears, restarts, instances
removed, lookups, tree walks) must leave nothing behind once everything is dropped: the
core then holds the same small amount after any number of cycles, whatever new hashes,
adapters and salts came and went, and nothing once the index is deleted.

The pure-Python reference has no such counter; its exactness is held to the compiled
one by tests/test_core.py.
"""

from __future__ import annotations

import gc
import random
import threading
from typing import Any

import pytest

from kvindex.index.localhash import local_hashes
from kvindex.index.multimodal import MMFeature
from kvindex.subscriber import SourceKey
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvindex.wire.publisher import encode_batch

compiled = pytest.importorskip("kvindex.index.compiled", reason="the compiled core is not built")
_core = pytest.importorskip("kvindex.index._core")
CompiledIndex = compiled.CompiledIndex

BS = 4
INSTANCES = [f"engine-{i}" for i in range(6)]
POOLS = [(0, None), (0, "CPU"), (1, None), (0, "DISK"), (2, "GPU")]


def allocated() -> tuple[int, int]:
    gc.collect()
    bytes_, blocks = _core.allocated()
    return int(bytes_), int(blocks)


class Churn:
    """A seeded workload over many publishers; `cycle` runs one and drops everything."""

    def __init__(self, index: Any, seed: int) -> None:
        self.index = index
        self.rng = random.Random(seed)
        self.cycles = 0

    def cycle(self, steps: int = 400) -> None:
        rng, index = self.rng, self.index
        tag = self.cycles  # new hashes, adapters and salts every cycle
        self.cycles += 1
        held: dict[SourceKey, list[tuple[int | bytes, str | None, int]]] = {}
        prompts = [[rng.randrange(50_000) for _ in range(BS * 12)] for _ in range(6)]
        for seq in range(steps):
            src = SourceKey(rng.choice(INSTANCES), rng.randrange(2))
            roll = rng.random()
            if roll < 0.55:
                event = self._stored(prompts, tag)
                group, medium = event.group_idx or 0, event.medium
                held.setdefault(src, []).extend((h, medium, group) for h in event.block_hashes)
                self._apply(src, [event], seq)
            elif roll < 0.8 and held.get(src):
                h, medium, group = held[src].pop(rng.randrange(len(held[src])))
                self._apply(src, [BlockRemoved([h], medium=medium, group_idx=group)], seq)
            elif roll < 0.84:
                held.pop(src, None)
                self._apply(src, [AllBlocksCleared()], seq)
            elif roll < 0.88:
                held.pop(src, None)
                index.drop_source(src)  # an engine restart
            elif roll < 0.9:
                for key in list(held):
                    if key.instance == src.instance:
                        del held[key]
                index.remove_instance(src.instance)
            else:
                prompt = rng.choice(prompts)
                index.lookup(prompt)
                index.lookup(prompt, lora_name=f"ad-{tag}", cache_salt=f"salt-{tag}-1")
                index.lookup_hashes([self._hash(prompt, n, tag, 0) for n in range(12)])
                if index.local_hashes:  # Dynamo's local hashes, plain and in a LoRA's seed
                    index.lookup_local_hashes(local_hashes(prompt, BS))
                    index.lookup_local_hashes(local_hashes(prompt, BS, f"ad-{tag}"))
                # an image prompt's keys (the own-keyed blocks' digests, made per size)
                index.lookup(prompt, mm_features=[MMFeature(f"img-{tag}", 2, 5)])
        list(index.walk_tree())
        for src in index.sources():
            index.copies(src)
        for name in index.instances():
            index.remove_instance(name)
        assert index.tree_nodes() == 0 and index.entries() == 0

    def _apply(self, src: SourceKey, events: list[Any], seq: int) -> None:
        generation = "arrays" if self.rng.random() < 0.3 else "maps"
        if any(isinstance(e, BlockStored) and e.cache_salt for e in events):
            generation = "maps"
        payload = encode_batch(events, float(seq), src.rank, generation)  # type: ignore[arg-type]
        if self.rng.random() < 0.8:
            self.index.apply_payload(src, payload, seq)  # the C parser (or its fallback)
        else:
            self.index.apply(src, EventBatch(float(seq), events, src.rank), seq)  # ops

    def _hash(self, prompt: list[int], n: int, tag: int, ns: int) -> int | bytes:
        h = hash((tag, ns, tuple(prompt[: (n + 1) * BS]))) & (2**64 - 1)
        return h.to_bytes(8, "big") * 4 if ns % 3 == 2 else h

    def _stored(self, prompts: list[list[int]], tag: int) -> BlockStored:
        rng = self.rng
        prompt = rng.choice(prompts)
        first = rng.randrange(8)
        last = min(12, first + rng.randrange(1, 5))
        ns = rng.randrange(6)
        hashes = [self._hash(prompt, n, tag, ns) for n in range(first, last)]
        parent = self._hash(prompt, first - 1, tag, ns) if first else None
        group, medium = rng.choice(POOLS)
        fields: dict[str, Any] = {"medium": medium, "group_idx": group}
        if ns == 1:
            fields["lora_name"] = f"ad-{tag}"
            fields["extra_keys"] = [[f"ad-{tag}"] for _ in hashes]
        elif ns == 3:
            fields["cache_salt"] = f"salt-{tag}-{rng.randrange(3)}"  # SGLang's way
        elif ns == 4 and first == 0:
            fields["extra_keys"] = [[f"salt-{tag}-1"]] + [None] * (len(hashes) - 1)  # vLLM's
        elif ns == 5:
            fields["lora_id"] = 1000 + tag  # pre-0.14 vLLM
        tokens = prompt[first * BS : last * BS]
        if rng.random() < 0.1:
            tokens = []  # hash-only (an offload event)
        return BlockStored(hashes, parent, tokens, BS, **fields)


def test_churn_leaves_a_constant_behind_and_a_deleted_core_nothing() -> None:
    before = allocated()
    index = CompiledIndex(seed=11, local_hashes=True)
    churn = Churn(index, seed=1)
    levels = []
    for _ in range(3):  # the tables reach the sizes this workload needs
        churn.cycle()
        levels.append(allocated())
    settled_blocks = levels[-1][1]
    settled_bytes = max(level[0] for level in levels)
    # Small: the emptied tables, the node array at its peak (20 B a node), a parse
    # scratch, and the answers' shared dicts (13 x 2048 pointers, once a lookup ran).
    assert settled_bytes - before[0] < 512 * 1024 and settled_blocks - before[1] < 64
    for _ in range(8):  # new hashes, adapters and salts each time
        churn.cycle()
        bytes_, blocks = allocated()
        # The same blocks (the emptied tables, the scratch, the answers' shared dicts);
        # their sizes vary a little with where each table's last shrink left it.
        assert blocks == settled_blocks, churn.cycles
        assert bytes_ <= settled_bytes + 16 * 1024, churn.cycles
    del index, churn
    assert allocated() == before


def test_a_core_deleted_while_an_ingest_thread_lives_frees_its_scratch() -> None:
    """Each ingest thread parses into its own scratch: the Core frees every thread's when
    it goes, not only the deleting thread's (a worker may outlive the index it fed)."""
    before = allocated()
    indexes = [CompiledIndex(seed=3)]  # the one reference: cleared below
    applied, done = threading.Event(), threading.Event()
    events = [BlockStored(list(range(1, 65)), None, list(range(256)), BS)]
    payload = encode_batch(events, 1.0, 0)  # type: ignore[arg-type]

    def worker() -> None:
        indexes[0].apply_payload(SourceKey("w"), payload, 1)
        applied.set()
        done.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert applied.wait(10)
        indexes.clear()
        assert allocated() == before
    finally:
        done.set()
        thread.join(10)
    assert allocated() == before


def test_a_huge_batch_leaves_no_huge_scratch_behind() -> None:
    """The parse scratch grows to the largest batch; one of millions of tokens is not
    kept for the index's life."""
    index = CompiledIndex(seed=4)
    small = [BlockStored([1], None, [1, 2, 3, 4], BS)]
    index.apply_payload(SourceKey("a"), encode_batch(small, 1.0, 0), 1)  # type: ignore[arg-type]
    index.drop_source(SourceKey("a"))
    kept = allocated()
    tokens = [7] * (BS * 300_000)
    huge = [BlockStored(list(range(1, 300_001)), None, tokens, BS)]
    index.apply_payload(SourceKey("a"), encode_batch(huge, 2.0, 0), 2)  # type: ignore[arg-type]
    index.drop_source(SourceKey("a"))
    nodes = index.memory()["nodes"]  # the node array keeps its peak (a free list)
    assert allocated()[1] <= kept[1] and allocated()[0] - nodes < kept[0] + (1 << 20)
