"""What a stored block is keyed by besides its tokens: the chain's namespace and own keys.

An engine hashes a block from its parent's hash, its tokens and *extra keys*. Two kinds of
extra key matter to a token lookup:

- the **namespace** of a whole chain, taken from its first block and inherited along the
  parent link: the LoRA adapter and the cache salt (vLLM's per-tenant isolation). A
  lookup names them; blocks of one namespace never match a lookup of another.
- **own keys** of one block: a multimodal input (its identifier and offset), a
  prompt-embeds digest, lookahead tokens, or anything not recognised. A block with own
  keys gets a tree node that a lookup by tokens alone never enters; the blocks before it
  stay where a plain request finds them.

How each engine sends them (checked against vLLM's `generate_block_hash_extra_keys` and
`to_event_extra_keys` of 0.17-0.33, and SGLang 0.5's event structs):

- LoRA: the `lora_name` field (vLLM 0.14+, SGLang); vLLM also puts the bare name first in
  every block's `extra_keys`.
- salt: vLLM puts a bare string in block 0's `extra_keys` (after the LoRA name and any
  multimodal keys); SGLang sets the `cache_salt` field on every block.
- multimodal (vLLM): the bare identifier string up to 0.19, `[identifier, offset]` from
  0.20 on.
- prompt embeds (vLLM): bytes, a digest of the block's embeddings.
- lookahead (vLLM 0.33): `lookahead_token_ids`, the tokens after the block that its hash
  also covers.

Before 0.14 only the process-local `lora_id` is sent: such a chain gets a namespace of its
own (the id, an int, which no lookup by name can give), so it never matches plain
lookups. In 0.17-0.19 a bare string in block 0 is a salt or a multimodal identifier, which
the wire can't tell apart: it becomes an own key (never a false hit). The release is told
by the fields: `group_idx` is sent by every release from 0.20 on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from kvindex.index.keys import OWN_KEY_BYTES
from kvindex.wire import BlockStored

__all__ = [
    "ChainKeys",
    "LoraKey",
    "chain_keys",
    "lora_key",
    "lora_label",
    "own_digest",
    "salt_digest",
]

LoraKey = str | int | None
"""A chain's adapter: its name, else its process-local id (pre-0.14 vLLM), else None."""

_encode = msgspec.msgpack.Encoder().encode


class ChainKeys(msgspec.Struct, frozen=True, gc=False):
    """The keys of one BlockStored beside its tokens.

    `salt` is the namespace salt its chain starts with (meaningful when the chain starts
    at the root). `own[i]` is the digest of block i's own keys (None: none); `own` is None
    when no block has any. `unrecognised` counts blocks whose keys had a shape this
    version doesn't know (they got own keys: never plain).
    """

    salt: str | None = None
    own: list[bytes | None] | None = None
    unrecognised: int = 0


PLAIN = ChainKeys()


def lora_key(event: BlockStored) -> LoraKey:
    if event.lora_name is not None:
        return event.lora_name
    return event.lora_id  # None for a request without an adapter


def lora_label(lora: LoraKey) -> str | None:
    """A chain's adapter as shown to people: its name, or `lora_id N` without one."""
    return f"lora_id {lora}" if isinstance(lora, int) else lora


def salt_digest(salt: str | None) -> str | None:
    """A cache salt as it may be shown (dashboard, exports, metrics): a short digest. The
    salt itself isolates a tenant's cache, so it is never shown."""
    if salt is None:
        return None
    return "salt:" + hashlib.sha256(salt.encode()).hexdigest()[:12]


def chain_keys(event: BlockStored) -> ChainKeys:
    """Parse an event's extra keys, cache salt and lookahead tokens (see the module doc)."""
    extra, lookahead = event.extra_keys, event.lookahead_token_ids
    if extra is None and lookahead is None:
        return PLAIN if event.cache_salt is None else ChainKeys(salt=event.cache_salt)
    blocks = len(event.block_hashes)
    salt = event.cache_salt
    own: list[list[Any] | None] = [None] * blocks
    unrecognised = 0
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != blocks:
            # Not one entry per block: nothing can be said per block; all are own-keyed.
            unrecognised = blocks
            own = [[i, extra] for i in range(blocks)]
        else:
            legacy = event.group_idx is None  # vLLM 0.17-0.19
            first = event.parent_block_hash is None
            for i, entry in enumerate(extra):
                found, block_salt, odd = _block_keys(entry, i == 0 and first, event, legacy)
                own[i] = found
                unrecognised += odd
                if block_salt is not None:
                    salt = block_salt
    if lookahead is not None:
        if len(lookahead) != blocks:
            unrecognised += blocks
        for i in range(blocks):
            entries = own[i] or []
            entries.append(["lookahead", lookahead[i] if i < len(lookahead) else lookahead])
            own[i] = entries
    digests = [None if keys is None else own_digest(keys) for keys in own]
    if not any(d is not None for d in digests):
        return ChainKeys(salt=salt, unrecognised=unrecognised)
    return ChainKeys(salt, digests, unrecognised)


def _block_keys(
    entry: Any, at_root: bool, event: BlockStored, legacy: bool
) -> tuple[list[Any] | None, str | None, int]:
    """One block's extra keys -> (own keys or None, the salt it carries, 1 if odd)."""
    if entry is None:
        return None, None, 0
    if not isinstance(entry, list | tuple):
        return [entry], None, 1
    keys = list(entry)
    lora = event.lora_name
    if lora is not None and keys and keys[0] == lora:
        keys = keys[1:]  # the adapter: the chain's namespace, not an own key
    salt = None
    own: list[Any] = []
    odd = 0
    for i, key in enumerate(keys):
        if isinstance(key, str):
            is_last_string = not any(isinstance(k, str) for k in keys[i + 1 :])
            if at_root and not legacy and is_last_string and salt is None:
                salt = key  # vLLM puts the salt after the multimodal keys of block 0
            else:
                own.append(key)  # a legacy multimodal identifier, or an unknown string
                odd += not legacy
        elif isinstance(key, bytes):
            own.append(key)  # a prompt-embeds digest
        elif _is_mm(key):
            own.append(list(key))
        else:
            own.append(key)
            odd += 1
    return (own or None), salt, 1 if odd else 0


def _is_mm(key: Any) -> bool:
    return (
        isinstance(key, list | tuple)
        and len(key) == 2
        and isinstance(key[0], str | bytes)
        and isinstance(key[1], int)
    )


def own_digest(keys: Sequence[Any]) -> bytes:
    """The digest of one block's own keys, as its tree key ends with (`OWN_KEY_BYTES`)."""
    try:
        data = _encode(keys)
    except (TypeError, ValueError, OverflowError):
        data = repr(keys).encode()
    return hashlib.blake2b(data, digest_size=OWN_KEY_BYTES).digest()
