"""What a lookup supplies beside a prompt's tokens: its multimodal inputs' keys (issue 15).

A vLLM block that covers part of an image (any multimodal input) is hashed with the
input's identifier and its offset in the block, so kvindex indexes it as a node with *own
keys* (see `namespaces`): a lookup by tokens alone never enters it, and no block after it.
A lookup that supplies the prompt's multimodal inputs keys those blocks as vLLM does and
walks on through them. Two ways to say them:

- `mm_features`: the inputs as vLLM's request holds them, `MMFeature(identifier, offset,
  length)` (the `MultiModalFeatureSpec`'s identifier, the `PlaceholderRange`'s offset and
  length), sorted by offset as vLLM assumes. Each block's keys are derived exactly as
  vLLM 0.33's `generate_block_hash_extra_keys` does (`_gen_mm_extra_hash_keys`), for the
  block size of each tree (so a fleet of several block sizes is keyed right in each), and
  published as `to_event_extra_keys` sends them: `[identifier, offset - block start]` per
  input the block covers (vLLM 0.20 on).
- `extra_keys`: per block, that block's multimodal keys as the engine's events carry them
  (`[identifier, offset]` pairs, or the bare identifier string of vLLM 0.17-0.19), None for
  a block without. For a fleet of one block size (the list is per block of it); the
  LoRA name and the cache salt are the lookup's `lora_name` and `cache_salt`, not here.

A block's keys become its tree key's own-keys digest exactly as a stored event's do
(`namespaces.own_digest`), so the same block matches and nothing else does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvindex.index.keys import BIGRAM, block_keys
from kvindex.index.namespaces import own_digest

__all__ = ["MMFeature", "PromptKeys", "mm_extra_keys"]

MMKey = str | list[Any]  # [identifier, offset in the block], or a bare identifier (0.17-0.19)


class MMFeature(msgspec.Struct, frozen=True, gc=False):
    """One multimodal input of a prompt: vLLM's `MultiModalFeatureSpec.identifier` (the
    input's hash) and its placeholder tokens' `offset` and `length`."""

    identifier: str
    offset: int
    length: int


def mm_extra_keys(
    features: Sequence[MMFeature], block_size: int, blocks: int
) -> list[list[list[Any]] | None]:
    """Per block of `block_size` tokens (the first `blocks`), the multimodal extra keys vLLM
    0.33 hashes it with, as its events publish them: `[identifier, offset - block start]`
    per input the block covers, None for none. vLLM's loop, kept as it is (a fresh
    request's blocks from the first, the input index carried from block to block)."""
    out: list[list[list[Any]] | None] = [None] * blocks
    if not features or block_size <= 0:
        return out
    last = features[-1]
    idx = 0
    for b in range(blocks):
        start, end = b * block_size, (b + 1) * block_size
        if last.offset + last.length <= start:
            break  # past the last input: no block from here on has any
        keys: list[list[Any]] = []
        while idx < len(features):
            feature = features[idx]
            offset, length = feature.offset, feature.length
            if end > offset:
                if start >= offset + length:
                    idx += 1  # the block is past this input
                    continue
                keys.append([feature.identifier, offset - start])
                if end >= offset + length:
                    idx += 1  # the block holds its end: it may hold the next input too
                else:
                    break
            else:
                break  # the block is before this input
        out[b] = keys or None
    return out


class PromptKeys:
    """A lookup's own keys per block: from `mm_features` (derived per block size) or
    per-block `extra_keys` (as given, in every tree). `tree_keys` gives the tree keys of
    the blocks that have any, for one tree size."""

    __slots__ = ("extra_keys", "mm_features")

    def __init__(
        self,
        mm_features: Sequence[MMFeature] | None = None,
        extra_keys: Sequence[Sequence[MMKey] | None] | None = None,
    ) -> None:
        self.mm_features = list(mm_features or ())
        self.extra_keys = None if extra_keys is None else list(extra_keys)

    @classmethod
    def of(
        cls,
        mm_features: Sequence[MMFeature | Mapping[str, Any]] | None = None,
        extra_keys: Sequence[Sequence[MMKey] | None] | None = None,
    ) -> PromptKeys | None:
        """The keys a lookup gave, or None when it gave none (a plain lookup). ValueError
        for both ways at once (which would say a block's keys twice)."""
        if mm_features and extra_keys:
            raise ValueError("give mm_features or extra_keys, not both")
        features = [_feature(f) for f in mm_features or ()]
        if not features and not (extra_keys and any(extra_keys)):
            return None
        return cls(features, extra_keys if extra_keys and any(extra_keys) else None)

    def own_keys(self, block_size: int, blocks: int) -> list[Sequence[MMKey] | None]:
        """Per block (the first `blocks`), its own keys (None: none)."""
        if self.mm_features:
            return list(mm_extra_keys(self.mm_features, block_size, blocks))
        own: list[Sequence[MMKey] | None] = [None] * blocks
        for i, keys in enumerate((self.extra_keys or [])[:blocks]):
            own[i] = keys or None
        return own

    def tree_keys(self, tokens: Sequence[int], size: int) -> dict[int, bytes]:
        """Block index -> tree key, for the prompt's whole blocks that have own keys, in a
        tree of this size (none in a bigram tree: SGLang's pages carry no such keys). A
        block whose tokens can't be keyed (past 64 bits) is left out, as in `block_keys`."""
        if size & BIGRAM:
            return {}
        blocks = len(tokens) // size if size else 0
        out: dict[int, bytes] = {}
        for i, keys in enumerate(self.own_keys(size, blocks)):
            if not keys:
                continue
            key = block_keys(tokens[i * size : (i + 1) * size], size, 1)
            if key:
                out[i] = key[0] + own_digest([_as_stored(k) for k in keys])
        return out

    def apply(self, keys: list[bytes], tokens: Sequence[int], size: int) -> list[bytes]:
        """A prompt's tree keys in a tree of this size (`keys.prompt_keys`) with the own
        keys of the blocks that have any: the keys a walk follows."""
        for i, key in self.tree_keys(tokens, size).items():
            if i < len(keys):
                keys[i] = key
        return keys

    def fingerprint(self) -> bytes:
        """A short digest of what was supplied (what the router's predictions key by)."""
        return own_digest(
            [
                [[f.identifier, f.offset, f.length] for f in self.mm_features],
                self.extra_keys or [],
            ]
        )


def _feature(f: MMFeature | Mapping[str, Any]) -> MMFeature:
    if isinstance(f, MMFeature):
        return f
    return MMFeature(str(f["identifier"]), int(f["offset"]), int(f["length"]))


def _as_stored(key: MMKey) -> Any:
    """One key as `namespaces._block_keys` keeps a stored block's: a pair as a list."""
    return key if isinstance(key, str | bytes) else list(key)
