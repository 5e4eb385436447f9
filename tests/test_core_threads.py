"""The compiled core used from several threads at once (issue 27 points 1 and 5, issue 23).

Each race is forced where the core has a hook for it (`pause_slices`: a batch's applying
thread waits between two slices, holding neither the lock nor the GIL), else run for a
bounded time in a child process, so a crash fails the test instead of the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvindex.subscriber import SourceKey
from kvindex.wire import BlockStored
from kvindex.wire.publisher import encode_batch

compiled = pytest.importorskip("kvindex.index.compiled", reason="the compiled core is not built")
CompiledIndex = compiled.CompiledIndex

BS = 4
HERE = Path(__file__).resolve().parent


def _chain(first: int, n: int, **fields: object) -> bytes:
    tokens = [(first + i) % 50_000 for i in range(n * BS)]
    event = BlockStored(
        block_hashes=list(range(first, first + n)), token_ids=tokens, block_size=BS, **fields
    )
    return encode_batch([event], ts=1.0)


def _wait_paused(index: CompiledIndex, threads: int = 1) -> None:
    deadline = time.monotonic() + 10
    while index._core.slices_paused() < threads:
        assert time.monotonic() < deadline, "the batch never paused between slices"
        time.sleep(0.001)


def test_a_batch_cut_in_slices_never_reaches_the_publisher_given_its_bit() -> None:
    """Point 1: publisher `a` is removed between two slices of its batch and its bit handed
    to `b` before the next slice. The rest of `a`'s batch must go nowhere: before the
    per-source serial, `b` held `a`'s hashes and nodes were left orphaned."""
    index = CompiledIndex()
    index._core.set_slice(16)
    index._core.pause_slices(True)
    a, b = SourceKey("a"), SourceKey("b")
    index.apply_payload(a, _chain(10_000, 4))  # one slice: registered, bit 0
    worker = threading.Thread(target=index.apply_payload, args=(a, _chain(1, 400)))
    worker.start()
    try:
        _wait_paused(index)
        index.remove_instance("a")
        index.apply_payload(b, _chain(900_000, 8))  # one slice: takes bit 0, never pauses
        assert index.source_bits() == {0: b}
    finally:
        index._core.pause_slices(False)
        worker.join(10)
    assert not worker.is_alive()
    assert index.block_hashes("b") == set(range(900_000, 900_008))
    assert index.cache_stats("b").stored == 8
    index.remove_instance("b")
    assert (index.entries(), index.tree_nodes()) == (0, 0)


def test_a_batch_cut_in_slices_goes_on_after_a_lookup_between_them() -> None:
    """The pause hook itself: a paused batch resumes and lands whole."""
    index = CompiledIndex()
    index._core.set_slice(16)
    index._core.pause_slices(True)
    a = SourceKey("a")
    worker = threading.Thread(target=index.apply_payload, args=(a, _chain(1, 100)))
    worker.start()
    try:
        _wait_paused(index)
        index.lookup([1, 2, 3, 4])  # the lock is free between slices
        for _ in range(3):
            index._core.resume_slices()
            time.sleep(0.01)
    finally:
        index._core.pause_slices(False)
        worker.join(10)
    assert index.block_hashes("a") == set(range(1, 101))


