"""What an engine would reuse of a prompt, given which of its blocks each pool holds.

The rules follow vLLM 0.33's own code:

- `KVCacheManager.get_computed_blocks` asks its coordinator for the longest GPU hit. With
  one KV cache group that is the run of leading blocks the pool holds. With several
  (`HybridKVCacheCoordinator.find_longest_cache_hit`): full-attention groups bound the hit
  at their leading run; then each other group shortens it by its own rule (a sliding
  window needs the `ceil((window - 1) / block_size)` blocks before the boundary, found
  scanning from the right: `SlidingWindowManager.find_longest_cache_hit`; Mamba needs the
  block at the boundary), repeated until no group shortens it.
- The offloading connector then loads the run of blocks a lower tier holds from there
  (`get_num_new_matched_tokens`): the answer is the GPU hit plus that run. SGLang's
  HiCache reuses its host and storage tiers the same way.

A publisher with one pool needs none of this (its hit is the tree walk's depth); this is
for publishers with several pools: hybrid groups, offload tiers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

from kvindex.wire.pools import PoolKey
from kvindex.wire.tiers import TIER_GPU, TIERS, tier_of

__all__ = [
    "GroupSpec",
    "Reuse",
    "engine_reuse",
    "fine_grained",
    "scheduler_block_size",
    "unit_reuse",
]

# vLLM's KVCacheSpecKind values whose groups reuse a leading run of blocks.
_PREFIX_KINDS = frozenset(
    {
        "full_attention",
        "mla_attention",
        "sink_full_attention",
        "chunked_local_attention",
        "unknown",
    }
)
_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
_MAMBA_KINDS = frozenset({"mamba"})
# Kinds whose vLLM managers look up at the hash block size (`supports_fine_grained_hash_lookup`).
_FINE_KINDS = frozenset({"full_attention", "mla_attention", "mamba"})
# Groups that never take part in prefix caching (per-request scratch).
_UNCACHED_KINDS = frozenset({"encoder_only_attention", "cross_attention"})


class GroupSpec(msgspec.Struct, frozen=True, gc=False):
    """A KV cache group's spec as BlockStored carries it (vLLM 0.22+)."""

    kind: str | None = None
    sliding_window: int | None = None


class Reuse(msgspec.Struct, frozen=True, gc=False):
    """A publisher's answer: whole blocks of `size` tokens, split by tier and by group
    (`detailed`: the splits were computed; else all of it comes from the one pool)."""

    blocks: int
    size: int
    by_tier: dict[str, int]
    by_group: dict[int, int]
    detailed: bool = True

    @property
    def tokens(self) -> int:
        return self.blocks * self.size

    @classmethod
    def simple(cls, blocks: int, size: int) -> Reuse:
        return cls(blocks, size, {}, {}, detailed=False)


