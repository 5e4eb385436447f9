"""Prefix sharing across a fleet: which instances hold the same blocks, and which prefixes.

Read-only analyses of an index's prefix tree (one walk, `walk_tree`):

- the overlap matrix: for instances i and j, how many blocks both hold now, counted as
  prefix-tree nodes (the same tokens under the same parents, in the same LoRA namespace),
  so it holds whether or not the instances hash with the same seed; the diagonal is what
  each instance holds that can be found by tokens;
- the hottest shared prefixes: for every set of two or more instances, the deepest
  prefixes they all hold, ranked by blocks x instances (what a KV-aware router saves).

The walk is bounded (`max_nodes`); a partial answer says so (`complete` is False).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from kvindex.index.keys import block_size_of
from kvindex.index.namespaces import lora_label, salt_digest
from kvindex.index.reference import Namespace, ReferenceIndex, key_tokens

__all__ = ["SharedPrefix", "Sharing", "sharing"]


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A prefix of `blocks` blocks that every one of `instances` holds now."""

    lora_name: str | None
    block_size: int
    blocks: int
    instances: tuple[str, ...]
    token_ids: list[int]
    salt: str | None = None  # a short digest of the cache salt (never the salt itself)

    @property
    def score(self) -> int:
        return self.blocks * len(self.instances)


@dataclass(frozen=True, slots=True)
class Sharing:
    instances: list[str]
    overlap: list[list[int]]  # overlap[i][j]: blocks both instances[i] and [j] hold
    prefixes: list[SharedPrefix]  # hottest first
    nodes: int  # tree nodes walked
    complete: bool
    shared: int = 0  # blocks held by two instances or more
    everywhere: int = 0  # blocks held by every one of `instances` (two or more)


@dataclass(slots=True)
class _Frame:
    namespace: Namespace
    depth: int
    key: bytes
    holders: frozenset[str]
    same_below: bool = False  # a child is held by exactly the same instances


@dataclass(slots=True)
class _Walk:
    names: dict[int, str]
    top: int
    masks: Counter[int] = field(default_factory=Counter)
    holders: dict[int, frozenset[str]] = field(default_factory=dict)
    best: list[tuple[int, int, SharedPrefix]] = field(default_factory=list)  # a min-heap
    stack: list[_Frame] = field(default_factory=list)
    serial: int = 0

    def holders_of(self, mask: int) -> frozenset[str]:
        found = self.holders.get(mask)
        if found is None:
            names = self.names
            found = frozenset(names[b] for b in _bits(mask) if b in names)
            self.holders[mask] = found
        return found

    def visit(self, namespace: Namespace, depth: int, key: bytes, mask: int) -> None:
        self.masks[mask] += 1
        while self.stack and self.stack[-1].depth >= depth:
            self._close()
        holders = self.holders_of(mask)
        if self.stack and self.stack[-1].holders == holders:
            self.stack[-1].same_below = True
        self.stack.append(_Frame(namespace, depth, key, holders))

    def finish(self) -> None:
        while self.stack:
            self._close()

    def _close(self) -> None:
        frame = self.stack[-1]
        if len(frame.holders) >= 2 and not frame.same_below:
            self._offer(frame)
        self.stack.pop()

    def _offer(self, frame: _Frame) -> None:
        score = frame.depth * len(frame.holders)
        if len(self.best) >= self.top and score <= self.best[0][0]:
            return
        lora, salt, size = frame.namespace
        tokens: list[int] = []
        for f in self.stack:
            tokens.extend(key_tokens(f.key, size))
        holders = tuple(sorted(frame.holders))
        prefix = SharedPrefix(
            lora_label(lora), block_size_of(size), frame.depth, holders, tokens, salt_digest(salt)
        )
        self.serial += 1
        entry = (score, -self.serial, prefix)
        if len(self.best) < self.top:
            heapq.heappush(self.best, entry)
        else:
            heapq.heapreplace(self.best, entry)


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def sharing(
    index: ReferenceIndex,
    *,
    instances: list[str] | None = None,
    top: int = 10,
    max_nodes: int = 200_000,
) -> Sharing:
    """The overlap matrix of `instances` (default: all) and the `top` hottest prefixes."""
    names = {bit: key.instance for bit, key in index.source_bits().items()}
    walk = _Walk(names, top)
    complete = True
    nodes = 0
    for namespace, depth, key, mask in index.walk_tree():
        if nodes >= max_nodes:
            complete = False
            break
        nodes += 1
        walk.visit(namespace, depth, key, mask)
    walk.finish()
    order = instances if instances is not None else index.instances()
    prefixes = [p for _, _, p in sorted(walk.best, reverse=True)]
    shared, everywhere = _spread(walk, order)
    return Sharing(order, _overlap(walk, order), prefixes, nodes, complete, shared, everywhere)


def _spread(walk: _Walk, order: list[str]) -> tuple[int, int]:
    wanted = set(order)
    shared = everywhere = 0
    for mask, count in walk.masks.items():
        holders = walk.holders_of(mask)
        if len(holders) >= 2:
            shared += count
            if len(wanted) >= 2 and wanted <= holders:
                everywhere += count
    return shared, everywhere


def _overlap(walk: _Walk, order: list[str]) -> list[list[int]]:
    position = {name: i for i, name in enumerate(order)}
    matrix = [[0] * len(order) for _ in order]
    for mask, count in walk.masks.items():
        held = [position[n] for n in walk.holders_of(mask) if n in position]
        for i in held:
            row = matrix[i]
            for j in held:
                row[j] += count
    return matrix
