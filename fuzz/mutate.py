"""Structure-aware mutations of core fuzzer programs (fuzz/corediff.py's input format).

Byte flips alone rarely get past msgpack's framing to the fields that matter, so most
mutations work on the decoded payload: a value somewhere in the batch replaced by one of
the values the parser and the model treat apart (integer widths and signs at their
boundaries, NaN, wrong types, known field names and media, bytes of the hash lengths'
edges), a list item duplicated or dropped, a map key renamed. Others work on the program
(steps dropped, duplicated, swapped, given another publisher, a restart or removal put
between) or on raw bytes (a length header claiming 2^32 items, a truncation, a flip).

`mutate(data, rng)` is the whole mutator; atheris's custom mutator (fuzz/fuzz_core.py) and
the short seeded run in tests/test_core_fuzz.py both call it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import msgspec
from program import CONTROL, WIDE, program, steps

__all__ = ["mutate"]

Step = tuple[int, bytes]

INTS = [
    0, 1, -1, 2, 4, 16, 31, 32, 33, 63, 64, 127, 128, 255, 256, 65535, 65536,
    2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
    -32, -33, -128, -129, -(2**31), -(2**31) - 1, -(2**63),
]  # fmt: skip
FLOATS = [0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 1e300]
STRINGS = [
    "", "GPU", "gpu", "CPU", "CPU_PINNED", "DISK", "external", "x" * 40, "ad", "t1", "é",
    "BlockStored", "BlockRemoved", "AllBlocksCleared", "Unknown", "type",
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids", "cache_salt", "full_attention", "sliding_window", "mamba",
]  # fmt: skip
BYTES = [b"", b"\x01", b"\x07" * 32, b"\x08" * 32, b"\x00" * 128, b"\x00" * 129]
HUGE_HEADERS = [b"\xdd\xff\xff\xff\xff", b"\xdd\x80\x00\x00\x01", b"\xdc\xff\xff",
                b"\xdf\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xf0",
                b"\x91" * 70]  # fmt: skip
_encoder = msgspec.msgpack.Encoder()


def _interesting(rng: random.Random, old: Any) -> Any:
    pick = rng.randrange(10)
    if pick < 3:
        if rng.randrange(4) or not isinstance(old, int):
            return rng.choice(INTS)
        return old + rng.choice([-1, 1])
    if pick < 4:
        return rng.choice(FLOATS)
    if pick < 6:
        return rng.choice(STRINGS)
    if pick < 7:
        return rng.choice(BYTES)
    if pick < 8:
        return rng.choice([None, True, False])
    if pick < 9:
        return [old] if rng.randrange(2) else [old, old]
    return {rng.choice(STRINGS): old}


def _nodes(value: Any, path: tuple[Any, ...], out: list[tuple[Any, ...]], depth: int) -> None:
    out.append(path)
    if depth > 8:
        return
    if isinstance(value, list):
        for i, item in enumerate(value[:64]):
            _nodes(item, (*path, i), out, depth + 1)
    elif isinstance(value, dict):
        for key in list(value)[:32]:
            _nodes(value[key], (*path, key), out, depth + 1)


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def _structural(payload: bytes, rng: random.Random) -> bytes | None:
    try:
        value = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError, ValueError):
        return None
    paths: list[tuple[Any, ...]] = []
    _nodes(value, (), paths, 0)
    path = rng.choice(paths)
    target = _get(value, path)
    kind = rng.randrange(4)
    if kind == 0 and isinstance(target, list) and target:  # an item duplicated or dropped
        i = rng.randrange(len(target))
        if rng.randrange(2):
            target.insert(i, target[i])
        else:
            del target[i]
    elif kind == 1 and isinstance(target, dict) and target:  # a key renamed
        key = rng.choice(list(target))
        target[rng.choice(STRINGS)] = target.pop(key)
    elif path:
        _get(value, path[:-1])[path[-1]] = _interesting(rng, target)
    else:
        value = _interesting(rng, value)
    try:
        return _encoder.encode(value)
    except (TypeError, OverflowError, ValueError):
        return None


def _bytes(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    kind = rng.randrange(5)
    at = rng.randrange(len(data) + 1)
    if kind == 0:
        data[at:at] = rng.choice(HUGE_HEADERS)
    elif kind == 1:
        del data[at:]
    elif kind == 2 and data:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 3 and data:  # an int re-encoded wider (msgpack allows any width)
        data[at:at] = rng.choice([b"\xcf", b"\xd3", b"\xce", b"\xd2", b"\xcd", b"\xcc"])
    else:
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(data)


def _program(chunks: list[Step], rng: random.Random) -> list[Step]:
    kind = rng.randrange(5)
    i = rng.randrange(len(chunks))
    if kind == 0 and len(chunks) > 1:
        del chunks[i]
    elif kind == 1:
        chunks.insert(i, chunks[i])
    elif kind == 2:
        j = rng.randrange(len(chunks))
        chunks[i], chunks[j] = chunks[j], chunks[i]
    elif kind == 3 and i == 0 and chunks[0][0] < CONTROL:  # into or out of a wide fleet
        control, payload = chunks[0]
        chunks[0] = (control ^ WIDE, payload)
    elif kind == 3:
        control, payload = chunks[i]
        # another publisher for an apply; a restart or removal becomes an apply
        new = (control & ~3) | rng.randrange(4) if control < CONTROL else rng.randrange(4)
        chunks[i] = (new, payload)
    else:
        chunks.insert(i, (CONTROL | rng.choice([0, 4]) | rng.randrange(4), b""))
    return chunks


def mutate(
    data: bytes,
    rng: random.Random,
    max_size: int = 1 << 16,
    raw: Callable[[bytes, int], bytes] | None = None,
) -> bytes:
    """One mutation of a program. `raw(payload, max_size)`: a byte-level mutator to use
    for a share of the payload mutations (atheris.Mutate: libFuzzer's, which learns from
    the comparisons it traced); our own flips otherwise."""
    chunks = list(steps(data)) or [(0, _encoder.encode([0.0, []]))]
    pick = rng.randrange(10)
    if pick == 0:
        chunks = _program(chunks, rng)
    else:
        payloads = [i for i, (control, _) in enumerate(chunks) if control < CONTROL]
        if not payloads:
            return program(_program(chunks, rng))[:max_size]
        i = rng.choice(payloads)
        control, payload = chunks[i]
        new = _structural(payload, rng) if pick < 6 else None
        if new is None:
            new = raw(payload, max_size) if raw is not None and pick >= 8 else _bytes(payload, rng)
        chunks[i] = (control, new)
    return program(chunks)[:max_size]
