"""Fuzzing the decoder and the index apply step with hypothesis (briefly, in every run;
`make fuzz` runs the atheris harnesses under fuzz/ for longer).

Properties: the decoder raises nothing but WireError, whatever the bytes; a decoded batch
holds only known event types or UnknownEvent; the index applies any decoded batch without
raising, its pools equal a plain model of copies, and dropping a source frees every tree
node it held."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.index import FleetIndex
from kvindex.subscriber import SourceKey
from kvindex.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    WireError,
)
from kvindex.wire.publisher import encode_batch

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "locality",
]  # fmt: skip
hashes = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=0, max_size=140))
plausible = {
    "block_hashes": st.lists(hashes, max_size=5),
    "parent_block_hash": st.none() | hashes,
    "token_ids": st.lists(st.integers(-(2**63), 2**64 - 1), max_size=24),
    "block_size": st.integers(-4, 8),
    "medium": st.sampled_from([None, "GPU", "CPU"]),
    "group_idx": st.none() | st.integers(0, 3),
    "lora_name": st.none() | st.sampled_from(["x", "y"]),
    "extra_keys": st.none() | st.lists(values, max_size=3),
}


@st.composite
def map_event(draw: st.DrawFn) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"]))
    }
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        strategy = plausible.get(name, values)
        event[name] = draw(st.one_of(strategy, values) if draw(st.booleans()) else strategy)
    return event


@st.composite
def array_event(draw: st.DrawFn) -> list[Any]:
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Y"]))
    return [tag, *draw(st.lists(values, max_size=12))]


batches = st.tuples(
    st.floats(allow_nan=True, allow_infinity=True) | st.integers(0, 2**40) | values,
    st.lists(st.one_of(map_event(), array_event(), values), max_size=6) | values,
    st.none() | st.integers(-1, 8) | values,
)


def check_decoded(batch: EventBatch) -> None:
    assert isinstance(batch.ts, float)
    for event in batch.events:
        assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent)
        for h in getattr(event, "block_hashes", []):
            assert isinstance(h, int | bytes) and not isinstance(h, bool)


def apply_checked(index: FleetIndex, batch: EventBatch) -> None:
    index.apply(SourceKey("f"), batch)
    index.apply(SourceKey("g", 1), batch)
    index.lookup(list(range(16)))
    index.drop_source(SourceKey("f"))
    index.drop_source(SourceKey("g", 1))
    assert index.tree_nodes() == 0 and index.entries() == 0


@FUZZ
@given(batches, st.integers(0, 2))
def test_structured_hostile_batches(parts: tuple[Any, Any, Any], shape: int) -> None:
    payload = msgspec.msgpack.encode(list(parts[: 2 + (shape > 0)]))
    try:
        batch = BatchDecoder().decode(payload)
    except WireError:
        return
    check_decoded(batch)
    apply_checked(FleetIndex(), batch)


@FUZZ
@given(st.data())
def test_mutated_real_payloads(data: st.DataObject) -> None:
    events = [
        BlockStored([1, 2], None, list(range(8)), 4, medium="GPU", lora_name="x"),
        BlockRemoved([b"\x01" * 32], medium="CPU"),
        AllBlocksCleared(),
    ]
    generation = data.draw(st.sampled_from(["maps", "arrays"]))
    payload = bytearray(encode_batch(events, ts=1.0, generation=generation))  # type: ignore[arg-type]
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, max(0, len(payload) - 1)))
        if kind == "flip" and payload:
            payload[at] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del payload[at:]
        else:
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    try:
        batch = BatchDecoder().decode(bytes(payload))
    except WireError:
        return
    check_decoded(batch)
    apply_checked(FleetIndex(), batch)


stored = st.builds(
    BlockStored,
    block_hashes=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    parent_block_hash=st.none() | st.integers(0, 6),
    token_ids=st.lists(st.sampled_from([0, 1, 2**63, 2**64 - 1]), max_size=12),
    block_size=st.sampled_from([-1, 0, 1, 2, 3]),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    lora_name=st.none() | st.just("x"),
    extra_keys=st.none() | st.lists(st.sampled_from([None, 5, "x", ["x"], {"a": 1}]), max_size=3),
    group_idx=st.none() | st.integers(0, 1),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    group_idx=st.none() | st.integers(0, 1),
)


@FUZZ
@given(
    st.lists(
        st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=5), max_size=12
    )
)
def test_index_apply_never_raises_and_pools_follow_a_model(plan: list[list[Any]]) -> None:
    index, src = FleetIndex(), SourceKey("f")
    model: Counter[tuple[int, str, int]] = Counter()
    for events in plan:
        index.apply(src, EventBatch(1.0, events))
        for e in events:
            if isinstance(e, AllBlocksCleared):
                model.clear()
                continue
            key = (e.group_idx or 0, e.medium or "GPU")
            for h in e.block_hashes:
                if isinstance(e, BlockStored):
                    model[(*key, h)] += 1
                elif model[(*key, h)] > 0:
                    model[(*key, h)] -= 1
            model += Counter()  # drop zero counts
        pools = {
            (g, m, h): n for (g, m), pool in index.copies(src).items() for h, n in pool.items()
        }
        assert pools == dict(model)
        index.lookup([0, 1, 2, 3, 0, 1])
    index.drop_source(src)
    assert index.tree_nodes() == 0 and index.entries() == 0
