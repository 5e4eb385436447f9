"""FleetIndex against a reference model of vLLM's block pools.

The reference keeps, per publisher, a multiset of (group, medium, hash) copies, with hashes
computed the way vLLM does it (a function of the whole token prefix and the LoRA name), and
answers a lookup as vLLM would: the GPU hit is the run of leading blocks every KV cache
group holds on the GPU (full-attention groups: the coordinator takes the shortest), then
the offloading connector adds the run its CPU tier holds from there. The index must agree
with it after any sequence of stores, duplicate copies, removals, clears and restarts, and
free its tree nodes once nothing is held.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.index import FleetIndex
from kvindex.subscriber import Delivery, Restarted, SourceKey
from kvindex.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvindex.wire.publisher import encode_batch

BS = 4  # block size
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24, 25, 26, 27],  # shares 2 blocks
    [1, 2, 3, 4, 30, 31, 32, 33],  # shares 1 block
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51],
]


def block_hash(tokens: list[int], n: int, lora: str | None) -> int:
    """Block n's hash: a function of every token up to its end, like vLLM's chained hash."""
    return hash((lora, tuple(tokens[: (n + 1) * BS]))) & (2**64 - 1)


def batch(*events: object) -> EventBatch:
    return EventBatch(0.0, list(events))  # type: ignore[arg-type]


class Reference:
    def __init__(self) -> None:
        self.copies: dict[SourceKey, Counter[tuple[int, str, int]]] = {}
        self.pools: dict[SourceKey, set[tuple[int, str]]] = {}  # pools since the last clear

    def store(self, src: SourceKey, hashes: list[int], group: int, medium: str) -> None:
        c = self.copies.setdefault(src, Counter())
        self.pools.setdefault(src, set()).add((group, medium))
        for h in hashes:
            c[(group, medium, h)] += 1

    def remove(self, src: SourceKey, h: int, group: int, medium: str) -> None:
        c = self.copies.setdefault(src, Counter())
        if c[(group, medium, h)] > 0:
            c[(group, medium, h)] -= 1
        if c[(group, medium, h)] == 0:
            del c[(group, medium, h)]

    def clear(self, src: SourceKey) -> None:
        self.copies[src] = Counter()
        self.pools[src] = set()

    def held(self, src: SourceKey) -> set[int]:
        return {h for (_, _, h) in self.copies.get(src, Counter())}

    def blocks(self, instance: str, medium: str | None = None) -> set[int]:
        return {
            h
            for src, c in self.copies.items()
            if src.instance == instance
            for (_, m, h) in c
            if medium is None or m == medium
        }

    def matched(self, src: SourceKey, prompt: list[int], lora: str | None) -> int:
        copies = self.copies.get(src, Counter())
        blocks = len(prompt) // BS

        def held(group: int, medium: str, n: int) -> bool:
            return n < blocks and (group, medium, block_hash(prompt, n, lora)) in copies

        groups = sorted({g for g, m in self.pools.get(src, set()) if m == "GPU"})
        gpu = [next(n for n in range(blocks + 1) if not held(g, "GPU", n)) for g in groups]
        n = min(gpu, default=0)
        while held(0, "CPU", n):
            n += 1
        return n


SOURCES = [SourceKey("a"), SourceKey("b", 0), SourceKey("b", 1), SourceKey("c")]

ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "store", "remove", "remove", "clear", "restart"]),
        st.integers(0, len(SOURCES) - 1),
        st.integers(0, len(PROMPTS) - 1),
        st.integers(0, 3),  # first block
        st.integers(1, 4),  # number of blocks
        st.sampled_from([None, "lora-x"]),
        st.sampled_from([(0, "GPU"), (0, "GPU"), (0, "CPU"), (1, "GPU")]),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_index_matches_reference(plan: list[tuple]) -> None:
    index, ref = FleetIndex(), Reference()
    for kind, s, p, first, count, lora, (group, medium) in plan:
        src, prompt = SOURCES[s], PROMPTS[p]
        nblocks = len(prompt) // BS
        if kind == "store":
            first = min(first, nblocks - 1)
            last = min(nblocks, first + count)
            # vLLM stores a block only while its parent is cached (the request holds it).
            if first > 0 and block_hash(prompt, first - 1, lora) not in ref.held(src):
                first = 0
            hashes = [block_hash(prompt, n, lora) for n in range(first, last)]
            parent = block_hash(prompt, first - 1, lora) if first else None
            event = BlockStored(
                hashes,
                parent,
                prompt[first * BS : last * BS],
                BS,
                lora_name=lora,
                medium=medium,
                group_idx=group,
            )
            index.apply(src, batch(event))
            ref.store(src, hashes, group, medium)
        elif kind == "remove":
            held = sorted(ref.copies.get(src, Counter()))
            if not held:
                continue
            g, m, h = held[(first * 7 + count) % len(held)]
            index.apply(src, batch(BlockRemoved([h], medium=m, group_idx=g)))
            ref.remove(src, h, g, m)
        elif kind == "clear":
            index.apply(src, batch(AllBlocksCleared()))
            ref.clear(src)
        else:
            index.handle(Restarted(src))
            ref.clear(src)
    for name in ("a", "b", "c"):
        assert index.block_hashes(name) == ref.blocks(name)
        assert index.block_hashes(name, "CPU") == ref.blocks(name, "CPU")
    for prompt in [*PROMPTS, PROMPTS[0][:10], []]:
        for lora in (None, "lora-x"):
            rows = {r.instance: r for r in index.lookup(prompt, lora)}
            for src in SOURCES:
                if src.instance in rows:
                    assert rows[src.instance].ranks.get(src.rank, 0) == ref.matched(
                        src, prompt, lora
                    )
            for row in rows.values():
                assert row.matched_blocks == max(row.ranks.values())
                assert row.matched_tokens == row.matched_blocks * (BS if row.matched_blocks else 0)
    # Memory follows what is held: drop everything and no tree node may remain.
    for src in SOURCES:
        index.drop_source(src)
    assert index.tree_nodes() == 0
    assert index.entries() == 0


def test_duplicate_copy_removal_keeps_hash() -> None:
    index, a = FleetIndex(), SourceKey("a")
    store = BlockStored([7], None, [1, 2, 3, 4], BS)
    index.apply(a, batch(store, store))  # two physical copies of one block
    index.apply(a, batch(BlockRemoved([7])))
    assert index.block_hashes("a") == {7}
    assert index.lookup([1, 2, 3, 4])[0].matched_blocks == 1
    index.apply(a, batch(BlockRemoved([7])))
    assert index.block_hashes("a") == set()
    assert index.lookup([1, 2, 3, 4])[0].matched_blocks == 0
    assert index.tree_nodes() == 0


def test_removal_of_unknown_hash_is_ignored() -> None:
    index, a = FleetIndex(), SourceKey("a")
    index.apply(a, batch(BlockRemoved([99]), BlockStored([1], None, [1, 2, 3, 4], BS)))
    index.apply(a, batch(BlockRemoved([99])))
    assert index.block_hashes("a") == {1}


def test_same_hash_in_two_mediums_is_held_until_both_go() -> None:
    index, a = FleetIndex(), SourceKey("a")
    index.apply(a, batch(BlockStored([5], None, [1, 2, 3, 4], BS, medium="GPU")))
    index.apply(a, batch(BlockStored([5], None, [], BS, medium="CPU")))  # hash-only offload
    assert index.blocks_by_medium("a") == {"CPU": 1, "GPU": 1}
    index.apply(a, batch(BlockRemoved([5], medium="GPU")))
    assert index.block_hashes("a") == {5} and index.block_hashes("a", "GPU") == set()
    assert index.lookup([1, 2, 3, 4])[0].matched_blocks == 1  # the CPU copy still serves it
    index.apply(a, batch(BlockRemoved([5], medium="CPU")))
    assert index.lookup([1, 2, 3, 4])[0].matched_blocks == 0


def test_hash_only_events_count_but_cannot_be_found_by_tokens() -> None:
    index, a = FleetIndex(), SourceKey("a")
    index.apply(a, batch(BlockStored([b"\x01" * 32, b"\x02" * 32], None, [], 16, medium="CPU")))
    assert index.block_hashes("a", "CPU") == {b"\x01" * 32, b"\x02" * 32}
    assert index.lookup(list(range(32)))[0].matched_blocks == 0


def test_lora_namespaces_are_separate() -> None:
    index, a = FleetIndex(), SourceKey("a")
    index.apply(
        a, batch(BlockStored([1], None, [1, 2, 3, 4], BS, lora_name="x", extra_keys=[["x"]]))
    )
    assert index.lookup([1, 2, 3, 4], "x")[0].matched_blocks == 1
    assert index.lookup([1, 2, 3, 4])[0].matched_blocks == 0
    assert index.lookup([1, 2, 3, 4], "y")[0].matched_blocks == 0


def test_blocks_keyed_by_other_extra_keys_are_not_token_matchable() -> None:
    index, a = FleetIndex(), SourceKey("a")
    index.apply(a, batch(BlockStored([1], None, [1, 2, 3, 4], BS, extra_keys=[["salt"]])))
    assert index.block_hashes("a") == {1}
    assert index.lookup([1, 2, 3, 4])[0].matched_blocks == 0


def test_dp_ranks_union_and_best_rank() -> None:
    index = FleetIndex()
    r0, r1 = SourceKey("e", 0), SourceKey("e", 1)
    toks = list(range(12))
    index.apply(r0, batch(BlockStored([1], None, toks[:4], BS)))
    index.apply(r1, batch(BlockStored([1, 2, 3], None, toks, BS)))
    (row,) = index.lookup(toks)
    assert (row.matched_blocks, row.best_rank, row.ranks) == (3, 1, {0: 1, 1: 3})
    assert index.block_hashes("e") == {1, 2, 3}
    index.handle(Restarted(r1))
    (row,) = index.lookup(toks)
    assert (row.matched_blocks, row.best_rank) == (1, 0)
    assert index.block_hashes("e") == {1}


def test_clear_only_affects_its_publisher() -> None:
    index = FleetIndex()
    a, b = SourceKey("a"), SourceKey("b")
    for src in (a, b):
        index.apply(src, batch(BlockStored([1, 2], None, list(range(8)), BS)))
    index.handle(Delivery(a, 1, batch(AllBlocksCleared())))
    assert index.block_hashes("a") == set() and index.block_hashes("b") == {1, 2}
    assert {r.instance: r.matched_blocks for r in index.lookup(list(range(8)))} == {"a": 0, "b": 2}
    assert index.cache_stats("a").clears == 1


def test_stats_and_rates() -> None:
    index, a = FleetIndex(), SourceKey("a")
    index.apply(a, batch(BlockStored([1, 2, 3], None, list(range(12)), BS), BlockRemoved([3])))
    stats = index.cache_stats("a")
    assert (stats.stored, stats.removed, stats.active) == (3, 1, 2)
    rates = index.rates.per_minute()
    assert rates["stores_per_minute"] == 3 and rates["net_growth_per_minute"] == 2


def test_remove_instance_frees_everything() -> None:
    index, a = FleetIndex(), SourceKey("a")
    index.apply(a, batch(BlockStored([1, 2], None, list(range(8)), BS)))
    index.remove_instance("a")
    assert index.instances() == [] and index.tree_nodes() == 0


@pytest.mark.parametrize("seed", range(3))
def test_churn_keeps_memory_bounded(seed: int) -> None:
    # Prefix churn: many distinct prompts stored and evicted; nodes must not accumulate.
    rng = random.Random(seed)
    index, a = FleetIndex(), SourceKey("a")
    live: list[list[int]] = []
    for _ in range(2000):
        toks = [rng.randrange(1000) for _ in range(8)]
        hashes = [block_hash(toks, 0, None), block_hash(toks, 1, None)]
        index.apply(a, batch(BlockStored(hashes, None, toks, BS)))
        live.append(hashes)
        if len(live) > 50:
            index.apply(a, batch(BlockRemoved(live.pop(0))))
    assert index.tree_nodes() <= 2 * 50 + 2


def test_a_publisher_holds_at_most_max_pools_pools() -> None:
    """A hostile publisher naming ever new KV cache groups: the first MAX_POOLS (group,
    medium) pools are held, stores to others are counted but not held, nothing raises."""
    from kvindex.index.reference import MAX_POOLS

    index, a = FleetIndex(), SourceKey("a")
    events = [BlockStored([g], None, [g, 1, 2, 3], BS, group_idx=g) for g in range(MAX_POOLS + 8)]
    index.apply_payload(a, encode_batch(events, 1.0, 0))
    pools = index.copies(a)
    assert sorted(group for group, _ in pools) == list(range(MAX_POOLS))
    assert index.entries() == MAX_POOLS and index.cache_stats("a").stored == MAX_POOLS + 8
    index.apply(a, batch(BlockRemoved([0], group_idx=0)))  # a pool held before still works
    assert index.entries() == MAX_POOLS - 1
    index.drop_source(a)
    assert index.tree_nodes() == 0 and index.entries() == 0


def test_block_sizes_past_max_root_sizes_are_held_without_a_place() -> None:
    """Chains of more distinct block sizes than MAX_ROOT_SIZES at once: the later sizes'
    blocks are held, counted unplaced, and found by hash, not by tokens, until a size
    goes."""
    from kvindex.index.reference import MAX_ROOT_SIZES

    index, a = FleetIndex(), SourceKey("a")
    sizes = range(1, MAX_ROOT_SIZES + 3)
    index.apply(a, batch(*(BlockStored([size], None, [size] * size, size) for size in sizes)))
    assert index.cache_stats("a").unplaced == 2
    assert index.lookup([1] * 1)[0].matched_blocks == 1
    last = MAX_ROOT_SIZES + 2
    assert index.lookup([last] * last)[0].matched_blocks == 0
    assert index.lookup_hashes([last])[0].matched_blocks == 1
    index.apply(a, batch(BlockRemoved([1])))  # size 1's root goes: room for another size
    index.apply(a, batch(BlockStored([100], None, [last] * last, last)))
    assert index.lookup([last] * last)[0].matched_blocks == 1
