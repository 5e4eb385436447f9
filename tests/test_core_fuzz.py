"""The core fuzzer's corpus and a short seeded run of its mutator, in every `make test`.

fuzz/corediff.py runs a program of payloads (and restarts, instance removals) over four
publishers on the compiled index and on the pure-Python reference, and fails where they
differ: a payload's verdict and counts, the pools, stats, lookups and tree after it, or
anything left once every publisher is dropped. Here it replays fuzz/corpus/ (real SGLang
pages, the simulator's vLLM streams in both generations, every vLLM release's encoding,
hand-made shapes) and a few hundred mutants of it from a fixed seed (`make fuzz` runs the
coverage-guided version for as long as asked). Below: what the fuzzer found, each as a
plain test that failed before its fix, and the divergences it found that are by design
(strict xfails: they fail the suite the day the core handles them, so the note goes too).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fuzz"))
pytest.importorskip("kvindex.index._core", reason="the compiled core is not built")

import corediff  # noqa: E402
from mutate import mutate  # noqa: E402
from program import CONTROL, program  # noqa: E402

from kvindex.index import ReferenceIndex  # noqa: E402
from kvindex.index.compiled import CompiledIndex  # noqa: E402
from kvindex.subscriber import SourceKey  # noqa: E402
from kvindex.wire import BlockRemoved, BlockStored, WireError  # noqa: E402
from kvindex.wire.publisher import encode_batch  # noqa: E402

CORPUS = sorted((ROOT / "fuzz" / "corpus").iterdir())
MUTANTS = 600
PARTS = 5  # tests the seeded walk's comparisons are split into (see below)


def test_the_corpus_is_there() -> None:
    kinds = {path.name.split("-")[0] for path in CORPUS}
    assert {"sglang", "sim", "shape"} <= kinds, kinds


def test_corpus_gives_the_same_state_on_both() -> None:
    for path in CORPUS:
        corediff.check(path.read_bytes())
    assert not corediff.KNOWN, corediff.KNOWN  # the seeds are all plain, comparable


def seeded_mutants(count: int) -> list[bytes]:
    """The first `count` inputs of a fixed-seed walk of the fuzzer's mutator from the
    corpus (each mutant may be mutated again): the same inputs every run."""
    rng = random.Random(1309)
    pool = [path.read_bytes() for path in CORPUS]
    out = []
    for _ in range(count):
        data = rng.choice(pool)
        for _ in range(rng.randint(1, 3)):
            data = mutate(data, rng, 1 << 15)
        out.append(data)
        pool.append(data)
    return out


@pytest.mark.parametrize("part", range(PARTS))
def test_seeded_mutants_give_the_same_state_on_both(part: int) -> None:
    """The walk's MUTANTS inputs, each compared in full, in PARTS tests of as many: one
    test of all 600 took 115-123 s against its 120 s timeout on a loaded machine. Each
    part makes the walk from the start (the mutator is cheap; the comparisons are not)
    and compares its share, so the inputs are the same as one walk's."""
    size = MUTANTS // PARTS
    for data in seeded_mutants(MUTANTS)[part * size : (part + 1) * size]:
        try:
            corediff.check(data)
        except corediff.Mismatch as exc:
            raise AssertionError(f"{exc}; input: {data!r}") from exc


def test_the_parts_cover_the_whole_walk() -> None:
    assert MUTANTS % PARTS == 0
    assert len(seeded_mutants(MUTANTS)) == MUTANTS


def test_the_check_catches_a_difference() -> None:
    """The comparison is not vacuous: a compiled index that missed one batch differs."""
    payload = encode_batch([BlockStored([1, 2], None, list(range(8)), 4)], 1.0, 0, "maps")
    pure, fast = ReferenceIndex(), CompiledIndex(seed=1)
    pure.apply_payload(SourceKey("a"), payload)
    with pytest.raises(AssertionError):
        corediff.differential.assert_same(pure, fast)


# -- what the fuzzer found --------------------------------------------------------------


