"""The input format of the core fuzzer: a *program* of steps over four publishers.

Steps are separated by `SEP`; each is a control byte and, for an apply, the payload. Kept
apart from fuzz/corediff.py (which imports the package) so that the mutator and the
corpus tools can load without importing the compiled core.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["CONTROL", "FILLERS", "MAX_STEPS", "SEP", "SOURCES", "WIDE", "program", "steps", "wide"]

# Steps are split on this: 0xc1 is the one byte msgpack never uses as a type, so a payload
# only holds it inside a string, bin or number (where the fuzzer may well put it: then the
# step just splits differently, which is another valid program).
SEP = b"\xc1KV\xc1"
# The publishers (instance, DP rank): two ranks of one instance, and two alone.
SOURCES = [("a", 0), ("b", 0), ("b", 1), ("c", 3)]
# A control byte of 0xf0 and up is not an apply: bit 2 set removes the instance, else the
# publisher restarts (drop_source). Below 0xf0 the rest of the step is a payload.
CONTROL = 0xF0
# The first step's control byte with this bit (and below CONTROL): a wide fleet, where 62
# other publishers came first, so the program's own ones hold bits 62 to 65 and a block
# they share needs a holder set of two words (below 64 publishers, one word is all).
WIDE = 0x80
FILLERS = 62
MAX_STEPS = 64


def steps(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The (control byte, payload) steps of an input."""
    for chunk in data.split(SEP)[:MAX_STEPS]:
        if chunk:
            yield chunk[0], chunk[1:]


def program(chunks: Iterable[tuple[int, bytes]]) -> bytes:
    """An input made of steps (the inverse of `steps`)."""
    return SEP.join(bytes([control]) + payload for control, payload in chunks)


def wide(data: bytes) -> bool:
    """Whether the program runs in a wide fleet (see WIDE)."""
    return bool(data) and WIDE <= data[0] < CONTROL
