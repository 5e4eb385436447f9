"""The index model on the event shapes vLLM 0.33 and SGLang send (issue 20).

Each test feeds the events an engine sends for one situation (shapes copied from vLLM's
`BlockPool.cache_full_blocks` / `to_event_extra_keys` and SGLang's recorder) and checks what
a lookup answers against what the engine itself would reuse. The interop tests check the
same against the engines' running code; these pin each rule down on its own.
"""

from __future__ import annotations

import hashlib

from kvindex.index import FleetIndex
from kvindex.subscriber import SourceKey
from kvindex.wire import BigramBlockStored, BlockRemoved, BlockStored, EventBatch

BS = 4
A = SourceKey("a")
TOKENS = list(range(100, 148))  # 12 blocks


def h(name: str) -> int:
    """A block hash for a readable name ("h3": block 3 of chain h)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def hs(*names: str) -> set[int]:
    return {h(n) for n in names}


def removed(*names: str, **fields: object) -> BlockRemoved:
    return BlockRemoved([h(n) for n in names], **fields)  # type: ignore[arg-type]


def apply(index: FleetIndex, *events: object, source: SourceKey = A) -> None:
    index.apply(source, EventBatch(0.0, list(events)))  # type: ignore[arg-type]


def matched(index: FleetIndex, tokens: list[int], **names: str | None) -> int:
    rows = {r.instance: r for r in index.lookup(tokens, **names)}
    return rows["a"].matched_blocks if "a" in rows else 0


def chain(first: int, last: int, tag: str = "h") -> list[int]:
    return [h(f"{tag}{n}") for n in range(first, last)]


def stored(
    first: int, last: int, tag: str = "h", tokens: list[int] = TOKENS, **fields: object
) -> BlockStored:
    """Blocks first..last-1 of `tokens` (hashes `tagN`, as strings for readability), as
    vLLM >= 0.20 sends them (with `group_idx`)."""
    fields.setdefault("group_idx", 0)
    parent = h(f"{tag}{first - 1}") if first else None
    return BlockStored(
        chain(first, last, tag),  # type: ignore[arg-type]
        parent,  # type: ignore[arg-type]
        tokens[first * BS : last * BS],
        BS,
        **fields,  # type: ignore[arg-type]
    )


def test_plain_blocks_of_a_multimodal_request_are_found() -> None:
    # A 2-block system prompt then an image: vLLM stores one event of 3 blocks.
    index = FleetIndex()
    apply(index, stored(0, 3, "m", extra_keys=[None, None, [["img-hash", 0]]]))
    assert matched(index, TOKENS[:8]) == 2
    assert matched(index, TOKENS[:12]) == 2  # the image block needs its own keys
    assert index.block_hashes("a") == hs("m0", "m1", "m2")


def test_blocks_after_an_image_hang_under_it() -> None:
    index = FleetIndex()
    apply(index, stored(0, 3, "m", extra_keys=[None, [["img", 0]], None]))
    apply(index, stored(3, 5, "m"))  # the decode continues the image's chain
    assert matched(index, TOKENS[:20]) == 1
    assert index.cache_stats("a").unplaced == 0


def test_salt_is_a_namespace() -> None:
    index = FleetIndex()
    apply(index, stored(0, 3, "s", extra_keys=[["tenant-1"], None, None]))
    assert matched(index, TOKENS[:12]) == 0
    assert matched(index, TOKENS[:12], cache_salt="tenant-1") == 3
    assert matched(index, TOKENS[:12], cache_salt="tenant-2") == 0
    apply(index, stored(0, 2, "p"))  # the same tokens unsalted: another chain
    assert matched(index, TOKENS[:12]) == 2
    assert matched(index, TOKENS[:12], cache_salt="tenant-1") == 3


def test_lora_and_salt_together() -> None:
    index = FleetIndex()
    apply(
        index,
        stored(0, 2, "l", lora_name="ad", extra_keys=[["ad", "t"], ["ad"]]),
    )
    assert matched(index, TOKENS[:8], lora_name="ad", cache_salt="t") == 2
    assert matched(index, TOKENS[:8], lora_name="ad") == 0
    assert matched(index, TOKENS[:8], cache_salt="t") == 0


def test_sglang_salt_on_every_block() -> None:
    index = FleetIndex()
    apply(index, stored(0, 2, "s", cache_salt="x"), stored(2, 3, "s", cache_salt="x"))
    apply(index, stored(0, 2, "p"))
    assert matched(index, TOKENS[:12], cache_salt="x") == 3
    assert matched(index, TOKENS[:12]) == 2
    # Evicting the salted leaf leaves the unsalted pages alone (they share tokens only).
    apply(index, removed("s2"), removed("s1"))
    assert matched(index, TOKENS[:12]) == 2
    assert matched(index, TOKENS[:12], cache_salt="x") == 1


def test_two_hashes_on_the_same_tokens_hold_the_node_until_both_go() -> None:
    # A LoRA name reused with another adapter path: same namespace, same tokens, new hash.
    index = FleetIndex()
    apply(index, stored(0, 2, "x", lora_name="ad"), stored(0, 2, "y", lora_name="ad"))
    apply(index, removed("x1"), removed("x0"))
    assert matched(index, TOKENS[:8], lora_name="ad") == 2
    apply(index, removed("y1"))
    assert matched(index, TOKENS[:8], lora_name="ad") == 1
    apply(index, removed("y0"))
    assert matched(index, TOKENS[:8], lora_name="ad") == 0
    assert index.tree_nodes() == 0


def test_lora_id_without_a_name_never_matches_plain_lookups() -> None:
    index = FleetIndex()  # vLLM < 0.14 sends only the process-local lora_id
    apply(index, stored(0, 2, "x", lora_id=3))
    assert matched(index, TOKENS[:8]) == 0


def test_lookahead_tokens_are_own_keys() -> None:
    index = FleetIndex()
    apply(index, stored(0, 2, "k", lookahead_token_ids=[[7], [8]]))
    assert matched(index, TOKENS[:8]) == 0
    assert index.block_hashes("a") == hs("k0", "k1")


def test_unrecognised_key_shapes_are_counted_and_never_plain() -> None:
    index = FleetIndex()
    apply(index, stored(0, 2, "u", group_idx=0, extra_keys=[None, [{"odd": 1}]]))
    assert matched(index, TOKENS[:8]) == 1
    assert index.cache_stats("a").unrecognised_keys == 1
    apply(index, stored(0, 2, "v", group_idx=0, extra_keys=[[["img", 0]]]))  # not one per block
    assert index.cache_stats("a").unrecognised_keys == 3


def test_legacy_bare_strings_are_own_keys() -> None:
    # vLLM 0.17-0.19 (no group_idx): a bare string may be a multimodal id or a salt.
    index = FleetIndex()
    apply(index, stored(0, 2, "g", extra_keys=[["maybe-salt"], None], group_idx=None))
    assert matched(index, TOKENS[:8]) == 0
    assert matched(index, TOKENS[:8], cache_salt="maybe-salt") == 0


# -- sliding-window groups and positions ----------------------------------------------


def sw(first: int, hashes: list[str], window: int, tokens_from: int, **fields: object):
    """A sliding-window group's event: tokens of every block from `tokens_from` on, hashes
    only of the blocks it kept (vLLM skips null and masked blocks)."""
    last = int(hashes[-1][1:]) + 1
    return BlockStored(
        [h(name) for name in hashes],
        h(f"h{tokens_from - 1}") if tokens_from else None,
        TOKENS[tokens_from * BS : last * BS],
        BS,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=window,
        **fields,  # type: ignore[arg-type]
    )


FA = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def test_skipped_blocks_take_the_full_attention_groups_place() -> None:
    index = FleetIndex()
    apply(index, stored(0, 11, **FA))
    # The window group skipped block 9: hashes [h10], parent h8, tokens of blocks 9 and 10.
    apply(index, sw(9, ["h10"], window=5, tokens_from=9))
    (row,) = index.lookup(TOKENS[:44])
    # Full attention holds 11 blocks; the window (1 block before the boundary) holds h10.
    assert row.matched_blocks == 11
    assert row.by_group == {0: 11, 1: 11}
    assert index.cache_stats("a").unplaced == 0
    # Both groups store [h9, h10] later (a second request): nothing is cleared.
    apply(index, stored(9, 11, **FA), sw(9, ["h9", "h10"], window=5, tokens_from=9))
    assert index.lookup(TOKENS[:44])[0].matched_blocks == 11


def test_skipped_blocks_with_no_full_attention_placement_stay_out_of_the_tree() -> None:
    index = FleetIndex()
    apply(index, sw(0, ["h3"], window=5, tokens_from=2))
    assert index.block_hashes("a") == hs("h3")
    assert index.cache_stats("a").unplaced == 1
    assert matched(index, TOKENS[:16]) == 0


def test_hybrid_lookup_follows_the_window_rule() -> None:
    index = FleetIndex()
    apply(index, stored(0, 8, **FA))
    # Window of 9 tokens: 2 blocks before the boundary. The window group holds 2-3, 6.
    apply(index, sw(2, ["h2", "h3"], window=9, tokens_from=2))
    apply(index, sw(6, ["h6"], window=9, tokens_from=6))
    (row,) = index.lookup(TOKENS[:32])
    # Scanning from the right: 7 no, 6 yes (1), 5 no, 4 no, 3+2 yes -> hit at 2..3 = 4.
    assert row.matched_blocks == 4
    assert row.by_group == {0: 8, 1: 4}
    apply(index, sw(5, ["h5"], window=9, tokens_from=5))
    assert index.lookup(TOKENS[:32])[0].matched_blocks == 7
    # Full attention bounds it: once block 4 leaves group 0 the hit is 4 at most.
    apply(index, removed("h4", group_idx=0))
    assert index.lookup(TOKENS[:32])[0].matched_blocks == 4


def test_partial_block_event_hangs_in_its_own_block_size() -> None:
    index = FleetIndex()
    apply(index, stored(0, 4, **FA))  # group 0: 4-token blocks h0..h3
    big = BlockStored([h("h1"), h("h3")], None, TOKENS[:16], 2 * BS, group_idx=1)  # type: ignore[list-item]
    apply(index, big)  # group 1: 8-token blocks, hashed at the 4-token boundaries
    partial = BlockStored([h("h2")], h("h1"), TOKENS[8:12], BS, group_idx=1)  # type: ignore[arg-type]
    apply(index, partial)
    assert index.cache_stats("a").unplaced == 0
    (row,) = index.lookup(TOKENS[:16])
    assert (row.matched_blocks, row.block_size) == (4, BS)


# -- tiers ----------------------------------------------------------------------------


def test_gpu_run_then_the_lower_tiers_run() -> None:
    index = FleetIndex()
    apply(index, stored(0, 2))
    apply(index, BlockStored([h("h2"), h("h3")], h("h1"), TOKENS[8:16], BS, medium="CPU"))  # type: ignore[arg-type]
    (row,) = index.lookup(TOKENS[:16])
    assert (row.matched_blocks, row.by_tier) == (4, {"gpu": 2, "cpu": 2})
    apply(index, removed("h1"))
    # GPU holds block 0 only; the CPU tier does not hold block 1: the reuse ends there.
    assert index.lookup(TOKENS[:16])[0].by_tier == {"gpu": 1}


def test_salted_offload_copies_keep_their_namespace() -> None:
    # vLLM's offload tracker publishes CPU stores with tokens and parent but no extra keys,
    # even for salted requests: they must not land in the plain namespace.
    index = FleetIndex()
    apply(index, stored(0, 3, "s", extra_keys=[["tenant"], None, None]))
    apply(index, stored(0, 3, "s", medium="CPU"))
    apply(index, removed("s0", "s1", "s2"))  # evicted from the GPU
    assert matched(index, TOKENS[:12]) == 0
    (row,) = index.lookup(TOKENS[:12], cache_salt="tenant")
    assert (row.matched_blocks, row.by_tier) == (3, {"cpu": 3})
    assert index.cache_stats("a").namespace_kept == 3


def test_a_keyed_copy_arriving_later_moves_the_lower_tier_entries() -> None:
    index = FleetIndex()
    apply(index, stored(0, 2, "s", medium="CPU"))  # no keys: placed as plain for now
    apply(index, stored(0, 2, "s", extra_keys=[["tenant"], None]))  # the keyed GPU copy
    apply(index, removed("s0", "s1"))
    assert matched(index, TOKENS[:8]) == 0
    assert matched(index, TOKENS[:8], cache_salt="tenant") == 2
    assert index.cache_stats("a").namespace_moved == 2


def test_medium_filter_takes_raw_names_and_tiers() -> None:
    index = FleetIndex()
    apply(index, stored(0, 1), BlockStored([h("c0")], None, [], BS, medium="CPU_PINNED"))  # type: ignore[list-item]
    assert index.block_hashes("a", "CPU_PINNED") == hs("c0")
    assert index.block_hashes("a", "cpu") == hs("c0")
    assert index.block_hashes("a", "gpu") == hs("h0")


def test_lookup_by_hashes_counts_gpu_then_lower_tiers() -> None:
    index = FleetIndex()
    apply(index, stored(0, 2), BlockStored([h("h2")], h("h1"), [], BS, medium="CPU"))  # type: ignore[arg-type]
    (row,) = index.lookup_hashes([h("h0"), h("h1"), h("h2"), h("h3")])
    assert (row.matched_blocks, row.by_tier) == (3, {"gpu": 2, "cpu": 1})


def test_a_hash_only_pool_given_a_place_counts_there() -> None:
    """A GPU pool that has only seen hash-only events (no block size yet) takes a keyed
    CPU chain's place for its block: from then on it is a pool of that block size, and a
    lookup counts its block there after the CPU copy left (a restart from the store's
    snapshot gives the same answer: tests/test_store_placement.py)."""
    index = FleetIndex()
    apply(index, BlockStored([h("s0")], None, [], 0, lora_name="x", group_idx=0))
    apply(index, stored(0, 4, "s", medium="CPU", lora_name="x", extra_keys=[["x"]] * 4))
    apply(index, removed("s0", medium="CPU"))
    (row,) = index.lookup(TOKENS[:16], lora_name="x")
    assert (row.matched_blocks, row.by_tier) == (4, {"gpu": 1, "cpu": 3})


# -- SGLang's EAGLE bigram pages (issue 19) ---------------------------------------------------


def bigram(
    first: int, last: int, tokens: list[int], size: int, tag: str = "b", **fields: object
) -> BigramBlockStored:
    """Pages first..last-1 of an EAGLE bigram cache of `size`-pair pages, as SGLang's
    recorder sends them: page i holds the units (t[j], t[j+1]) for j in its range."""
    pairs = [(tokens[j], tokens[j + 1]) for j in range(first * size, last * size)]
    parent = h(f"{tag}{first - 1}") if first else None
    return BigramBlockStored(
        chain(first, last, tag),  # type: ignore[arg-type]
        parent,  # type: ignore[arg-type]
        block_size=size,
        token_pairs=pairs,
        **fields,  # type: ignore[arg-type]
    )


def test_bigram_pages_are_found_from_the_prompts_tokens() -> None:
    """SGLang's match_prefix with is_eagle: n prompt tokens make n - 1 units, in whole
    pages. The lookup derives them from the plain token ids."""
    index = FleetIndex()
    tokens = list(range(1, 10))
    apply(index, bigram(0, 4, tokens, 2))  # 8 units: (1,2) .. (8,9)
    assert matched(index, tokens) == 4
    assert matched(index, tokens[:8]) == 3  # 7 units: 3 whole pages
    assert matched(index, tokens[:2]) == 0  # 1 unit: no whole page
    assert matched(index, [1, 2, 3, 9, 9]) == 1
    rows = {r.instance: r for r in index.lookup(tokens)}
    assert (rows["a"].block_size, rows["a"].matched_tokens) == (2, 8)
    apply(index, removed("b3"))
    assert matched(index, tokens) == 3


def test_bigram_and_plain_chains_of_the_same_token_ids_never_meet() -> None:
    """A bigram page's key is its pairs flattened: a plain block of those token ids (twice
    the page size) is another tree, in both directions; and a salt still separates."""
    index = FleetIndex()
    b, p = SourceKey("b"), SourceKey("p")
    apply(index, bigram(0, 1, [1, 2, 3], 2), source=b)  # pairs (1,2), (2,3)
    apply(index, BlockStored([h("p0")], None, [1, 2, 2, 3], 4), source=p)
    rows = {r.instance: r.matched_blocks for r in index.lookup([1, 2, 3])}
    assert rows == {"b": 1, "p": 0}
    rows = {r.instance: r.matched_blocks for r in index.lookup([1, 2, 2, 3])}
    assert rows == {"b": 0, "p": 1}
    apply(index, bigram(0, 1, [1, 2, 3], 2, "s", cache_salt="t"), source=b)
    assert {r.instance: r.matched_blocks for r in index.lookup([1, 2, 3], cache_salt="t")} == {
        "b": 1,
        "p": 0,
    }
    apply(index, removed("b0"), source=b)
    assert {r.instance: r.matched_blocks for r in index.lookup([1, 2, 3])} == {"b": 0, "p": 0}


def test_bigram_pages_on_lower_tiers_follow_the_gpu_run() -> None:
    """HiCache's host copies of bigram pages (unkeyed, like any lower tier) keep their
    place: GPU pages first, then the host run."""
    index = FleetIndex()
    tokens = list(range(1, 10))
    apply(
        index, bigram(0, 4, tokens, 2, medium="GPU"), bigram(0, 4, tokens, 2, medium="CPU_PINNED")
    )
    apply(index, removed("b2", "b3", medium="GPU"))
    rows = {r.instance: r for r in index.lookup(tokens)}
    assert rows["a"].matched_blocks == 4 and rows["a"].by_tier == {"gpu": 2, "cpu": 2}
