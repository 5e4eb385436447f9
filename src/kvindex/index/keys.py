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

A page of SGLang's EAGLE bigram cache holds *pairs*: SGLang's `RadixKey` with
`is_bigram` views a prompt's tokens t as the units (t[i], t[i+1]), i < len(t) - 1, and
cuts them into pages of `page_size` units (sglang/srt/mem_cache/radix_cache.py, 0.5.23:
`__iter__`, `child_key_at`, `page_aligned`; the recorder in `events.py` sends each page's
pairs as its `token_ids`). Such a page is keyed by its pairs flattened (a, b, a', b', ...:
a block of twice as many token ids), in a tree of its own: its *tree size* is the page
size with the `BIGRAM` flag, so a bigram chain never meets a plain chain of the same
token ids (`tree_size`, `prompt_tokens`).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

__all__ = [
    "BIGRAM",
    "OWN_KEY_BYTES",
    "block_keys",
    "block_size_of",
    "chain_keys_bytes",
    "flat_pairs",
    "key_tokens",
    "key_width",
    "one_block_key",
    "prompt_keys",
    "prompt_tokens",
    "tree_size",
]

OWN_KEY_BYTES = 16

BIGRAM = 1 << 31
"""A tree size's flag: the tree of an EAGLE bigram cache's pages (a block size is below
2**31: a larger one has no place, see fleet.MAX_BLOCK_SIZE)."""


def tree_size(block_size: int, bigram: bool) -> int:
    """The size a tree of `block_size`-unit pages is known by (its namespace's size)."""
    return block_size | BIGRAM if bigram else block_size


def block_size_of(size: int) -> int:
    """The block size of a tree size: what answers count in (a bigram page's pairs)."""
    return size & ~BIGRAM


def key_width(size: int) -> int:
    """Token ids in one key of a tree of this size: a bigram page's pairs, flattened."""
    return 2 * (size & ~BIGRAM) if size & BIGRAM else size


def flat_pairs(pairs: Sequence[Sequence[int]]) -> list[int]:
    """A bigram page's (or chain's) pairs as the token ids its tree keys are made of."""
    return [t for pair in pairs for t in pair]


def prompt_tokens(tokens: Sequence[int], size: int) -> list[int] | Sequence[int]:
    """A prompt's token ids as a tree of this size keys them: for a bigram tree, its
    units (t[i], t[i+1]) flattened, as SGLang's bigram RadixKey views the prompt."""
    if not size & BIGRAM:
        return tokens
    n = len(tokens) - 1
    if n <= 0:
        return []
    flat = [0] * (2 * n)
    flat[0::2] = tokens[:n]
    flat[1::2] = tokens[1:]
    return flat


def prompt_keys(tokens: Sequence[int], size: int) -> list[bytes]:
    """The tree keys of a prompt's whole blocks in a tree of this size (see tree_size)."""
    width = key_width(size)
    flat = prompt_tokens(tokens, size)
    return block_keys(flat, width, len(flat) // width)


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
    `block_keys`; own keys, if any, are left out). In a bigram tree (`size` a tree size
    with `BIGRAM`): the first token of each pair, the page's own tokens."""
    if size & BIGRAM:
        return key_tokens(key, key_width(size))[0::2]
    if len(key) in (4 * size, 4 * size + OWN_KEY_BYTES):
        return array("I", key[: 4 * size]).tolist()
    return array("q", key[1 : 1 + 8 * size]).tolist()


def has_own_keys(key: bytes, size: int) -> bool:
    """Whether a key of a `size`-token block carries own keys (see the module doc)."""
    return len(key) in (4 * size + OWN_KEY_BYTES, 1 + 8 * size + OWN_KEY_BYTES)
