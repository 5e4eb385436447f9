"""Warm restarts across tiers: the store's snapshot must put every (pool, hash) entry back
at the prefix-tree node the live index had it at.

Since the index model of issue 20, a block's place can come from another pool of the same
publisher: an unkeyed lower-tier copy keeps the place its GPU or keyed copy has, and a GPU
or keyed copy takes the others' copies over (FleetIndex._take_over), a place that outlives
the copy that gave it. The store's mirror (store/state.py) keeps runs (BlockStored chains),
so it copies that rule: a placed GPU or LoRA-keyed run re-homes the other pools' copies it
takes over into runs of their own (Mirror._take_over). Each case below is a minimal
sequence a random search (SQLite and Redis, with another replica compacting) found wrong
before that rule, or before a pool of hash-only events learnt its block size from the
place it was given (the last case: the index counted such a pool's blocks nowhere, the
restarted one did). The random store tests (test_store_sqlite.py, test_store_redis.py)
draw such plans too.

The mirror and the index still state the rule twice; one definition of what an event does
to a pool, shared by both, is issue 13's item 4.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_store_redis import Harness, Replica
from test_store_sqlite import B1, NAMESPACES, PROMPTS, A, apply_rich, nonempty, ns_lookup, rows_of

pytestmark = pytest.mark.timeout(60)


# Each step: (apply_rich's op, compact after it, have another replica compact after it).
CASES = [
    pytest.param(
        [
            (("pair", A, 1, 2, 2, None, "GPU", False), True, False),
            (("pair", A, 1, 0, 1, None, "CPU", True), False, False),
        ],
        id="a-removed-placed-copy-hands-nothing-over",
    ),
    pytest.param(
        [
            (("store", B1, 2, 2, 3, None, "CPU", True), False, True),
            (("store", B1, 0, 1, 1, None, "CPU", False), False, False),
            (("pair", B1, 0, 1, 3, None, "GPU", True), False, False),
        ],
        id="hash-only-cpu-copy-then-gpu-chain",
    ),
    pytest.param(
        [
            (("store", B1, 0, 1, 3, "x", "CPU", True), False, False),
            (("pair", B1, 0, 1, 2, "x", "GPU", True), False, True),
        ],
        id="keyed-gpu-copy-takes-an-unanchored-cpu-chain-over",
    ),
    pytest.param(
        [
            (("store", A, 2, 0, 2, None, "CPU", True), False, False),
            (("store", A, 0, 2, 1, None, "CPU", False), False, False),
            (("pair", A, 0, 0, 3, None, "GPU", True), False, False),
            (("pair", A, 0, 2, 2, None, "GPU", True), False, False),
        ],
        id="gpu-chain-removed-under-a-placed-cpu-copy",
    ),
    pytest.param(
        [
            (("store", A, 2, 2, 1, None, "CPU", True), True, False),
            (("pair", A, 2, 2, 3, None, "GPU", True), False, False),
        ],
        id="gpu-chain-places-a-compacted-cpu-block",
    ),
    pytest.param(
        [
            (("store", B1, 1, 0, 1, "x", "GPU", False), False, False),
            (("pair", B1, 0, 0, 4, "x", "CPU", True), False, False),
        ],
        id="keyed-cpu-chain-places-a-hash-only-gpu-copy-then-leaves",
    ),
]


@pytest.mark.parametrize("steps", CASES)
def test_a_restart_puts_every_entry_back_in_place(redis_server: Any, steps: list[Any]) -> None:
    h = Harness(redis_server.url)
    other = Replica(h.client)
    for op, compact, by_other in steps:
        apply_rich(h, [op])
        if compact:
            h.compact()
            h.compactor.release(h.client)
        if by_other:
            h.appender.flush(h.client)
            other.compact()
    h.compact()
    loaded, _ = h.reload()
    for source in {op[1] for op, _, _ in steps}:
        assert nonempty(loaded.copies(source)) == nonempty(h.reference.copies(source))
    for prompt in PROMPTS:
        for ns in NAMESPACES:
            assert rows_of(ns_lookup(loaded, prompt, ns)) == rows_of(
                ns_lookup(h.reference, prompt, ns)
            )