def test_names_interned_while_lookups_ask_by_name() -> None:
    """Issue 23: one thread applies batches of 64 BlockStored with fresh lora_names (the
    name table grows and rehashes under the write lock) while others look up by name
    (the names were resolved before the read lock was taken: a segfault within 15 s in
    1 run of 6). In a child: a crash fails this test, not the run."""
    child = subprocess.run(
        [sys.executable, str(HERE / "core_threads.py"), "--seconds", "4", "--only", "names"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert child.returncode == 0, child.stdout + child.stderr
    assert "names: ok" in child.stdout


def test_every_kind_of_question_while_publishers_come_and_go() -> None:
    """Ingest, membership churn and every kind of lookup at once (what `make sanitize`
    runs under ThreadSanitizer): no crash, no error, and the end state exact."""
    child = subprocess.run(
        [sys.executable, str(HERE / "core_threads.py"), "--seconds", "4"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert child.returncode == 0, child.stdout + child.stderr
    assert "all: ok" in child.stdout


def test_publishers_applied_at_once_end_where_the_reference_does() -> None:
    """Issue 23 item 2: four publishers applied at once, each on its own thread, their
    chains meeting in the tree (shared prompts, LoRA and salted namespaces, bytes hashes,
    a CPU tier and a second group, removals and clears), while every kind of question is
    asked: the end state and every answer equal the reference fed the streams one
    publisher after the other. What a write side applied in parallel must keep."""
    child = subprocess.run(
        [sys.executable, str(HERE / "core_threads.py"), "--seconds", "3", "--only", "exact"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert child.returncode == 0, child.stdout + child.stderr
    assert "exact: ok" in child.stdout


class _JoinsMidLookup(CompiledIndex):
    """A publisher joins while a lookup builds its rows: exactly when another thread's
    join would land (the empty rows are asked for under the lookup's read lock)."""

    join: SourceKey | None = None

    def _empty_for(self, size: int, *layout: object) -> list[compiled.LookupRow]:
        if self.join is not None:
            self._pub(self.join)  # registered: the cached layout is replaced
            self.layout()
            self.join = None
        return super()._empty_for(size, *layout)  # type: ignore[arg-type]


def test_rows_keep_the_layout_the_lookup_started_with() -> None:
    """Point 5: lookups failed with "empty rows do not match the layout" while publishers
    joined or left (the empty rows were built from the newest layout, not the one passed;
    an equal-length change would have given rows under the wrong names)."""
    index = _JoinsMidLookup()
    index.apply_payload(SourceKey("b"), _chain(1, 4))
    index.apply_payload(SourceKey("c"), _chain(100, 4))
    index.join = SourceKey("a")
    rows = index.lookup([9, 9, 9, 9])  # matches nothing: every row is an empty one
    assert [row.instance for row in rows] == ["b", "c"]
    assert [row.instance for row in index.lookup([9, 9, 9, 9])] == ["a", "b", "c"]
    index.join = SourceKey("d")
    assert [row.instance for row in index.lookup_hashes([12345])] == ["a", "b", "c"]


class _Grows:
    """An int-like whose `__index__` runs Python that changes the list being read."""

    def __init__(self, grows: list[object], by: int = 10_000) -> None:
        self.grows, self.by = grows, by

    def __index__(self) -> int:
        self.grows.extend([0] * self.by)
        return 0


class _Empties:
    def __init__(self, empties: list[object]) -> None:
        self.empties = empties

    def __index__(self) -> int:
        self.empties.clear()
        return 4


def test_numbers_that_run_python_are_refused() -> None:
    """Point 4: a rank list read in two passes, the second running `__index__` that grew
    it, wrote past its buffer (a segfault); an op's number emptying the op's hash list
    left the C reading freed bytes. Only ints are taken now: nothing runs in between."""
    index = CompiledIndex()
    index.apply_payload(SourceKey("a"), _chain(1, 4))
    pairs: list[object] = [0, 0]
    pairs[0] = _Grows(pairs)
    with pytest.raises(TypeError, match="int"):
        index.lookup_json([1, 2, 3, 4], None, None, [(b'"a"', pairs)], [b'"up"'])
    hashes: list[object] = [b"h" * 40 + bytes([i]) for i in range(8)]
    op = ("S", hashes, None, [], 0, None, _Empties(hashes), None, None, None, False)
    op += (None, None, None, None, 0, False, False)
    with pytest.raises(TypeError, match="int"):
        index._core.apply_ops(5, [op])
    with pytest.raises(TypeError, match="int"):
        index._core.clear(_Grows([]), True)
    assert index.block_hashes("a") == {1, 2, 3, 4}


def test_a_layout_of_the_wrong_shape_is_refused() -> None:
    """Point 4: layout entries were read as tuples without a check."""
    index = CompiledIndex()
    index.apply_payload(SourceKey("a"), _chain(1, 4))
    for layout in ([["a", [(0, 0)]]], [("a", [[0, 0]])], [("a", [(0, "x")])], [("a", [])]):
        with pytest.raises(TypeError, match="layout"):
            index._core.lookup(
                [1, 2, 3, 4], None, None, layout, index._empty_for, compiled.LookupRow
            )
