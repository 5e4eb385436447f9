"""Holding the compiled index to the pure-Python reference: identical state and answers.

Used by tests/test_core.py (hypothesis streams), tests/test_fuzz_corpus.py (the committed
fuzz corpus) and fuzz/fuzz_core.py (atheris): `assert_same` compares everything either
index can be asked, `prompts_of` finds the prompts worth asking about in a stream of
decoded batches (every chain a store placed, rebuilt from the root through its parents).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from kvindex.index import ReferenceIndex
from kvindex.wire import BigramBlockStored, BlockHash, BlockStored, EventBatch

# (token ids, lookup keywords: lora_name and cache_salt, and a chain's multimodal keys)
Prompt = tuple[list[int], dict[str, Any]]

MEDIA = (None, "GPU", "cpu", "CPU_PINNED", "disk")


def assert_same(
    pure: ReferenceIndex,
    fast: Any,
    prompts: Iterable[Prompt] = (),
    hash_runs: Iterable[Sequence[BlockHash]] = (),
    media: Iterable[str | None] = MEDIA,
    local_runs: Iterable[tuple[Sequence[int], dict[str, Any]]] = (),
    one_tree: bool = True,
) -> None:
    """Both hold the same publishers, pools, copies, stats and tree, and answer every
    lookup of `prompts` (by tokens), `hash_runs` (by hashes) and `local_runs` (by Dynamo's
    local block hashes, with their keywords; `fast` keeping them) with the same rows.
    `one_tree` False: `fast` keeps a prefix once per shard (a ShardedIndex), so only its
    walk, merged, is the reference's tree; its node count is larger."""
    assert fast.instances() == pure.instances()
    assert fast.entries() == pure.entries()
    if one_tree:
        assert fast.tree_nodes() == pure.tree_nodes()
    assert sorted(map(str, fast.sources())) == sorted(map(str, pure.sources()))
    for src in pure.sources():
        assert fast.copies(src) == pure.copies(src), src
        assert _same_state(fast.source_state(src), pure.source_state(src)), src
    media = list(media)
    for name in pure.instances():
        assert fast.cache_stats(name) == pure.cache_stats(name), name
        assert fast.blocks_by_medium(name) == pure.blocks_by_medium(name), name
        for medium in media:
            assert fast.block_hashes(name, medium) == pure.block_hashes(name, medium), medium
    for tokens, names in prompts:
        assert fast.lookup(tokens, **names) == pure.lookup(tokens, **names), (tokens, names)
    for hashes in hash_runs:
        assert fast.lookup_hashes(hashes) == pure.lookup_hashes(hashes), hashes
    for local, kw in local_runs:
        assert fast.lookup_local_hashes(local, **kw) == pure.lookup_local_hashes(local, **kw), (
            local,
            kw,
        )
    tree = Counter((ns, depth, mask) for ns, depth, _, mask in pure.walk_tree())
    assert Counter((ns, depth, mask) for ns, depth, _, mask in fast.walk_tree()) == tree


def prompts_of(
    batches: Iterable[EventBatch], limit: int = 24, max_blocks: int = 64
) -> tuple[list[Prompt], list[list[BlockHash]]]:
    """The prompts (and hash runs) a stream's stores stand for: each stored block's
    tokens from the root, followed through the parent hashes the events gave (at most
    `max_blocks` back; a cycle or a missing parent ends the climb), in each namespace the
    events named and in the plain one. At most `limit` of each, the longest chains first."""
    # hash -> (parent, tokens, the token after them: a bigram page's last pair's second)
    tokens_of: dict[Any, tuple[Any, list[int], list[int]]] = {}
    mm_of: dict[Any, list[Any]] = {}  # hash -> the block's multimodal keys, if any
    names: set[tuple[str | None, str | None]] = {(None, None)}
    for batch in batches:
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            size, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
            pairs = event.token_pairs if isinstance(event, BigramBlockStored) else None
            if pairs is not None:  # a page's own tokens: the first of each pair
                tokens = [a for a, _ in pairs]
            salt = event.cache_salt
            extra = event.extra_keys or []
            if salt is None and extra and isinstance(extra[0], list) and extra[0]:
                last = extra[0][-1]
                salt = last if isinstance(last, str) else None  # vLLM's salt: block 0's key
            names.add((event.lora_name, salt))
            names.add((event.lora_name, None))
            if not (isinstance(size, int) and 0 < size <= 1024) or len(tokens) != size * len(
                hashes
            ):
                continue
            parent = event.parent_block_hash
            for i, h in enumerate(hashes):
                if _hashable(h):
                    after = [] if pairs is None else [pairs[(i + 1) * size - 1][1]]
                    tokens_of[h] = (parent, list(tokens[i * size : (i + 1) * size]), after)
                    entry = extra[i] if isinstance(extra, list) and i < len(extra) else None
                    mm = [k for k in entry if _is_mm(k)] if isinstance(entry, list) else []
                    if mm:
                        mm_of[h] = mm
                parent = h
    chains: list[tuple[list[int], list[BlockHash]]] = []
    for h in tokens_of:
        run: list[BlockHash] = []
        toks: list[int] = []
        seen: set[Any] = set()
        at: Any = h
        tail = tokens_of[h][2]
        while _hashable(at) and at in tokens_of and at not in seen and len(run) < max_blocks:
            seen.add(at)
            parent, block, _ = tokens_of[at]
            run.append(at)
            toks = block + toks
            at = parent
        chains.append((toks + tail, run[::-1]))
    chains.sort(key=lambda c: -len(c[1]))
    prompts: list[Prompt] = []
    keyed: list[Prompt] = []  # the chains with multimodal keys, asked with them
    for toks, run in chains[:limit]:
        for lora, salt in sorted(names, key=repr)[:6]:
            prompts.append((toks, {"lora_name": lora, "cache_salt": salt}))
        mm = [mm_of.get(h) for h in run]
        if any(mm):
            for lora, salt in sorted(names, key=repr)[:3]:
                keyed.append((toks, {"lora_name": lora, "cache_salt": salt, "extra_keys": mm}))
    return prompts[: limit * 2] + keyed[:limit], [run for _, run in chains[:limit]]


def _same_state(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Equal (seq, ts), a NaN time (a batch may say so) equal to itself."""
    nan = all(isinstance(x[1], float) and math.isnan(x[1]) for x in (a, b))
    return a[0] == b[0] and (nan or a[1] == b[1])


def _is_mm(key: Any) -> bool:
    """A multimodal key as vLLM 0.20+ sends it: [identifier, offset]."""
    return (
        isinstance(key, list | tuple)
        and len(key) == 2
        and isinstance(key[0], str)
        and isinstance(key[1], int)
        and not isinstance(key[1], bool)
    )


def _hashable(h: Any) -> bool:
    return isinstance(h, int | bytes) and not isinstance(h, bool)
