"""Tree keys: one block's token ids (and own keys) as a short bytes object.

A block whose token ids all fit in 32 bits (every real vocabulary) is keyed by them as
native uint32 bytes, so a whole prompt converts in one C call (`array("I", tokens)`) and
is cut into keys with `struct.iter_unpack`. A block with a token past 32 bits gets a marker
byte and int64s: a length no uint32 key of the same block size can have, so no key can
stand for two token sequences.

A block that carries *own keys* (a multimodal input, a prompt-embeds digest, lookahead
tokens, anything vLLM hashes beside the tokens that is not the chain's namespace) is keyed
by its token key followed by a 16-byte digest of those keys (`OWN_KEY_BYTES`). Within one
block size its length differs from every plain key (4s + 16 is neither 4s nor 1 + 8s, nor
1 + 8s + 16 equal to 4s), so a lookup by tokens alone never enters it, while the blocks
before it stay where a plain request finds them.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

__all__ = ["OWN_KEY_BYTES", "block_keys", "chain_keys_bytes", "key_tokens", "one_block_key"]

OWN_KEY_BYTES = 16


def block_keys(tokens: Sequence[int], size: int, blocks: int) -> list[bytes]:
    """The tree keys of the first `blocks` blocks of `size` tokens (fewer if a block's
    tokens can't be keyed: a token id past 64 bits ends the list there)."""
    try:
        data = array("I", tokens)
    except (OverflowError, TypeError):
        return _keys_slowly(tokens, size, blocks)
    return _split(memoryview(data).cast("B"), size * 4, blocks)


def one_block_key(tokens: Sequence[int]) -> bytes | None:
    """The key of a single block (a decode step's new block: the commonest store), without
    splitting; None if a token can't be keyed."""
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        keys = _keys_slowly(tokens, len(tokens), 1)
        return keys[0] if keys else None


def chain_keys_bytes(
    tokens: Sequence[int], size: int, blocks: int, own: Sequence[bytes | None] | None
) -> list[bytes]:
    """The tree keys of a stored chain of `blocks` blocks: their token keys, each followed
    by the digest of its own keys if it has any (fewer keys if a token can't be keyed)."""
    if blocks == 1 and own is None:
        # One block (a decode step's new block, the commonest store): no splitting.
        key = one_block_key(tokens)
        return [] if key is None else [key]
    chain = block_keys(tokens, size, blocks)
    if own is not None:
        chain = [k if digest is None else k + digest for k, digest in zip(chain, own, strict=False)]
    return chain


def _split(data: memoryview, width: int, blocks: int) -> list[bytes]:
    """The first `blocks` runs of `width` bytes of `data` (fewer if it is shorter)."""
    splitter = _SPLITTERS.get(width)
    if splitter is None:
        splitter = _SPLITTERS[width] = struct.Struct(f"{width}s")
    blocks = min(blocks, len(data) // width)
    # iter_unpack cuts in C: about twice as fast as slicing in a comprehension.
    return [key for (key,) in splitter.iter_unpack(data[: blocks * width])]


_SPLITTERS: dict[int, struct.Struct] = {}


def _keys_slowly(tokens: Sequence[int], size: int, blocks: int) -> list[bytes]:
    keys = []
    for i in range(blocks):
        block = tokens[i * size : (i + 1) * size]
        try:
            keys.append(array("I", block).tobytes())
        except (OverflowError, TypeError):
            try:
                keys.append(b"\x00" + array("q", block).tobytes())
            except (OverflowError, TypeError):
                break  # no lookup can ask for a token id past 64 bits (or a non-int)
    return keys


def key_tokens(key: bytes, size: int) -> list[int]:
    """The token ids a tree key of a `size`-token block stands for (the inverse of
    `block_keys`; own keys, if any, are left out)."""
    if len(key) in (4 * size, 4 * size + OWN_KEY_BYTES):
        return array("I", key[: 4 * size]).tolist()
    return array("q", key[1 : 1 + 8 * size]).tolist()


def has_own_keys(key: bytes, size: int) -> bool:
    """Whether a key of a `size`-token block carries own keys (see the module doc)."""
    return len(key) in (4 * size + OWN_KEY_BYTES, 1 + 8 * size + OWN_KEY_BYTES)
