"""The heap by its allocators' own statistics (kvindex.runtime.heap): each figure moves by
what is made and freed, and the core's is exactly what its C holds."""

from __future__ import annotations

import gc

import pytest

from kvindex.index import COMPILED
from kvindex.runtime.heap import heap_bytes


def test_pymalloc_counts_small_objects_and_gives_them_back() -> None:
    before = heap_bytes()
    assert before.pymalloc is not None
    made = [bytearray(40) for _ in range(50_000)]  # 96-byte objects: pymalloc's
    grown = heap_bytes()
    assert grown.pymalloc is not None
    assert 50_000 * 90 <= grown.pymalloc - before.pymalloc <= 50_000 * 140
    del made
    gc.collect()
    after = heap_bytes()
    assert after.pymalloc is not None
    assert after.pymalloc - before.pymalloc < 50_000 * 10


def test_malloc_counts_big_blocks() -> None:
    before = heap_bytes()
    if before.malloc is None:
        pytest.skip("this malloc keeps no statistics (mallinfo2)")
    big = bytearray(64 << 20)  # past pymalloc's 512 bytes and malloc's mmap threshold
    grown = heap_bytes()
    assert before.malloc is not None and grown.malloc is not None
    assert (64 << 20) <= grown.malloc - before.malloc <= (65 << 20)
    assert grown.total is not None and before.total is not None
    assert grown.total - before.total >= 64 << 20
    del big


@pytest.mark.skipif(not COMPILED, reason="the compiled core is not built")
def test_the_core_figure_is_what_its_c_holds() -> None:
    from kvindex.index._core import allocated
    from kvindex.index.compiled import CompiledIndex
    from kvindex.subscriber import SourceKey
    from kvindex.wire import BlockStored, EventBatch

    before = heap_bytes().core
    index = CompiledIndex(seed=1)
    tokens = list(range(16 * 2_000))
    index.apply(
        SourceKey("a"), EventBatch(0.0, [BlockStored(list(range(2_000)), None, tokens, 16)]), 0
    )
    held = heap_bytes().core
    assert held == allocated()[0]
    assert held - before > 2_000 * 20  # nodes and table entries, at least
    del index
    gc.collect()
    assert heap_bytes().core == before
