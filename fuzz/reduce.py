"""Shrink a failing core fuzzer input to a small one that fails the same way.

    python fuzz/reduce.py CRASH_FILE [OUT_FILE]

Drops steps, then simplifies each payload: decoded, its list items and map entries are
dropped and its values replaced by simpler ones while the failure stays; a payload that
does not decode is cut shorter instead. "The same way": the same exception type and the
same first words of its message (what differed), so a reduction never wanders to another
bug. Prints the reduced program step by step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corediff import check
from program import program, steps

Step = tuple[int, bytes]


def failure(data: bytes) -> str | None:
    try:
        check(data)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).split(':')[0]}"
    return None


def _drop_steps(chunks: list[Step], fails: Callable[[list[Step]], bool]) -> list[Step]:
    i = 0
    while i < len(chunks):
        trial = chunks[:i] + chunks[i + 1 :]
        if trial and fails(trial):
            chunks = trial
        else:
            i += 1
    return chunks


def _simpler(value: Any) -> list[Any]:
    """Smaller variants of a decoded value, smallest first."""
    out: list[Any] = []
    if isinstance(value, list):
        out += [value[:i] + value[i + 1 :] for i in range(len(value))]
        for i, item in enumerate(value):
            out += [[*value[:i], v, *value[i + 1 :]] for v in _simpler(item)]
    elif isinstance(value, dict):
        keys = list(value)
        out += [{k: value[k] for k in keys if k != drop} for drop in keys]
        out += [{**value, k: v} for k in keys for v in _simpler(value[k])]
    elif isinstance(value, int) and not isinstance(value, bool) and value not in (0, 1):
        out += [0, 1, value // 2] if abs(value) > 1 else [0]
    elif isinstance(value, str | bytes) and len(value) > 1:
        out += [value[:1], value[: len(value) // 2]]
    return out


def _reduce_payload(payload: bytes, fails: Callable[[bytes], bool]) -> bytes:
    try:
        value = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError, ValueError):
        while len(payload) > 1 and fails(payload[: len(payload) // 2]):
            payload = payload[: len(payload) // 2]
        return payload
    changed = True
    while changed:
        changed = False
        for variant in _simpler(value):
            try:
                encoded = msgspec.msgpack.encode(variant)
            except (TypeError, OverflowError):
                continue
            if len(encoded) <= len(payload) and encoded != payload and fails(encoded):
                value, payload, changed = variant, encoded, True
                break
    return payload


def reduce(data: bytes) -> bytes:
    want = failure(data)
    if want is None:
        raise SystemExit("the input does not fail")
    chunks = _drop_steps(list(steps(data)), lambda c: failure(program(c)) == want)
    for i, (control, payload) in enumerate(chunks):

        def fails(p: bytes, i: int = i, control: int = control) -> bool:
            trial = [*chunks[:i], (control, p), *chunks[i + 1 :]]
            return failure(program(trial)) == want

        chunks[i] = (control, _reduce_payload(payload, fails))
    return program(chunks)


def show(data: bytes) -> None:
    for control, payload in steps(data):
        try:
            what = repr(msgspec.msgpack.decode(payload))
        except (msgspec.DecodeError, RecursionError, ValueError):
            what = f"(not msgpack) {payload!r}"
        print(f"{control:#04x} {what}")


def main() -> None:
    data = Path(sys.argv[1]).read_bytes()
    reduced = reduce(data)
    print(failure(reduced))
    show(reduced)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_bytes(reduced)


if __name__ == "__main__":
    main()
