"""Huge batches (issue 17 point 7): the compiled core applies a batch a slice of hashes
at a time, letting its write lock go between two, so a lookup waits behind one slice
rather than behind a batch of millions of blocks (a 1M-block BlockStored held the lock,
and the lookups waiting for it with the GIL, for 0.7 s).

Slicing must not change what a batch means: the sliced core is held to the pure-Python
reference (which applies each event whole) on the differential streams with slices of 1
to 3 hashes, and on huge events crossing the default slice's boundaries in every way a
store can go (a chain, its parent unknown, hash-only copies on lower tiers, a chain cut
by a key that can't be made, bytes hashes, a removal with unknown hashes, a batch of many
small events, a clear between them). And a reader does get in mid-batch.
"""

from __future__ import annotations

import threading
from typing import Any

import differential
import pytest
import test_core
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.index import ReferenceIndex
from kvindex.subscriber import SourceKey
from kvindex.wire import AllBlocksCleared, BatchDecoder, BlockHash, BlockRemoved, BlockStored
from kvindex.wire.publisher import encode_batch

compiled = pytest.importorskip("kvindex.index.compiled", reason="the compiled core is not built")

SLICE = 4096  # module.c's APPLY_SLICE
BS = 2
A, B = SourceKey("a"), SourceKey("b", 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(test_core.event_plan, max_size=60), st.integers(1, 3))
def test_sliced_core_equals_reference(plan: list[tuple[Any, ...]], hashes: int) -> None:
    """The differential streams (every event shape) through a core applying `hashes`
    hashes per slice: chains cut at every block, each later part hung from the last."""
    stream = test_core.build(plan)
    pure, fast = ReferenceIndex(), compiled.CompiledIndex(seed=7)
    fast._core.set_slice(hashes)
    decoder = BatchDecoder()
    for seq, (src, kind, what) in enumerate(stream):
        if kind == "batch":
            batch, arrays = what
            payload = test_core.payload_of(batch, arrays)
            pure.apply(src, decoder.decode(payload), seq)
            fast.apply_payload(src, payload, seq)
        elif kind == "restart":
            pure.drop_source(src)
            fast.drop_source(src)
        else:
            pure.remove_instance(src.instance)
            fast.remove_instance(src.instance)
    test_core.assert_same(pure, fast)


def tokens_of(first: int, n: int, salt: int = 0) -> list[int]:
    return [(first * BS + i) * 7 + salt for i in range(n * BS)]


def chain(first: int, n: int, *, parent: Any = None, **fields: Any) -> BlockStored:
    """Blocks [first, first + n) of one long prompt, hashes first+1...; `parent` as given."""
    hashes: list[BlockHash] = [first + i + 1 for i in range(n)]
    return BlockStored(hashes, parent, tokens_of(first, n), BS, **fields)


def huge_batches() -> list[tuple[SourceKey, list[Any]]]:
    n = 3 * SLICE + 17  # three boundaries inside each event
    cut = chain(0, n, lookahead_token_ids=[[1]] * n)  # Python's decoder path (apply_ops)
    named: list[BlockHash] = [bytes([i % 251, i // 251]) * 8 for i in range(n)]
    named[SLICE] = named[SLICE - 1]
    return [
        (A, [chain(0, n)]),  # from the root, slices hung from the one before
        (A, [chain(n, n, parent=n)]),  # from a known parent
        (A, [chain(5 * n, n, parent=10**12)]),  # an unknown parent: none placed
        # hash-only copies on a lower tier: each takes its GPU block's place
        (A, [BlockStored([*range(1, 2 * n + 1)], None, [], BS, medium="CPU")]),
        (B, [cut]),
        # bytes hashes, twice the same across a slice boundary, then removed with unknown ones
        (B, [BlockStored(named, None, [], BS)]),
        (B, [BlockRemoved([*named[::2], b"?" * 16])]),
        # many small events, a clear among them, in one batch
        (
            B,
            [chain(i, 1, parent=i or None) for i in range(SLICE + 9)]
            + [AllBlocksCleared()]
            + [chain(i, 2, parent=i or None) for i in range(0, SLICE, 2)],
        ),
        # removals across the boundaries, in a mixed order, with hashes nobody holds
        (A, [BlockRemoved([*range(2 * n, 0, -3), 10**15])]),
        (A, [BlockRemoved([*range(1, 2 * n + 1)], medium="CPU")]),
    ]


def test_huge_events_sliced_equal_reference() -> None:
    """Events of thousands of blocks, across the default slice's boundaries, leave the
    compiled core exactly as the reference (which never slices)."""
    pure, fast = ReferenceIndex(), compiled.CompiledIndex(seed=3)
    decoder = BatchDecoder()
    batches = []
    for seq, (src, events) in enumerate(huge_batches()):
        payload = encode_batch(events, float(seq), src.rank)
        batch = decoder.decode(payload)
        batches.append(batch)
        pure.apply(src, batch, seq)
        fast.apply_payload(src, payload, seq)
        prompts, runs = differential.prompts_of(batches)
        prompts.append((tokens_of(0, 2 * 3 * SLICE), {}))  # the whole first chains
        differential.assert_same(pure, fast, prompts, runs)
    assert fast.slow_batches == 1  # the lookahead chain took the decoder's path


def test_a_reader_gets_in_while_a_huge_batch_is_applied() -> None:
    """A lookup-side reader, on another thread, sees the index between two slices of one
    huge BlockStored (a block of its first slice held, its last not yet): the write lock
    was let go mid-batch. Under one lock for the whole batch it could only ever see none
    or all of it."""
    n = 100 * SLICE
    fast = compiled.CompiledIndex()
    payload = encode_batch([chain(0, n)], 1.0, 0)
    seen: set[tuple[int, int]] = set()
    started, done = threading.Event(), threading.Event()

    def read() -> None:
        started.set()
        while not done.is_set():
            seen.add((fast.count(A, 0, "GPU", 1), fast.count(A, 0, "GPU", n)))

    reader = threading.Thread(target=read)
    reader.start()
    started.wait()
    fast.apply_payload(A, encode_batch([chain(10**6, 1)], 0.0, 0), 0)  # A known
    fast.apply_payload(A, payload, 1)
    done.set()
    reader.join()
    assert (1, 0) in seen  # first slice in, last one not: the reader got in between
    assert fast.count(A, 0, "GPU", n) == 1
    assert fast.cache_stats("a").stored == n + 1


def test_a_slice_is_at_least_one_hash() -> None:
    core = compiled.CompiledIndex()._core
    with pytest.raises(ValueError, match="1 to"):
        core.set_slice(0)
