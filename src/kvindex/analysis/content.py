"""Block identity by content, and the fleet's prefix tree, for the analysis.

A block is identified by what it holds, not by its hash: (its parent block, LoRA name,
cache salt (SGLang's field), extra keys, its tokens). Hashes depend on a per-process seed
in some vLLM setups, so two instances (or one instance before and after a restart) can give
one block two hashes; content ids make them one. A hash-only event (CPU offloading) stores
the block the source stored with its tokens under that hash, or, if it never did, a block
known by hash alone.

Each content id is a node of one prefix tree for the whole fleet. A node's children are
the different blocks that followed it, so a node with several children is a prefix that
several different sequences shared.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from kvindex.index.namespaces import salt_digest
from kvindex.wire import BlockHash, BlockStored

__all__ = ["NO_PARENT", "ContentIds", "Node", "token_count"]

NO_PARENT = -1


@dataclass(slots=True)
class Node:
    """One block of the fleet's prefix tree."""

    parent: int
    depth: int  # blocks from the start of the sequence, this one included; 0 = unknown
    block_size: int
    tokens: tuple[int, ...]
    block_hash: BlockHash
    stores: int = 0  # BlockStored of this block, on any instance, re-stores included
    children: int = 0
    instances: set[str] = field(default_factory=set)
    # The namespace it was stored under: LoRA name, the cache salt's digest (never the
    # salt itself, which isolates a tenant's cache).
    lora_name: str | None = None
    salt: str | None = None


class ContentIds:
    """Interns blocks as small ints (content ids) and keeps the prefix tree."""

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}
        self.nodes: list[Node] = []

    def _intern(
        self,
        key: Hashable,
        parent: int,
        tokens: tuple[int, ...],
        h: BlockHash,
        size: int,
        namespace: tuple[str | None, str | None] = (None, None),
    ) -> int:
        cid = self._ids.get(key)
        if cid is not None:
            return cid
        cid = len(self.nodes)
        self._ids[key] = cid
        depth = 1 if parent == NO_PARENT else self._child_depth(parent)
        self.nodes.append(Node(parent, depth, size, tokens, h, 0, 0, set(), *namespace))
        if parent != NO_PARENT:
            self.nodes[parent].children += 1
        return cid

    def _child_depth(self, parent: int) -> int:
        d = self.nodes[parent].depth
        return d + 1 if d else 0

    def parent_id(self, parent_hash: BlockHash | None, known: dict[BlockHash, int]) -> int:
        """The content id of an event's parent: known from this source, or a stand-in for
        a block never seen (the chain is then not anchored at the sequence start)."""
        if parent_hash is None:
            return NO_PARENT
        cid = known.get(parent_hash)
        if cid is None:
            cid = self._intern(("unseen", parent_hash), NO_PARENT, (), parent_hash, 0)
            self.nodes[cid].depth = 0
        return cid

    def blocks(self, event: BlockStored, known: dict[BlockHash, int]) -> list[int]:
        """The content ids of an event's blocks (and `known` learns their hashes)."""
        parent = self.parent_id(event.parent_block_hash, known)
        size, tokens = _block_size(event), event.token_ids
        extra = event.extra_keys if event.extra_keys is not None else ()
        cache_salt = event.cache_salt
        namespace = (event.lora_name, salt_digest(cache_salt))
        ids: list[int] = []
        for i, h in enumerate(event.block_hashes):
            block = tuple(tokens[i * size : (i + 1) * size]) if size else ()
            if block and len(block) == size:
                salt = repr(extra[i]) if i < len(extra) and extra[i] is not None else None
                key: Hashable = (parent, event.lora_name, cache_salt, salt, block)
            elif h in known:
                # Stored by hash only (an offloaded copy): the block this source stored with
                # its tokens, not a block of unknown content.
                parent = known[h]
                ids.append(parent)
                continue
            else:
                key, block = ("hash", h), ()
            parent = self._intern(key, parent, block, h, size, namespace)
            known[h] = parent
            ids.append(parent)
        return ids

    def leaves(self) -> list[int]:
        """Distinct sequences under each node (1 for a node without children)."""
        counts = [0] * len(self.nodes)
        # Children are always interned after their parent: reverse id order is post-order.
        for cid in range(len(self.nodes) - 1, -1, -1):
            if counts[cid] == 0:
                counts[cid] = 1
            parent = self.nodes[cid].parent
            if parent != NO_PARENT:
                counts[parent] += counts[cid]
        return counts

    def prefix_tokens(self, cid: int, limit: int = 8) -> list[int]:
        """The first tokens of the sequence that ends with block `cid`."""
        chain: list[int] = []
        while cid != NO_PARENT:
            chain.append(cid)
            cid = self.nodes[cid].parent
        out: list[int] = []
        for node_id in reversed(chain):
            out.extend(self.nodes[node_id].tokens)
            if len(out) >= limit:
                break
        return out[:limit]


def _block_size(event: BlockStored) -> int:
    if event.block_size:
        return event.block_size
    n = len(event.block_hashes)
    return len(event.token_ids) // n if n and len(event.token_ids) % n == 0 else 0


def token_count(node: Node) -> int | None:
    """Tokens from the sequence start to the end of this block; None if unknown (the chain's
    start was not seen, or the block was only ever stored by hash, without its tokens)."""
    if not node.depth or not node.block_size or not node.tokens:
        return None
    return node.depth * node.block_size
