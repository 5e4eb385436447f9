"""NVIDIA Dynamo's local block hashes, as its routers send them to `/query_by_hash`.

Dynamo's KV router keys a block by a hash of its own tokens (`LocalBlockHash`), not chained
to its parent (the radix tree's path does that): `compute_block_hash_for_seq` in
`lib/kv-router/src/protocols.rs` (ai-dynamo-runtime 1.6.1, measured against its Python
binding `dynamo._core.compute_block_hash_for_seq`, docs/peers.md):

    local hash = XXH3-64(the block's token ids as u32 little-endian, seed)
    seed       = 1337 + XXH3-64(lora_name, seed 0) + XXH3-64(cache_salt, seed 1)

each term only when given and non-empty, sums wrapping at 2**64; one hash per full block
(a trailing partial block has none). On the wire (`/query_by_hash`'s `block_hashes`) the
u64 is written as a signed i64 (`as_signed`).

kvindex keeps the engine's tokens, not these hashes: a lookup by local hashes hashes the
stored blocks under each namespace's seed as it walks (`FleetIndex.lookup_local_hashes`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

__all__ = [
    "XXH3_SEED",
    "LocalHashesOff",
    "as_signed",
    "as_unsigned",
    "block_local_hash",
    "local_hashes",
    "namespace_seed",
]

XXH3_SEED = 1337
_MASK = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest


class LocalHashesOff(RuntimeError):
    """An index that can't answer lookups by local hashes (the compiled core keeps them
    only when asked to: `CompiledIndex(local_hashes=True)`, `serve --local-hashes`)."""


def namespace_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The XXH3 seed of a namespace's blocks: Dynamo's, from the LoRA name and cache salt
    (its `cache_namespace`)."""
    seed = XXH3_SEED
    if lora_name:
        seed += _xxh3(lora_name.encode())
    if cache_salt:
        seed += _xxh3(cache_salt.encode(), seed=1)
    return seed & _MASK


def block_local_hash(key: bytes, seed: int = XXH3_SEED) -> int:
    """The local hash of one block given as its token ids' u32 little-endian bytes (a
    plain tree key of kvindex.index.keys on a little-endian machine)."""
    return _xxh3(key, seed=seed)


def local_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Dynamo's `compute_block_hash_for_seq`: one local hash per full block (u64).
    ValueError for a block size below 1 or a token id that is not a u32."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    try:
        data = array("I", tokens)
    except OverflowError:
        raise ValueError("token ids must be u32") from None
    if data.itemsize != 4:  # pragma: no cover - every platform kvindex runs on
        raise ValueError("array('I') is not 32-bit here")
    if array("I", [1]).tobytes() != b"\x01\x00\x00\x00":  # pragma: no cover - big-endian
        data.byteswap()
    raw = data.tobytes()
    seed = namespace_seed(lora_name, cache_salt)
    width = 4 * block_size
    return [_xxh3(raw[i : i + width], seed=seed) for i in range(0, len(raw) - width + 1, width)]


def as_signed(h: int) -> int:
    """A u64 hash as the i64 Dynamo's `/query_by_hash` takes."""
    return h - (1 << 64) if h >= 1 << 63 else h


def as_unsigned(h: int) -> int:
    """An i64 from the wire as the u64 hash."""
    return h & _MASK
