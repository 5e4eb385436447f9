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

`"sglang"` (SGLang 0.5.23's `ZmqEventPublisher` and `KVCacheEventRecorder`): tagged maps
with `omit_defaults`: `BlockStored` always has `block_hashes`, `parent_block_hash`,
`token_ids`, `block_size` (the page size) and `lora_id` (None), then `medium` (`GPU`,
`CPU_PINNED` for HiCache's host tier, `DISK` for its storage tier) and, only when set,
`cache_salt` and `lora_name`; consecutive pages of one chain are one event (the recorder
merges them). Lower tiers publish their pages with parents and tokens, as GPU ones.
`BlockRemoved` is `block_hashes` and `medium`. Hashes are signed 64-bit ints (the first 8
bytes of the page's SHA-256), whatever `hashes` says.

Hashes: `"int"` is vLLM's default on the wire (the digest's last 8 bytes as an unsigned
64-bit int), `"bytes"` the 32-byte digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from kvindex.sim.engine import CPU, DISK, GPU, Cleared, Offloaded, Page, Removed, SimEvent, Stored
from kvindex.sim.workload import Digest
from kvindex.wire import BlockHash

__all__ = [
    "FORMATS",
    "HASH_KINDS",
    "SGLANG_MEDIA",
    "HashKind",
    "WireFormat",
    "encode_step",
    "medium_name",
    "sglang_hash",
    "wire_hash",
]

WireFormat = Literal["0.33", "0.23", "sglang"]
HashKind = Literal["int", "bytes"]
FORMATS: tuple[WireFormat, ...] = ("0.33", "0.23", "sglang")
# The simulator's tiers under SGLang's medium names (`StorageMedium`).
SGLANG_MEDIA = {GPU: "GPU", CPU: "CPU_PINNED", DISK: "DISK"}
HASH_KINDS: tuple[HashKind, ...] = ("int", "bytes")

_encoder = msgspec.msgpack.Encoder()
_SPEC_KIND = "full_attention"


def wire_hash(digest: Digest, kind: HashKind) -> BlockHash:
    """A digest as the GPU path publishes it."""
    return int.from_bytes(digest[-8:], "big") if kind == "int" else digest


def sglang_hash(digest: Digest) -> int:
    """A digest as SGLang publishes it: its first 8 bytes as a signed 64-bit int."""
    return int.from_bytes(digest[:8], "big", signed=True)


def medium_name(medium: str, fmt: WireFormat) -> str:
    """A simulated tier under the name the format's engine gives it."""
    return SGLANG_MEDIA[medium] if fmt == "sglang" else medium


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
    """One engine step's events as a vLLM `KVEventBatch` payload: `[ts, events, dp_rank]`
    (or SGLang's `EventBatch`, the same three positions)."""
    if fmt == "sglang":
        return _encoder.encode([ts, _sglang_events(events, block_size), dp_rank])
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


def _sglang_events(events: Sequence[SimEvent], block_size: int) -> list[dict[str, Any]]:
    body: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, Stored):
            _enqueue(body, _sglang_stored(event, block_size))
        elif isinstance(event, Offloaded):
            for stored in _sglang_offloaded(event, block_size):
                _enqueue(body, stored)
        elif isinstance(event, Removed):
            hashes = [sglang_hash(d) for d in event.digests]
            medium = SGLANG_MEDIA[event.medium]
            _enqueue(body, {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium})
        else:
            body.append({"type": "AllBlocksCleared"})
    return body


_SAME_STORE = ("medium", "lora_id", "block_size", "cache_salt", "lora_name")


def _enqueue(body: list[dict[str, Any]], event: dict[str, Any]) -> None:
    """Append `event`, merged into the tail as SGLang's `KVCacheEventRecorder.enqueue` does:
    removals of one medium in a row, and stores that continue the tail's chain."""
    if body and _merges(body[-1], event):
        body[-1]["block_hashes"].extend(event["block_hashes"])
        if event["type"] == "BlockStored":
            body[-1]["token_ids"].extend(event["token_ids"])
        return
    body.append(event)


def _merges(tail: dict[str, Any], event: dict[str, Any]) -> bool:
    if tail["type"] != event["type"]:
        return False
    if event["type"] == "BlockRemoved":
        return bool(tail["medium"] == event["medium"])
    return (
        event["type"] == "BlockStored"
        and all(tail.get(k) == event.get(k) for k in _SAME_STORE)
        and bool(tail["block_hashes"])
        and event["parent_block_hash"] == tail["block_hashes"][-1]
    )


def _sglang_store(
    digests: list[Digest],
    parent: Digest | None,
    tokens: list[int],
    block_size: int,
    medium: str,
    lora_name: str | None,
    salt: str | None,
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [sglang_hash(d) for d in digests],
        "parent_block_hash": None if parent is None else sglang_hash(parent),
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
    }
    if salt is not None:
        event["cache_salt"] = salt
    if lora_name is not None:
        event["lora_name"] = lora_name
    return event


def _sglang_stored(event: Stored, block_size: int) -> dict[str, Any]:
    lora = None if event.lora is None else event.lora.name
    return _sglang_store(
        event.digests, event.parent, event.token_ids, block_size, "GPU", lora, event.salt
    )


def _sglang_offloaded(event: Offloaded, block_size: int) -> list[dict[str, Any]]:
    """A lower tier's pages, one event per run of a chain (as the recorder merges them)."""
    if event.pages is None:
        raise ValueError("SGLang's lower tiers publish pages: simulate them with page_tiers")
    medium = SGLANG_MEDIA[event.medium]
    out: list[dict[str, Any]] = []
    run: list[tuple[Digest, Page]] = []
    for digest, page in zip(event.digests, event.pages, strict=True):
        if run and not _continues(run[-1], page):
            out.append(_sglang_run(run, block_size, medium))
            run = []
        run.append((digest, page))
    if run:
        out.append(_sglang_run(run, block_size, medium))
    return out


def _continues(tail: tuple[Digest, Page], page: Page) -> bool:
    digest, last = tail
    return page.parent == digest and page.lora == last.lora and page.salt == last.salt


def _sglang_run(run: list[tuple[Digest, Page]], block_size: int, medium: str) -> dict[str, Any]:
    first = run[0][1]
    tokens = [t for _, page in run for t in page.tokens]
    lora = None if first.lora is None else first.lora.name
    digests = [d for d, _ in run]
    return _sglang_store(digests, first.parent, tokens, block_size, medium, lora, first.salt)
