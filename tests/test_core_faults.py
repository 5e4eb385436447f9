"""The compiled core's questions when memory runs out (issue 26), allocation by allocation.

Every question is asked again and again, the n-th allocation failing each time: first the
core's own C allocations (`_core.fail_allocs(n)`, alloc.h), then CPython's
(`_testcapi.set_nomemory`, which fails the allocations of the Python objects the answers
are made of). Each call must raise MemoryError or give the whole right answer; nothing
the C allocated may be left over (the core counts its blocks), and the index answers as
before afterwards. `make sanitize` runs this file under ASan/UBSan/LSan, where a double
release or a leak on one of these paths is a report: `Core_pools` released the pool's
dict twice when building its row failed, and leaked the medium when the group failed;
`walk_tree` returned a list with an error set when a namespace's name failed.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest

from kvindex.index.localhash import local_hashes
from kvindex.subscriber import SourceKey
from kvindex.wire import BlockRemoved, BlockStored
from kvindex.wire.publisher import encode_batch

compiled = pytest.importorskip("kvindex.index.compiled", reason="the compiled core is not built")
_testcapi = pytest.importorskip("_testcapi")
_core = pytest.importorskip("kvindex.index._core")

BS = 4
TOKENS = list(range(40))
LOCAL = local_hashes(TOKENS[:12], BS)


def _index() -> Any:
    index = compiled.CompiledIndex(local_hashes=True)
    a, b = SourceKey("a"), SourceKey("b", 1)
    index.apply_payload(a, encode_batch([BlockStored([1, 2, 3], None, TOKENS[:12], BS)], ts=1.0))
    events = [
        BlockStored([b"x" * 32, 12], None, TOKENS[:8], BS, medium="CPU", lora_name="ad"),
        BlockStored([21, 22], None, TOKENS[:8], BS, group_idx=1),
        BlockRemoved([22], group_idx=1),
    ]
    index.apply_payload(b, encode_batch(events, ts=1.0))
    index.apply_payload(SourceKey("c"), encode_batch([BlockStored([1, 2], None, TOKENS[:8], BS)]))
    return index


def _questions(index: Any) -> dict[str, Callable[[], object]]:
    core = index._core
    slots = [(b'"a"', [0, 0]), (b'"b"', [1, 1]), (b'"c"', [0, 2])]
    return {
        "pools": lambda: [core.pools(bit) for bit in range(3)],
        "pool_keys": lambda: [core.pool_keys(bit) for bit in range(3)],
        "walk_tree": lambda: sorted(map(repr, core.walk_tree())),
        "lookup": lambda: index.lookup(TOKENS[:12]),
        "lookup_lora": lambda: index.lookup(TOKENS[:12], lora_name="ad"),
        "lookup_json": lambda: core.lookup_json(TOKENS[:12], None, None, slots, [b'"up"'] * 3),
        "lookup_hashes": lambda: core.lookup_hashes([1, 2, b"x" * 32, 12]),
        "lookup_local": lambda: index.lookup_local_hashes(LOCAL),
        "distinct": lambda: core.distinct([0, 1, 2]),
        "hashes": lambda: sorted(map(repr, core.hashes(1, "CPU"))),
        "memory": core.memory,
        "stats": lambda: [core.stats(bit) for bit in range(3)],
    }


def _under(
    fail: Callable[[int], None], stop: Callable[[], None], n: int, ask: Callable[[], object]
) -> object:
    fail(n)
    try:
        return ask()
    except MemoryError:
        return MemoryError
    finally:
        stop()


def _c_fail(n: int) -> None:
    _core.fail_allocs(n)


def _c_stop() -> None:
    _core.fail_allocs(0)


def _py_fail(n: int) -> None:
    _testcapi.set_nomemory(n, n + 1)


def _py_stop() -> None:
    _testcapi.remove_mem_hooks()


@pytest.mark.parametrize("which", ["c", "python"])
def test_every_question_survives_each_allocation_failing(which: str) -> None:
    fail, stop = (_c_fail, _c_stop) if which == "c" else (_py_fail, _py_stop)
    index = _index()
    questions = _questions(index)
    expected = {name: ask() for name, ask in questions.items()}
    gc.collect()
    before = _core.allocated()
    failed = 0
    for name, ask in questions.items():
        for n in range(1, 80):
            got = _under(fail, stop, n, ask)
            if got is MemoryError:
                failed += 1
            else:
                assert got == expected[name], (name, n)
    assert failed > 20  # the failures did land in the questions
    gc.collect()
    assert _core.allocated() == before  # no C block left over by a failed answer
    assert {name: ask() for name, ask in questions.items()} == expected


def test_media_and_spec_kinds_go_with_their_last_pool() -> None:
    """Issue 27 point 3: a publisher naming a fresh medium (and spec kind) per event grew
    the core for good: the names were interned before the 33rd pool was refused, and
    kept after the publisher was removed (22 MB after ten rounds). They are held by the
    pools and group specs that name them now, and go with the last one: after the first
    round (the tables' capacities), rounds leave the core's C memory as it was."""
    index = compiled.CompiledIndex()
    a = SourceKey("a")
    held = []
    for round_ in range(4):
        events = [
            BlockStored(
                [100 + i],
                None,
                TOKENS[:4],
                BS,
                medium=f"m{round_}-{i}" * 8,
                kv_cache_spec_kind=f"kind-{round_}-{i}" * 8,
            )
            for i in range(200)
        ]
        index.apply_payload(a, encode_batch(events, ts=1.0))
        assert len(index._core.pool_keys(0)) == 32  # MAX_POOLS: the rest refused
        index.remove_instance("a")
        gc.collect()
        held.append(_core.allocated())
    assert held[1:] == [held[0]] * 3