def test_a_refused_payload_registers_no_publisher() -> None:
    """A payload that is no batch at all, from a publisher never heard of: both refuse it
    and neither lists the publisher (the compiled index kept it, empty, in every answer)."""
    corediff.check(program([(1, b"\x92")]))
    fast = CompiledIndex(seed=1)
    with pytest.raises(WireError):
        fast.apply_payload(SourceKey("b"), b"\x92")
    assert fast.instances() == [] and fast.lookup([1, 2, 3, 4]) == []


@pytest.mark.parametrize("group", [2**31, 2**32, 2**40 + 3, -(2**31) - 1, -(2**62)])
def test_a_group_past_32_bits_is_its_own_pool(group: int) -> None:
    """group_idx is any int on the wire: the core kept it as int32, so 2^32 became group 0
    and every event made one more pool of it (stores doubled, removals missed)."""
    stored = encode_batch([BlockStored([7], None, [1, 2, 3, 4], 4, group_idx=group)], 1.0, 0)
    removed = encode_batch([BlockRemoved([7], group_idx=group)], 2.0, 0)
    corediff.check(program([(0, stored), (0, stored), (1, stored), (1, removed)]))
    fast = CompiledIndex(seed=1)
    fast.apply_payload(SourceKey("a"), stored)
    fast.apply_payload(SourceKey("a"), stored)
    assert fast.copies(SourceKey("a")) == {(group, "GPU"): {7: 2}}


@pytest.mark.parametrize("generation", ["maps", "arrays"])
def test_an_empty_medium_is_the_gpu(generation: str) -> None:
    """A medium of "" is the GPU, as no medium is (fleet.py: `event.medium or GPU`): the
    core made a pool of its own for it, so a removal naming "" missed the GPU copy."""
    h = b"\x82" * 32
    stored = encode_batch([BlockStored([h], None, [], 4, medium="")], 1.0, 0, generation)
    removed = encode_batch([BlockRemoved([h], medium="")], 2.0, 0, generation)
    corediff.check(program([(0, stored), (1, stored), (1, removed)]))
    fast = CompiledIndex(seed=1)
    fast.apply_payload(SourceKey("a"), stored)
    assert fast.copies(SourceKey("a")) == {(0, "GPU"): {h: 1}}
    fast.apply_payload(SourceKey("a"), removed)
    assert fast.entries() == 0


# -- what were divergences by design ------------------------------------------------------


def test_group_idx_past_int64() -> None:
    """A uint64 group_idx past INT64_MAX is its own group (the core clamped it once)."""
    pure, fast = ReferenceIndex(), CompiledIndex(seed=1)
    for group in (2**63, 2**63 + 1):
        payload = encode_batch([BlockStored([5], None, [1, 2, 3, 4], 4, group_idx=group)])
        pure.apply_payload(SourceKey("a"), payload)
        fast.apply_payload(SourceKey("a"), payload)
    assert fast.copies(SourceKey("a")) == pure.copies(SourceKey("a"))
    assert fast.count(SourceKey("a"), 2**63 + 1, "GPU", 5) == 1
    assert fast.lookup([1, 2, 3, 4]) == pure.lookup([1, 2, 3, 4])
    payload = encode_batch([BlockRemoved([5], group_idx=2**63)])
    pure.apply_payload(SourceKey("a"), payload)
    fast.apply_payload(SourceKey("a"), payload)
    assert fast.copies(SourceKey("a")) == pure.copies(SourceKey("a"))
    assert fast.lookup([1, 2, 3, 4]) == pure.lookup([1, 2, 3, 4])


def test_uint64_groups_are_compared() -> None:
    """A group_idx past int64 is no known divergence any more: the fuzzer compares it."""
    payload = encode_batch([BlockStored([5], None, [1, 2, 3, 4], 4, group_idx=2**63)])
    before = sum(corediff.KNOWN.values())
    corediff.check(program([(0, payload), (CONTROL, b"")]))
    assert sum(corediff.KNOWN.values()) == before
