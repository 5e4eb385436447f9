"""The differential check behind the compiled core's fuzzing: one input, three indexes.

An input is a program (fuzz/program.py): payloads and restarts over four publishers. Every
step goes to the pure-Python reference (`ReferenceIndex`, which decodes the payload with
kvindex.wire) and to the compiled index (`CompiledIndex`, whose C parser takes what it can
and hands the rest to the same decoder). They must agree on everything a caller can see:

- each payload's verdict: both refuse it (`WireError`) or both apply it, with the same
  time, DP rank, malformed and unknown event counts; any other exception is a crash;
- after the program: everything tests/differential.py compares (publishers, pools and
  copies, stats, hashes by medium, the tree, and the rows of lookups by tokens along
  every chain the payloads stored, in every namespace they named, and by hashes), and
  `count` per pool; the same of a second compiled index fed the decoded batches instead
  (`apply`: the path of a store's feed and the simulator);
- then, every publisher dropped: nothing left in either tree or pool; and once the
  compiled index is gone, every byte its C allocated is freed (`_core.allocated()`).

A divergence known and reported to the lead rather than fixed (see `_known`) is counted in
`KNOWN` and the input not compared further, so a long run can go on.

Used by fuzz/fuzz_core.py (atheris, `make fuzz`) and tests/test_core_fuzz.py.
"""

from __future__ import annotations

import gc
import math
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import differential
from program import CONTROL, FILLERS, SOURCES, steps, wide

from kvindex.index import ReferenceIndex, _core
from kvindex.index.compiled import CompiledIndex
from kvindex.subscriber import SourceKey
from kvindex.wire import BatchDecoder, EventBatch, WireError

__all__ = ["KNOWN", "Mismatch", "check"]

PUBLISHERS = [SourceKey(instance, rank) for instance, rank in SOURCES]
MEDIA = (None, "GPU", "cpu", "CPU_PINNED", "disk", "external")
KNOWN: Counter[str] = Counter()  # inputs that hit a known divergence, by which
EMPTY_BATCH = b"\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x90"  # [0.0, []]


class Mismatch(AssertionError):
    """The two implementations disagreed (or one crashed): a bug in one of them."""


def _outcome(index: Any, source: SourceKey, payload: bytes, seq: int) -> Any:
    try:
        r = index.apply_payload(source, payload, seq)
    except WireError:
        return "refused"
    except Exception as exc:  # anything else is a crash of that implementation
        raise Mismatch(f"{type(index).__name__} raised {type(exc).__name__}: {exc}") from exc
    return (r.ts, r.dp_rank, r.malformed_events, r.unknown_events)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return bool(a == b)
    nan = isinstance(a[0], float) and isinstance(b[0], float) and math.isnan(a[0])
    return ((nan and math.isnan(b[0])) or a[0] == b[0]) and a[1:] == b[1:]


def _same_counts(pure: ReferenceIndex, fast: CompiledIndex) -> None:
    """`count` of a few held hashes per pool (and of one no pool holds), as each says."""
    for source in pure.sources():
        for (group, medium), held in pure.copies(source).items():
            for h in [*list(held)[:6], 0xDEAD]:
                assert fast.count(source, group, medium, h) == pure.count(
                    source, group, medium, h
                ), (source, group, medium, h)


def _known(pure: ReferenceIndex) -> str | None:
    """A state the compiled core can't hold the same way, by design (for the lead): none
    now (a group_idx in [2^63, 2^64), a uint64 on the wire, was one until the core kept
    such groups apart)."""
    del pure
    return None


def check(data: bytes) -> None:
    """Run one input on both indexes; raise `Mismatch` where they differ, or where the
    compiled one leaves C memory behind."""
    gc.collect()  # an earlier index in a cycle goes now, not during the comparison
    before = _core.allocated()
    _compare(data)
    after = _core.allocated()
    if after != before:
        gc.collect()  # an index kept alive by a cycle (a traceback's frames) goes now
        after = _core.allocated()
    if after != before:
        raise Mismatch(f"C memory leaked: {before} (bytes, blocks) before, {after} after")


def _compare(data: bytes) -> None:
    # `fast` takes the payloads (the C parser, or its Python fallback); `decoded` takes the
    # batches the Python decoder made of them (`apply`: a store's feed, the simulator).
    pure, fast, decoded = ReferenceIndex(), CompiledIndex(seed=11), CompiledIndex(seed=12)
    indexes = (pure, fast, decoded)
    if wide(data):  # 62 publishers first: the program's own get bits 62 to 65
        for i in range(FILLERS):
            for index in indexes:
                index.apply_payload(SourceKey(f"filler-{i:02}", 0), EMPTY_BATCH)
    decoder = BatchDecoder()
    batches: list[EventBatch] = []
    for seq, (control, payload) in enumerate(steps(data)):
        source = PUBLISHERS[control & 3]
        if control >= CONTROL:
            for index in indexes:
                if control & 4:
                    index.remove_instance(source.instance)
                else:
                    index.drop_source(source)
            continue
        a, b = _outcome(pure, source, payload, seq), _outcome(fast, source, payload, seq)
        known = _known(pure)
        if known is not None:
            KNOWN[known] += 1
            return
        if not _same(a, b):
            raise Mismatch(f"step {seq}: pure {a!r}, compiled {b!r}")
        if a != "refused":
            batches.append(decoder.decode(payload))
            decoded.apply(source, batches[-1], seq)
    prompts, hash_runs = differential.prompts_of(batches)
    for name, index in (("compiled", fast), ("compiled from decoded batches", decoded)):
        try:
            differential.assert_same(pure, index, prompts, hash_runs, MEDIA)
            _same_counts(pure, index)
        except AssertionError as exc:  # say which comparison: differential's are bare
            where = traceback.extract_tb(exc.__traceback__)[-1].line
            raise Mismatch(f"{name}: state differs: {where} {exc}") from exc
    for source in pure.sources():
        for index in indexes:
            index.drop_source(source)
    if any(index.tree_nodes() or index.entries() for index in indexes):
        raise Mismatch("state left after every publisher was dropped")
