"""The events vLLM publishes, as one set of types for every release from 0.9 to 0.33.

vLLM changed the encoding twice: up to 0.23 each event is a positional array with its
class name first (`["BlockStored", hashes, parent, ...]`), from 0.24 it is a map tagged by
`"type"`. Fields were only ever appended, and every field added after 0.9 is optional, so
one class per event covers all releases: absent trailing array items and absent map keys
take their defaults, and items or keys a later release adds are ignored.

The public classes below are the map-form ("current") encoding. The array-form decoders
use private subclasses, so `isinstance(event, BlockStored)` holds whichever generation
sent the event.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

BlockHash = int | bytes
"""A block hash as the publisher sent it: a (signed or unsigned) 64-bit int, or digest bytes."""

MAX_HASH_BYTES = 128
"""The widest bytes hash accepted (vLLM's digests are 32 bytes); empty ones are refused too."""

# What the decoders accept as a hash: msgpack ints are 64-bit at most; bytes of 1 to
# MAX_HASH_BYTES. Anything else (floats, strings, bools, empty or huge bytes) makes the
# event malformed: it is skipped and counted, never indexed.
_WireHash = int | Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BYTES)]

MEDIUM_GPU = "GPU"
"""The medium of an event that names none (vLLM before 0.10.2 only had the GPU)."""


class BlockStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", gc=False, omit_defaults=True
):
    """Full blocks entered the prefix cache: one event per request, KV group and step.

    `block_hashes[i]` covers `token_ids[i*block_size:(i+1)*block_size]`; the first block's
    parent is `parent_block_hash` (None at the start of a prompt). Hash-only events (CPU
    offloading) carry no tokens.
    """

    block_hashes: list[_WireHash]
    parent_block_hash: _WireHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None  # process-local id; lora_name is the stable key
    medium: str | None = None  # 0.10.2
    lora_name: str | None = None  # 0.14
    extra_keys: list[Any] | None = None  # 0.17: one tuple (or None) per block
    group_idx: int | None = None  # 0.20: KV cache group (hybrid models)
    kv_cache_spec_kind: str | None = None  # 0.22
    kv_cache_spec_sliding_window: int | None = None  # 0.22
    locality: str | None = None  # 0.26
    ownership: str | None = None  # 0.29
    session_id: str | None = None  # 0.30
    lookahead_token_ids: list[list[int]] | None = None  # 0.33
    # SGLang: set on every block of a salted request (vLLM puts its salt in block 0's
    # extra_keys instead). Never in a vLLM array, so appending it keeps the array layout.
    cache_salt: str | None = None

    type_name: ClassVar[str] = "BlockStored"


class BigramBlockStored(BlockStored, omit_defaults=True):
    """A `BlockStored` of SGLang's EAGLE bigram cache: its pages' tokens are pairs
    (`token_ids` of `[a, b]` items, page i covering `(t[i], t[i+1])`; `block_size` counts
    pairs). The pairs are kept in `token_pairs`; `token_ids` stays empty, so code that
    knows nothing of pairs sees a page without tokens. The index places these pages in
    trees of their own, which a lookup walks with the prompt's units (kvindex.index.keys).

    Made by the decoder's slow path only (`kvindex.wire.decode`): ordinary batches never
    pay for it. Never decoded or encoded as such: the wire calls it `BlockStored` (`wire`
    gives SGLang's form, which encoders write).
    """

    token_pairs: list[tuple[int, int]] = []

    def wire(self) -> _WireBigramBlockStored:
        """This page as SGLang sends it (`token_ids` the pairs): what encoders write."""
        return _WireBigramBlockStored(token_ids=self.token_pairs, **_bigram_fields(self))


class BlockRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False, omit_defaults=True
):
    """Blocks left the cache (one hash per evicted physical copy on the GPU path)."""

    block_hashes: list[_WireHash]
    medium: str | None = None  # 0.10.2
    group_idx: int | None = None  # 0.20
    locality: str | None = None  # 0.26
    ownership: str | None = None  # 0.29

    type_name: ClassVar[str] = "BlockRemoved"


class AllBlocksCleared(
    msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False, omit_defaults=True
):
    """The publisher's whole prefix cache was reset."""

    type_name: ClassVar[str] = "AllBlocksCleared"


class UnknownEvent(msgspec.Struct, gc=False):
    """An event whose tag this version of kvindex does not know; kept so tools can show it."""

    type_name: str
    raw: bytes


Event = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent
"""What a decoded batch holds."""


class EventBatch(msgspec.Struct, gc=False):
    """One published batch (one engine step), decoded.

    `data_parallel_rank` is None for 0.9.0, which did not send it.
    `malformed_events` counts events of a known type whose fields could not be decoded
    (left out of `events`); `unknown_events` counts the `UnknownEvent`s in `events`.
    """

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    malformed_events: int = 0
    unknown_events: int = 0


# Array-form (vLLM 0.9 - 0.23) twins of the event classes: same fields, same order.


class _ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _WireBigramBlockStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", gc=False, forbid_unknown_fields=False
):
    """How SGLang sends a bigram page (map form): BlockStored's fields, `token_ids` pairs."""

    block_hashes: list[_WireHash]
    parent_block_hash: _WireHash | None = None
    token_ids: list[tuple[int, int]] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    session_id: str | None = None
    cache_salt: str | None = None

    def event(self) -> BigramBlockStored:
        return BigramBlockStored(token_pairs=self.token_ids, **_bigram_fields(self))


# What a bigram page carries besides its tokens, the same in both forms (the wire's and
# the index's): `token_ids` is the one field whose meaning differs between them.
_BIGRAM_FIELDS = tuple(f for f in _WireBigramBlockStored.__struct_fields__ if f != "token_ids")


def _bigram_fields(page: BigramBlockStored | _WireBigramBlockStored) -> dict[str, Any]:
    return {name: getattr(page, name) for name in _BIGRAM_FIELDS}


MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
ArrayEvent = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared


class _MapWireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class _ArrayWireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: int | None = None


class _BigramWireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_WireBigramBlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _RawWireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


KNOWN_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
