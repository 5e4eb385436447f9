"""Rendering block hashes as text, as the interface promises.

An int hash is written as its decimal digits (a negative one keeps its sign), a bytes hash
as lowercase hex. The two can never collide: hex of a digest is 64 characters of [0-9a-f]
and a 64-bit int has at most 20 digits; but a short bytes hash made of digits only could,
so `parse_hash` needs to know the kind when it matters (see `parse_hash`).
"""

from __future__ import annotations

import re

from kvindex.wire.events import BlockHash

__all__ = ["parse_hash", "render_hash"]

_DECIMAL = re.compile(r"-?[0-9]{1,20}")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


def render_hash(value: BlockHash) -> str:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def parse_hash(text: str) -> BlockHash:
    """Inverse of `render_hash`: decimal (<= 20 digits, fits 64 bits) is an int, else hex bytes."""
    if _DECIMAL.fullmatch(text):
        value = int(text)
        if -(2**63) <= value < 2**64:
            return value
    if _HEX.fullmatch(text):
        return bytes.fromhex(text)
    raise ValueError(f"not a block hash: {text!r} (decimal int or lowercase hex bytes)")
