"""Simulated events on the wire, exactly as one vLLM generation encodes them.

`"0.33"` (maps, vLLM >= 0.24): each event a map tagged by `type`, with vLLM's
`omit_defaults` presence rules: the fields without a default (`parent_block_hash`,
`lora_id`, `medium`, `lora_name`, ...) are always there, even when None; the later ones only
when set. GPU stores carry `extra_keys` (one entry per block: `[lora_name]` or None),
`group_idx` and `kv_cache_spec_kind`; CPU stores are the offloading connector's hash-only
placeholders, one hash per event.

`"0.23"` (positional arrays, vLLM <= 0.23): msgspec's `array_like` writes every field,
defaults included, so BlockStored is 12 items (tag first), BlockRemoved 4 and
AllBlocksCleared 1. CPU (offloading) events carry raw digest bytes whatever the GPU path
uses, as vLLM 0.11 - 0.23 did.

Hashes: `"int"` is vLLM's default on the wire (the digest's last 8 bytes as an unsigned
64-bit int), `"bytes"` the 32-byte digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from kvindex.sim.engine import CPU, GPU, Cleared, Offloaded, Removed, SimEvent, Stored
from kvindex.sim.workload import Digest
from kvindex.wire import BlockHash

__all__ = ["FORMATS", "HASH_KINDS", "HashKind", "WireFormat", "encode_step", "wire_hash"]

WireFormat = Literal["0.33", "0.23"]
HashKind = Literal["int", "bytes"]
FORMATS: tuple[WireFormat, ...] = ("0.33", "0.23")
HASH_KINDS: tuple[HashKind, ...] = ("int", "bytes")

_encoder = msgspec.msgpack.Encoder()
_SPEC_KIND = "full_attention"


def wire_hash(digest: Digest, kind: HashKind) -> BlockHash:
    """A digest as the GPU path publishes it."""
    return int.from_bytes(digest[-8:], "big") if kind == "int" else digest


def cpu_hash(digest: Digest, kind: HashKind, fmt: WireFormat) -> BlockHash:
    """A digest as the CPU offloading path publishes it (always bytes up to vLLM 0.23)."""
    return digest if fmt == "0.23" else wire_hash(digest, kind)


def encode_step(
    events: Sequence[SimEvent],
    ts: float,
    dp_rank: int,
    block_size: int,
    fmt: WireFormat = "0.33",
    hashes: HashKind = "int",
) -> bytes:
    """One engine step's events as a vLLM `KVEventBatch` payload: `[ts, events, dp_rank]`."""
    build = _map_events if fmt == "0.33" else _array_events
    body: list[Any] = []
    for event in events:
        body.extend(build(event, block_size, hashes))
    return _encoder.encode([ts, body, dp_rank])


def _extra_keys(event: Stored) -> list[list[str] | None]:
    name = None if event.lora is None else [event.lora.name]
    return [name] * len(event.digests)


def _map_events(event: SimEvent, block_size: int, hashes: HashKind) -> list[dict[str, Any]]:
    if isinstance(event, Stored):
        return [_map_stored(event, block_size, hashes)]
    if isinstance(event, Offloaded):
        return [_map_offloaded(d, hashes) for d in event.digests]
    if isinstance(event, Removed):
        convert = wire_hash if event.medium == GPU else _cpu_int
        return [
            {
                "type": "BlockRemoved",
                "block_hashes": [convert(d, hashes) for d in event.digests],
                "medium": event.medium,
                "group_idx": 0,
            }
        ]
    assert isinstance(event, Cleared)
    return [{"type": "AllBlocksCleared"}]


def _cpu_int(digest: Digest, kind: HashKind) -> BlockHash:
    return cpu_hash(digest, kind, "0.33")


def _map_stored(event: Stored, block_size: int, hashes: HashKind) -> dict[str, Any]:
    lora = event.lora
    return {
        "type": "BlockStored",
        "block_hashes": [wire_hash(d, hashes) for d in event.digests],
        "parent_block_hash": None if event.parent is None else wire_hash(event.parent, hashes),
        "token_ids": event.token_ids,
        "block_size": block_size,
        "lora_id": None if lora is None else lora.ident,
        "medium": GPU,
        "lora_name": None if lora is None else lora.name,
        "extra_keys": _extra_keys(event),
        "group_idx": 0,
        "kv_cache_spec_kind": _SPEC_KIND,
    }


def _map_offloaded(digest: Digest, hashes: HashKind) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [cpu_hash(digest, hashes, "0.33")],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": CPU,
        "lora_name": None,
        "group_idx": 0,
    }


def _array_events(event: SimEvent, block_size: int, hashes: HashKind) -> list[list[Any]]:
    if isinstance(event, Stored):
        lora = event.lora
        return [
            [
                "BlockStored",
                [wire_hash(d, hashes) for d in event.digests],
                None if event.parent is None else wire_hash(event.parent, hashes),
                event.token_ids,
                block_size,
                None if lora is None else lora.ident,
                GPU,
                None if lora is None else lora.name,
                _extra_keys(event),
                0,
                _SPEC_KIND,
                None,
            ]
        ]
    if isinstance(event, Offloaded):
        digests = list(event.digests)
        return [
            ["BlockStored", digests, None, [], block_size, None, CPU, None, None, 0, None, None]
        ]
    if isinstance(event, Removed):
        if event.medium == GPU:
            return [["BlockRemoved", [wire_hash(d, hashes) for d in event.digests], GPU, 0]]
        return [["BlockRemoved", list(event.digests), CPU, 0]]
    assert isinstance(event, Cleared)
    return [["AllBlocksCleared"]]