def engine_reuse(
    held: Mapping[PoolKey, Sequence[bool]],
    sizes: Mapping[PoolKey, int],
    groups: Mapping[int, GroupSpec],
) -> Reuse:
    """`held[pool][d]`: whether the pool holds the prompt's block `d` (blocks of
    `sizes[pool]` tokens, along the tree path of that size)."""
    gpu = {pk: h for pk, h in held.items() if tier_of(pk[1]) == TIER_GPU and sizes.get(pk)}
    spec = {pk: groups.get(pk[0], GroupSpec()) for pk in gpu}
    cached = {pk: h for pk, h in gpu.items() if spec[pk].kind not in _UNCACHED_KINDS}
    gpu_tokens = _hybrid_hit(cached, sizes, spec)
    by_group = {pk[0]: _group_hit(h, sizes[pk], spec[pk], None) for pk, h in cached.items()}
    size = _row_size(cached, sizes)
    lower = {pk: h for pk, h in held.items() if pk not in gpu and sizes.get(pk)}
    lower_tokens = _lower_run(lower, sizes, gpu_tokens)
    by_tier: dict[str, int] = {}
    if gpu_tokens:
        by_tier[TIER_GPU] = gpu_tokens
    for tier, tokens in lower_tokens.items():
        by_tier[tier] = by_tier.get(tier, 0) + tokens
    if not size:
        size = min((sizes[pk] for pk in lower), default=0)
    if not size:
        return Reuse(0, 0, {}, {})
    total = sum(by_tier.values())
    return Reuse(
        total // size,
        size,
        {tier: tokens // size for tier, tokens in by_tier.items() if tokens // size},
        by_group,
    )


def fine_grained(groups: Mapping[int, GroupSpec], sizes: Mapping[PoolKey, int], unit: int) -> bool:
    """Whether vLLM's hybrid coordinator takes hits at `unit` (the hash block size) inside
    larger blocks (`partial_hash_hits_enabled`, vLLM 0.33): a Mamba group ("align" mode,
    the only one that caches) of blocks larger than the unit, and every other cached GPU
    group's manager looks up at that grain (full attention, Mamba) or has unit blocks."""
    gpu = [pk for pk in sizes if tier_of(pk[1]) == TIER_GPU and sizes[pk]]
    kinds = {pk: groups.get(pk[0], GroupSpec()).kind for pk in gpu}
    if not any(kinds[pk] in _MAMBA_KINDS and sizes[pk] > unit for pk in gpu):
        return False
    return all(
        kinds[pk] in _FINE_KINDS or kinds[pk] in _UNCACHED_KINDS or sizes[pk] == unit for pk in gpu
    )


def scheduler_block_size(sizes: Mapping[PoolKey, int]) -> int:
    """vLLM's `scheduler_block_size` with several groups: the LCM of their block sizes
    (`resolve_kv_cache_block_sizes`); hits land on it unless they may land inside blocks."""
    out = 1
    for pk, size in sizes.items():
        if tier_of(pk[1]) == TIER_GPU and size:
            out = out * size // math.gcd(out, size)
    return out


def unit_reuse(
    held: Mapping[PoolKey, Sequence[bool]],
    sizes: Mapping[PoolKey, int],
    groups: Mapping[int, GroupSpec],
    unit: int,
    lower: Mapping[PoolKey, Sequence[bool]],
) -> Reuse:
    """`engine_reuse` for a publisher whose groups' blocks are multiples of the hash block
    size `unit` and larger than it somewhere (partial-block entries, groups of different
    block sizes): `held[pool][f]` says whether the GPU pool holds the prompt's hash `f`
    (the hash at `(f + 1) * unit` tokens: a whole block's, of any of its groups' sizes, or
    a partial-block entry's), and the answer counts blocks of `unit` tokens. Hits land on
    the alignment vLLM uses: `unit` when it takes hits inside blocks (`fine_grained`),
    else the scheduler block size. vLLM 0.33: `HybridKVCacheCoordinator.find_longest_cache_hit`
    (fixed point, full attention first) over each manager's `find_longest_cache_hit`;
    `by_group` as `find_longest_cache_hit_per_group`."""
    spec = {pk: groups.get(pk[0], GroupSpec()) for pk in held}
    cached = {pk: h for pk, h in held.items() if spec[pk].kind not in _UNCACHED_KINDS}
    align = unit if fine_grained(groups, sizes, unit) else scheduler_block_size(sizes)
    length = max((len(h) for h in cached.values()), default=0) * unit
    order = sorted(cached, key=lambda pk: not _is_prefix(spec[pk]))
    simple = len(order) == 2 and _is_prefix(spec[order[0]])
    hit = length
    known: dict[PoolKey, int] = {}
    while True:
        curr = hit
        for pk in order:
            if pk in known:
                curr = min(curr, known[pk])
                continue
            curr = _unit_hit(cached[pk], sizes[pk], spec[pk], unit, curr, align)
            if _is_prefix(spec[pk]):
                known[pk] = curr
        if curr >= hit:
            break
        hit = curr
        if simple:
            break
    by_group = {
        pk[0]: _unit_hit(h, sizes[pk], spec[pk], unit, length, align) // unit
        for pk, h in cached.items()
    }
    by_tier = {TIER_GPU: hit // unit} if hit else {}
    for tier, tokens in _lower_run(lower, sizes, hit).items():
        by_tier[tier] = by_tier.get(tier, 0) + tokens // unit
    return Reuse(sum(by_tier.values()), unit, by_tier, by_group)


def _unit_hit(
    held: Sequence[bool], size: int, spec: GroupSpec, unit: int, max_len: int, align: int
) -> int:
    """One group's hit in tokens, at most `max_len`, on `align`; hashes `unit` tokens
    apart, the group's blocks `size` tokens (its block j is hash (j + 1) * size / unit - 1)."""
    k = size // unit
    fine = align < size and size % align == 0  # hits inside blocks (align is the unit)
    blocks = min(max_len // size, len(held) // k)
    if spec.kind in _MAMBA_KINDS:
        if fine:
            for f in range(min(max_len // unit, len(held)) - 1, -1, -1):
                if held[f]:
                    return (f + 1) * unit
            return 0
        for i in range(blocks - 1, -1, -1):  # MambaManager: the rightmost aligned block
            if held[(i + 1) * k - 1] and ((i + 1) * size) % align == 0:
                return (i + 1) * size
        return 0
    if spec.kind in _WINDOW_KINDS and spec.sliding_window:
        needed = max(1, -(-(spec.sliding_window - 1) // size))
        run = 0
        for i in range(blocks - 1, -1, -1):  # SlidingWindowManager, from the right
            if held[(i + 1) * k - 1]:
                if run == 0 and ((i + 1) * size) % align:
                    continue  # a run must end on the alignment
                run += 1
                if run >= needed:
                    return (i + run) * size
            else:
                run = 0
        while run * size % align:  # the leading run, shorter than a window, cut to it
            run -= 1
        return run * size
    whole = 0  # full attention: leading whole blocks, then (fine) a partial entry
    while whole < blocks and held[(whole + 1) * k - 1]:
        whole += 1
    hit = whole * size
    if fine:
        first = whole * k
        for f in range(min(first + k - 1, max_len // unit, len(held)) - 1, first - 1, -1):
            if held[f]:
                return (f + 1) * unit
    return hit - hit % align


def _row_size(gpu: Mapping[PoolKey, Sequence[bool]], sizes: Mapping[PoolKey, int]) -> int:
    """The block size an answer counts in: group 0's, else the smallest GPU group's."""
    for pk in gpu:
        if pk[0] == 0:
            return sizes[pk]
    return min((sizes[pk] for pk in gpu), default=0)


def _hybrid_hit(
    gpu: Mapping[PoolKey, Sequence[bool]],
    sizes: Mapping[PoolKey, int],
    spec: Mapping[PoolKey, GroupSpec],
) -> int:
    """The GPU hit in tokens, by `HybridKVCacheCoordinator.find_longest_cache_hit`."""
    if not gpu:
        return 0
    prefix = [pk for pk in gpu if _is_prefix(spec[pk])]
    others = [pk for pk in gpu if not _is_prefix(spec[pk])]
    bound = max(len(h) * sizes[pk] for pk, h in gpu.items())
    for pk in prefix:
        bound = min(bound, _leading(gpu[pk]) * sizes[pk])
    simple = len(prefix) >= 1 and len({_spec_key(spec[pk], sizes[pk]) for pk in others}) <= 1
    while True:
        hit = bound
        for pk in others:
            hit = _group_hit(gpu[pk], sizes[pk], spec[pk], hit) * sizes[pk]
        if hit >= bound:
            return bound
        bound = hit
        if simple:
            return bound


def _spec_key(spec: GroupSpec, size: int) -> tuple[str | None, int | None, int]:
    return (spec.kind, spec.sliding_window, size)


def _is_prefix(spec: GroupSpec) -> bool:
    return (
        spec.kind is None
        or spec.kind in _PREFIX_KINDS
        or (spec.kind in _WINDOW_KINDS and not spec.sliding_window)
    )


def _group_hit(held: Sequence[bool], size: int, spec: GroupSpec, max_tokens: int | None) -> int:
    """One group's hit in blocks, at most `max_tokens` tokens (None: the whole path)."""
    limit = len(held) if max_tokens is None else min(len(held), max_tokens // size)
    if _is_prefix(spec):
        return min(_leading(held), limit)
    if spec.kind in _MAMBA_KINDS:
        for i in range(limit - 1, -1, -1):
            if held[i]:
                return i + 1
        return 0
    if spec.kind in _WINDOW_KINDS:
        assert spec.sliding_window is not None
        needed = max(1, -(-(spec.sliding_window - 1) // size))
        run = 0
        for i in range(limit - 1, -1, -1):
            if held[i]:
                run += 1
                if run >= needed:
                    return i + run
            else:
                run = 0
        return run  # the leading run, shorter than a window, is a hit too
    return min(_leading(held), limit)


def _leading(held: Sequence[bool]) -> int:
    for i, h in enumerate(held):
        if not h:
            return i
    return len(held)


def _lower_run(
    lower: Mapping[PoolKey, Sequence[bool]], sizes: Mapping[PoolKey, int], start: int
) -> dict[str, int]:
    """Tokens per tier of the run that lower tiers hold from token `start` on; at each
    step the fastest tier holding the next block serves it."""
    order = sorted(lower, key=lambda pk: (_tier_rank(pk[1]), -sizes[pk]))
    out: dict[str, int] = {}
    at = start
    while True:
        for pk in order:
            size = sizes[pk]
            held = lower[pk]
            if at % size == 0 and at // size < len(held) and held[at // size]:
                tier = tier_of(pk[1])
                out[tier] = out.get(tier, 0) + size
                at += size
                break
        else:
            return out


def _tier_rank(medium: str) -> int:
    tier = tier_of(medium)
    return TIERS.index(tier) if tier in TIERS else len(TIERS)
