"""msgpack written by hand where whole encoded parts are joined without decoding them (the
store's group frames, the snapshot's batches): one header, once."""

from __future__ import annotations

__all__ = ["array_header"]


def array_header(n: int) -> bytes:
    """The msgpack header of an array of `n` items (fixarray, array 16 or array 32)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")
