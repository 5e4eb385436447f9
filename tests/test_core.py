"""The compiled core against the pure-Python reference: identical state and answers.

Hypothesis streams of every event shape the model knows (both wire generations, LoRA and
salted namespaces the vLLM and SGLang ways, multimodal and lookahead own keys, hash-only
and skipped-block events, several groups and tiers, duplicate copies, clears, restarts,
instances removed) go to `ReferenceIndex` (decoded, in Python) and to `CompiledIndex` (as
the payload bytes, through the C parser or its Python fallback). After each stream the two
must hold the same pools and copies, count the same stats, give the same rows for every
lookup (by tokens and by hashes) and have the same tree.
"""

from __future__ import annotations

import os
import random
from typing import Any

import differential
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.index import ReferenceIndex
from kvindex.index.localhash import as_signed, local_hashes
from kvindex.subscriber import SourceKey
from kvindex.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BigramBlockStored,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
)
from kvindex.wire.publisher import encode_batch

compiled = pytest.importorskip("kvindex.index.compiled", reason="the compiled core is not built")
CompiledIndex = compiled.CompiledIndex

BS = 4
SOURCES = [SourceKey("a"), SourceKey("b", 0), SourceKey("b", 1), SourceKey("c")]
BASE = [list(range(10, 30)), list(range(100, 120)), [7] * 20]
POOLS = [(0, None), (0, "GPU"), (0, "CPU"), (1, None), (0, "CPU_PINNED"), (2, "DISK"), (0, "")]
NAMESPACES = [
    {},
    {"lora_name": "ad-1"},
    {"vllm_salt": "t1"},
    {"lora_name": "ad-1", "vllm_salt": "t1"},
    {"cache_salt": "t2"},
    {"lora_id": 3},
    {"mm": True},
    {"lookahead": True},
]


def prompt_of(p: int, variant: int) -> list[int]:
    base = BASE[p]
    return base[:8] + [t + variant for t in base[8:]]


def block_hash(tokens: list[int], n: int, ns: int, signed: bool) -> int | bytes:
    h = hash(("kv", ns, tuple(tokens[: (n + 1) * BS]))) & (2**64 - 1)
    if ns == 7:
        return h.to_bytes(8, "big") * 4  # a 32-byte digest
    return h - 2**63 if signed else h


def stored_event(
    tokens: list[int], first: int, last: int, ns: int, pool: tuple[int, str | None], form: int
) -> BlockStored:
    names = NAMESPACES[ns]
    hashes = [block_hash(tokens, n, ns, form == 1) for n in range(first, last)]
    parent = block_hash(tokens, first - 1, ns, form == 1) if first else None
    fields: dict[str, Any] = {
        "medium": pool[1],
        "group_idx": pool[0],
        "lora_name": names.get("lora_name"),
        "lora_id": names.get("lora_id"),
        "cache_salt": names.get("cache_salt"),
    }
    extra: list[Any] | None = None
    if form == 2:  # vLLM 0.33 sends [None, ...] for a plain request
        extra = [None] * len(hashes)
    if names.get("lora_name"):
        extra = [[names["lora_name"]] for _ in hashes]
    if names.get("vllm_salt") and first == 0 and hashes:
        extra = extra or [None] * len(hashes)
        extra[0] = [*(extra[0] or []), names["vllm_salt"]]
    if names.get("mm") and hashes:
        extra = extra or [None] * len(hashes)
        extra[-1] = [["img", first]]
    if names.get("lookahead"):
        fields["lookahead_token_ids"] = [[tokens[0]] for _ in hashes]
    fields["extra_keys"] = extra
    token_ids = tokens[first * BS : last * BS]
    if form == 5:  # SGLang's EAGLE bigram pages: units (t[i], t[i+1]), BS a page
        last = min(last, (len(tokens) - 1) // BS)
        hashes = [block_hash(tokens, n, -1 - ns, False) for n in range(first, last)]
        parent = block_hash(tokens, first - 1, -1 - ns, False) if first else None
        pairs = [(tokens[j], tokens[j + 1]) for j in range(first * BS, last * BS)]
        return BigramBlockStored(hashes, parent, block_size=BS, token_pairs=pairs, **fields)
    if form == 3:  # hash-only (an offload event)
        token_ids = []
    elif form == 4 and len(hashes) > 1:  # a window group that skipped a block
        hashes = hashes[1:]
    return BlockStored(hashes, parent, token_ids, BS, **fields)


event_plan = st.tuples(
    st.sampled_from(["store"] * 5 + ["remove"] * 3 + ["clear", "restart", "drop"]),
    st.integers(0, len(SOURCES) - 1),
    st.integers(0, len(BASE) - 1),
    st.integers(0, 2),  # prompt variant
    st.integers(0, 4),  # first block
    st.integers(0, 3),  # blocks
    st.integers(0, len(NAMESPACES) - 1),
    st.integers(0, len(POOLS) - 1),
    # form: 0 plain, 1 signed hashes, 2 [None] keys, 3 hash-only, 4 skipped, 5 bigram pages
    st.integers(0, 6),
    st.booleans(),  # array generation (vLLM <= 0.23), where the event allows it
)


def build(plan: list[tuple[Any, ...]]) -> list[tuple[SourceKey, str, Any]]:
    """The stream: (source, kind, EventBatch or None)."""
    held: dict[SourceKey, list[tuple[int | bytes, str | None, int]]] = {}
    out: list[tuple[SourceKey, str, Any]] = []
    for kind, s, p, variant, first, count, ns, pool_i, form, arrays in plan:
        src = SOURCES[s]
        if kind == "store":
            tokens = prompt_of(p, variant)
            blocks = len(tokens) // BS
            first = min(first, blocks - 1)
            last = min(blocks, first + count)
            event = stored_event(tokens, first, last, ns, POOLS[pool_i], form % 6)
            held.setdefault(src, []).extend(
                (h, POOLS[pool_i][1], POOLS[pool_i][0]) for h in event.block_hashes
            )
            out.append((src, "batch", (EventBatch(float(len(out)), [event], src.rank), arrays)))
        elif kind == "remove":
            entries = held.get(src) or [(12345, None, 0)]
            h, medium, group = entries[(first * 7 + count + variant) % len(entries)]
            event = BlockRemoved([h], medium=medium, group_idx=group)
            out.append((src, "batch", (EventBatch(float(len(out)), [event], src.rank), arrays)))
        elif kind == "clear":
            held[src] = []
            out.append((src, "batch", (EventBatch(0.0, [AllBlocksCleared()], src.rank), arrays)))
        elif kind == "restart":
            held[src] = []
            out.append((src, "restart", None))
        else:
            out.append((src, "drop", None))
    return out


def payload_of(batch: EventBatch, arrays: bool) -> bytes:
    events = batch.events
    # Arrays (vLLM <= 0.23) can't carry SGLang's cache_salt or 0.33's lookahead fields.
    generation = (
        "arrays"
        if arrays
        and not any(
            isinstance(e, BlockStored) and (e.cache_salt or e.lookahead_token_ids) for e in events
        )
        else "maps"
    )
    return encode_batch(events, batch.ts, batch.data_parallel_rank, generation)


def feed(stream: list[tuple[SourceKey, str, Any]]) -> tuple[ReferenceIndex, Any]:
    pure, fast = ReferenceIndex(), CompiledIndex(seed=7, local_hashes=True)
    feed_into(stream, pure, fast)
    return pure, fast


def feed_into(stream: list[tuple[SourceKey, str, Any]], pure: Any, *others: Any) -> None:
    """The stream into the reference (decoded batches) and each of `others` (payloads)."""
    decoder = BatchDecoder()
    for seq, (src, kind, what) in enumerate(stream):
        if kind == "batch":
            batch, arrays = what
            payload = payload_of(batch, arrays)
            pure.apply(src, decoder.decode(payload), seq)
            for other in others:
                other.apply_payload(src, payload, seq)
        elif kind == "restart":
            for index in (pure, *others):
                index.drop_source(src)
        else:
            for index in (pure, *others):
                index.remove_instance(src.instance)


LOOKUP_NAMES: list[dict[str, Any]] = [
    {},
    {"lora_name": "ad-1"},
    {"cache_salt": "t1"},
    {"cache_salt": "t2"},
    {"lora_name": "ad-1", "cache_salt": "t1"},
]
# Lookups that supply a block's multimodal keys (the "mm" namespace's events give the last
# block of a store [["img", first]]): per block b and offset f, as per-block extra keys,
# and as an input at b * BS + f (vLLM's derivation: the same key in that block, and keys in
# the blocks it spans after).
MM_LOOKUPS: list[dict[str, Any]] = [
    {"extra_keys": [None] * b + [[["img", f]]]} for b in range(5) for f in range(b + 1)
] + [
    {"mm_features": [{"identifier": "img", "offset": b * BS + f, "length": n}]}
    for b in range(5)
    for f in range(BS)
    for n in (1, BS + 1)
]
PROMPTS = [
    (prompt_of(p, variant), names)
    for p in range(len(BASE))
    for variant in range(3)
    for names in [*LOOKUP_NAMES, *MM_LOOKUPS]
]
HASH_RUNS = [
    [block_hash(prompt_of(p, variant), n, ns, False) for n in range(len(BASE[p]) // BS)]
    for p in range(len(BASE))
    for variant in range(3)
    for ns in range(len(NAMESPACES))
]


# Dynamo's local hashes of the prompts in every namespace a lookup can name (and signed,
# and restricted to a LoRA or a block size): the compiled core keeps them (local_hashes).
LOCAL_RUNS: list[tuple[list[int], dict[str, Any]]] = [
    (local_hashes(prompt_of(p, variant), BS, lora, salt), kw)
    for p in range(len(BASE))
    for variant in range(3)
    for lora, salt in [(None, None), ("ad-1", None), (None, "t1"), (None, "t2"), ("ad-1", "t1")]
    for kw in [{}, {"lora_name": lora or "x"}, {"block_size": 2 * BS}]
] + [
    ([as_signed(h) for h in local_hashes(prompt_of(0, 0), BS)], {}),
    (local_hashes(prompt_of(1, 0)[:8], 2), {}),
]


def assert_same(pure: ReferenceIndex, fast: Any) -> None:
    local = LOCAL_RUNS if fast.local_hashes else ()
    differential.assert_same(pure, fast, PROMPTS, HASH_RUNS, local_runs=local)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event_plan, max_size=60))
def test_compiled_equals_reference(plan: list[tuple[Any, ...]]) -> None:
    pure, fast = feed(build(plan))
    assert_same(pure, fast)
    for src in list(pure.sources()):  # memory follows what is held
        pure.drop_source(src)
        fast.drop_source(src)
    assert fast.tree_nodes() == pure.tree_nodes() == 0
    assert fast.entries() == 0


def test_fast_parser_takes_the_common_shapes() -> None:
    """vLLM's plain and LoRA stores, removals and clears of both generations, and SGLang's
    salted pages go through the C parser, not the Python fallback."""
    fast = CompiledIndex(seed=1)
    tokens = prompt_of(0, 0)
    for arrays in (False, True):
        for ns, form in ((0, 0), (0, 2), (1, 0), (2, 0), (3, 0), (5, 0)):
            event = stored_event(tokens, 0, 4, ns, (0, "GPU"), form)
            fast.apply_payload(SOURCES[0], payload_of(EventBatch(1.0, [event]), arrays), 1)
        removal = BlockRemoved([block_hash(tokens, 3, 0, False)], medium="GPU", group_idx=0)
        fast.apply_payload(SOURCES[0], payload_of(EventBatch(1.0, [removal]), arrays), 2)
    salted = stored_event(tokens, 0, 4, 4, (0, "GPU"), 0)
    fast.apply_payload(SOURCES[0], payload_of(EventBatch(1.0, [salted]), False), 3)
    assert fast.slow_batches == 0
    for ns in (6, 7):  # multimodal and lookahead keys: the Python path makes them
        event = stored_event(tokens, 0, 4, ns, (0, "GPU"), 0)
        fast.apply_payload(SOURCES[0], payload_of(EventBatch(1.0, [event]), False), 4)
    assert fast.slow_batches == 2


def mutations(payload: bytes, rng: random.Random) -> list[bytes]:
    out = [payload[:cut] for cut in range(0, len(payload), max(1, len(payload) // 7))]
    for _ in range(20):
        data = bytearray(payload)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        out.append(bytes(data))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_parser_agrees_with_msgspec_on_broken_payloads(seed: int) -> None:
    """Truncated and corrupted batches: the compiled index applies exactly what the Python
    decoder makes of each (or refuses it with WireError, as the decoder does)."""
    rng = random.Random(seed)
    tokens = prompt_of(1, 1)
    events = [
        stored_event(tokens, 0, 3, rng.randrange(len(NAMESPACES)), (0, "GPU"), rng.randrange(3)),
        BlockRemoved([block_hash(tokens, 2, 0, False)], medium="GPU"),
    ]
    for arrays in (False, True):
        payload = payload_of(EventBatch(2.0, events, 0), arrays)
        pure, fast = ReferenceIndex(), CompiledIndex(seed=3, local_hashes=True)
        decoder = BatchDecoder()
        for data in mutations(payload, rng):
            try:
                pure.apply(SOURCES[0], decoder.decode(data), 1)
                pure_error = False
            except WireError:
                pure_error = True
            try:
                fast.apply_payload(SOURCES[0], data, 1)
                fast_error = False
            except WireError:
                fast_error = True
            assert fast_error == pure_error, data
        assert_same(pure, fast)


def test_the_limits_of_the_core_are_the_reference_s() -> None:
    """More pools than a publisher may have, more block sizes than may have roots: both
    implementations hold the same (a hostile publisher made the core raise MemoryError
    and hold unplaced what the reference placed)."""
    from kvindex.index.reference import MAX_POOLS, MAX_ROOT_SIZES

    events = [
        BlockStored([g, bytes([g]) * 32], None, list(range(8)), BS, group_idx=g)
        for g in range(MAX_POOLS + 4)
    ]
    events += [BlockStored([1000 + n], None, [n] * n, n) for n in range(1, MAX_ROOT_SIZES + 4)]
    pure, fast = ReferenceIndex(), CompiledIndex(seed=2, local_hashes=True)
    for arrays in (False, True):
        payload = payload_of(EventBatch(1.0, events), arrays)  # type: ignore[arg-type]
        pure.apply(SOURCES[0], BatchDecoder().decode(payload), 1)
        fast.apply_payload(SOURCES[0], payload, 1)
        fast.apply(SOURCES[1], EventBatch(1.0, events), 1)  # the ops path
        pure.apply(SOURCES[1], EventBatch(1.0, events), 1)
    prompts = [([n] * n, {}) for n in range(1, MAX_ROOT_SIZES + 4)]
    differential.assert_same(pure, fast, prompts, [[g, bytes([g]) * 32] for g in range(40)])


def test_group_specs_past_max_groups_are_full_attention_in_both() -> None:
    """A window spec on a group from MAX_GROUPS on is not kept by the core (its layout has
    room for 64 groups' specs): the reference does the same, so both answer alike (pure
    32 tokens where the core said 0, before)."""
    from kvindex.index.reference import MAX_GROUPS

    tokens = prompt_of(0, 0)[:16]
    window = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
    for group in (MAX_GROUPS - 1, MAX_GROUPS, 100):
        events = [
            BlockStored([1, 2, 3, 4], None, tokens, BS, group_idx=0),
            BlockStored([11, 12, 13, 14], None, tokens, BS, group_idx=group, **window),
            BlockRemoved([11], group_idx=group),
        ]
        pure, fast = ReferenceIndex(), CompiledIndex(seed=3)
        payload = payload_of(EventBatch(1.0, events), False)  # type: ignore[arg-type]
        pure.apply(SOURCES[0], BatchDecoder().decode(payload), 1)
        fast.apply_payload(SOURCES[0], payload, 1)
        differential.assert_same(pure, fast, [(tokens, {})])


def test_a_group_holding_nothing_limits_the_hit_whoever_else_holds_what() -> None:
    """A hybrid instance (group 0 of 4-token blocks, group 1 of 8) whose group 1 lost its
    only block reuses nothing: every group must hold the prefix. Both indexes said 8 tokens
    while no publisher held a block of 8 (no tree of that size, so the group was passed
    over) and 0 once another instance stored an unrelated one: one instance's answer
    depended on another's blocks (found by the sharded index's differential test)."""
    tokens, other = prompt_of(0, 0)[:16], prompt_of(1, 0)[:16]
    hybrid = [
        BlockStored([1, 2], None, tokens[:8], 4, group_idx=0),
        BlockStored([11], None, tokens[:8], 8, group_idx=1),
        BlockRemoved([11], group_idx=1),
    ]
    unrelated = [BlockStored([21], None, other[:8], 8, group_idx=0)]
    for streams in ([hybrid], [hybrid, unrelated]):
        pure, fast = ReferenceIndex(), CompiledIndex(seed=3)
        for seq, events in enumerate(streams):
            payload = payload_of(EventBatch(1.0, events), False)  # type: ignore[arg-type]
            pure.apply(SOURCES[seq], BatchDecoder().decode(payload), seq)
            fast.apply_payload(SOURCES[seq], payload, seq)
        differential.assert_same(pure, fast, [(tokens, {})])
        row = next(r for r in pure.lookup(tokens) if r.instance == "a")
        assert (row.matched_tokens, row.by_group) == (0, {0: 2, 1: 0}), streams


@pytest.mark.parametrize("window", [2**63 - 1, 2**63 - 2, -(2**63), 1, 5])
def test_extreme_sliding_windows_agree(window: int) -> None:
    """A window group's needed blocks, ceil((window - 1) / size), for any int64 window
    (the core's sum overflowed near 2^63: undefined behaviour, and another answer)."""
    tokens = prompt_of(0, 0)
    full = BlockStored([1, 2, 3, 4, 5], None, tokens, BS, group_idx=0)
    spec = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": window}
    windowed = BlockStored([11, 12, 13, 14, 15], None, tokens, BS, group_idx=1, **spec)
    removal = BlockRemoved([12], group_idx=1)  # a gap in the window group
    pure, fast = ReferenceIndex(), CompiledIndex(seed=4, local_hashes=True)
    for seq, events in enumerate([[full, windowed], [removal]]):
        payload = payload_of(EventBatch(1.0, events), False)  # type: ignore[arg-type]
        pure.apply(SOURCES[0], BatchDecoder().decode(payload), seq)
        fast.apply_payload(SOURCES[0], payload, seq)
    differential.assert_same(pure, fast, [(tokens, {})], [[1, 2, 3, 4, 5]])


def test_hashes_no_wire_can_say_are_held_by_nobody() -> None:
    """Asking about an int hash outside [-2^63, 2^64): no match, as the reference says
    (the core raised OverflowError)."""
    pure, fast = ReferenceIndex(), CompiledIndex(seed=8, local_hashes=True)
    for index in (pure, fast):
        index.apply(SOURCES[0], EventBatch(1.0, [BlockStored([1, 2], None, list(range(8)), BS)]))
    for hashes in ([2**70], [1, 2**64], [1, 2, -(2**63) - 1]):
        assert fast.lookup_hashes(hashes) == pure.lookup_hashes(hashes)
    assert fast.count(SOURCES[0], 0, "GPU", 2**80) == pure.count(SOURCES[0], 0, "GPU", 2**80) == 0


def test_names_of_16_mib_and_more_agree() -> None:
    """A medium or a salt of 16 MiB or more (a payload may be 64): the core refused to
    intern it (MemoryError for the medium, no place for the salt's chain)."""
    long = "x" * (17 << 20)
    event = BlockStored([1, 2], None, list(range(8)), BS, medium=long, cache_salt=long + "s")
    payload = payload_of(EventBatch(1.0, [event]), False)  # type: ignore[arg-type]
    pure, fast = ReferenceIndex(), CompiledIndex(seed=6, local_hashes=True)
    pure.apply(SOURCES[0], BatchDecoder().decode(payload), 1)
    fast.apply_payload(SOURCES[0], payload, 1)
    prompts = [(list(range(8)), {"cache_salt": long + "s"})]
    differential.assert_same(pure, fast, prompts, [[1, 2]], media=[None, long, "external"])


WRITER_DURING_LOOKUP = r"""
import sys, threading, time
from kvindex.index._core import Core
from kvindex.index.base import LookupRow

core = Core(1)
writers = {
    "clear": lambda: core.clear(0, True),
    "remove": lambda: core.remove(0),
    "apply_ops": lambda: core.apply_ops(0, [("C",)]),
    "keep_tokens": lambda: core.keep_tokens(True),
    "tier_of": lambda: core.tier_of("CPU"),
}
for name, write in writers.items():
    inside = threading.Event()

    def empty_rows(size, layout, key):
        inside.set()
        time.sleep(0.2)  # gives the GIL away while the lookup holds the read lock
        return []

    args = ([1, 2, 3, 4], None, None, [], empty_rows, LookupRow)
    reader = threading.Thread(target=core.lookup, args=args)
    reader.start()
    inside.wait()
    write()
    reader.join()
    print(name)
"""


def test_writers_wait_for_a_lookup_without_the_gil() -> None:
    """A lookup gives the GIL away while it holds the read lock (its Python callback);
    each writer waited for the write lock with the GIL held, so neither could go on: a
    deadlock of ingest (a restart, a slow batch) and the HTTP lookups. In a subprocess:
    the old behaviour hangs the interpreter."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", WRITER_DURING_LOOKUP], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["clear", "remove", "apply_ops", "keep_tokens", "tier_of"]


HOSTILE_COUNTS = r"""
import struct, sys
from kvindex.index.compiled import CompiledIndex
from kvindex.subscriber import SourceKey
from kvindex.wire import WireError

def removal(n, items):  # ["BlockRemoved", <array32 header claiming n hashes>, items...]
    return b"\x92\xacBlockRemoved\xdd" + struct.pack(">I", n) + b"\x01" * items

for events in (
    [removal(0x80000001, 200)],  # the scratch's capacity doubled to 0 forever: a hang
    [b"\x92\xacBlockRemoved\x91\x01", removal(0xFFFFFFFF, 300)],  # 1 + n wrapped: overflow
):
    payload = b"\x93\xcb" + struct.pack(">d", 1.0) + bytes([0x90 + len(events)])
    payload += b"".join(events) + b"\x00"
    try:
        CompiledIndex(seed=1).apply_payload(SourceKey("a"), payload, 1)
    except WireError:
        print("refused")
"""


def test_array_counts_from_the_wire_neither_hang_nor_overflow() -> None:
    """An array header claiming 2^31 or 2^32-1 items (in a payload of a few hundred
    bytes): the fast parser hung, or wrote past its scratch; now the batch goes to the
    decoder, which refuses it. In a subprocess: the old behaviour hangs the interpreter."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", HOSTILE_COUNTS], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["refused", "refused"]


def test_decoded_and_payload_paths_agree() -> None:
    """`apply` (a decoded batch, as a store's warm load feeds it) and `apply_payload` give
    the same state."""
    stream = build([("store", 0, 0, 0, 0, 3, ns, 0, 0, False) for ns in range(len(NAMESPACES))])
    a, b = CompiledIndex(seed=5), CompiledIndex(seed=5)
    for seq, (src, _, (batch, arrays)) in enumerate(stream):
        a.apply(src, batch, seq)
        b.apply_payload(src, payload_of(batch, arrays), seq)
    assert a.copies(SOURCES[0]) == b.copies(SOURCES[0])
    assert a.lookup(prompt_of(0, 0)) == b.lookup(prompt_of(0, 0))


def test_key_digest_is_seeded() -> None:
    from kvindex.index._core import Core

    one, two = Core(seed=1), Core(seed=2)
    data = msgspec.msgpack.encode([1, 2, 3])
    assert one.key_digest(data) == Core(seed=1).key_digest(data)
    assert one.key_digest(data) != two.key_digest(data)


@pytest.mark.parametrize(
    "medium",
    [
        "GPU",
        "gpu",
        "CPU",
        "CPU_PINNED",
        "cpu_pinned",
        "HOST",
        "DISK",
        "STORAGE",
        "LOCAL_DISK",
        "EXTERNAL",
        "external",
        "Mooncake",
        "",
        "x" * 40,
    ],
)
def test_tiers_agree(medium: str) -> None:
    from kvindex.index._core import Core
    from kvindex.wire.tiers import tier_of

    assert Core(seed=1).tier_of(medium) == tier_of(medium)


def test_the_core_is_built() -> None:
    """`make test` (and CI) run on the compiled core: an install that silently fell back to
    pure Python must not pass for one that built it."""
    import os

    from kvindex.index import COMPILED

    if os.environ.get("KVINDEX_PURE", "") not in ("", "0"):
        pytest.skip("KVINDEX_PURE is set: the reference is chosen on purpose")
    assert COMPILED, "kvindex.index._core was not built (see the install's warning)"


def build_env(**extra: str) -> dict[str, str]:
    """A build's environment: this one's, without a sanitizer runtime preloaded (make
    sanitize runs the tests so): a build runs the toolchain, not our C, and gcc, cc1 and ld
    would report their own leaks at exit and fail the build under test."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return {**env, **extra}


def test_a_failed_build_warns_and_installs_pure(tmp_path: Any) -> None:
    """No compiler at install time: one line on stderr, and the build still succeeds."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = build_env(CC="/bin/false", LDSHARED="/bin/false")
    proc = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(tmp_path / "lib"),
            "--build-temp",
            str(tmp_path / "tmp"),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "kvindex: WARNING" in line]
    assert len(warnings) == 1 and "pure-Python implementation will be used" in warnings[0]
    assert not list((tmp_path / "lib").rglob("*.so"))


def test_a_missing_optional_header_warns_once_and_builds_the_rest(tmp_path: Any) -> None:
    """No sqlite3.h (libsqlite3-dev absent): the snapshot loader alone is left out, said in
    one line, and the core is built."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    fake = tmp_path / "include"
    fake.mkdir()
    (fake / "sqlite3.h").write_text("#error this test hides sqlite3.h\n")
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=root, env=build_env(CPATH=str(fake)), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "kvindex: WARNING" in line]
    assert len(warnings) == 1 and "kvindex.store.sqlite._snapload was not built" in warnings[0]
    built = {path.name.split(".")[0] for path in (tmp_path / "lib").rglob("*.so")}
    assert built == {"_core", "_lookupd", "_recv"}


def test_many_indexes_live_at_once() -> None:
    """Every index works however many are alive (a per-index thread key ran out at 1024:
    a long test run, or a library user with many indexes, hit it)."""
    indexes = [CompiledIndex() for _ in range(1500)]
    payload = encode_batch([BlockStored([1, 2], None, list(range(2 * BS)), BS)])
    for index in indexes[::100] + indexes[-3:]:
        index.apply_payload(SourceKey("a"), payload)
        assert index.block_count("a") == 2


# -- hybrid groups with partial-block entries (vLLM 0.33's Mamba "align" mode) --------------

UNIT = 4  # the hash block size
GROUP_BLOCK = 4 * UNIT  # both groups' block size: four hashes a block
HYBRID_KINDS = [("mamba", None), ("sliding_window", 2 * UNIT), ("full_attention", None)]


def hybrid_tokens(p: int, variant: int) -> list[int]:
    """40 tokens: two blocks and a half of the groups' size."""
    return prompt_of(p, variant) + prompt_of((p + 1) % len(BASE), variant)


def unit_hash(tokens: list[int], u: int) -> int:
    """vLLM's hash at `(u + 1) * UNIT` tokens (a whole block's is its last unit's)."""
    return hash(("unit", tuple(tokens[: (u + 1) * UNIT]))) & (2**64 - 1)


hybrid_plan = st.tuples(
    st.sampled_from(["whole"] * 3 + ["partial"] * 3 + ["remove"] * 2 + ["clear"]),
    st.integers(0, 2),  # group (2: both, in one batch, as vLLM stores them)
    st.integers(0, len(BASE) - 1),
    st.integers(0, 2),  # prompt variant
    st.integers(0, 4),  # first block, or the partial's unit
    st.integers(1, 2),  # blocks
)


def hybrid_stream(
    plan: list[tuple[Any, ...]], kind: tuple[str, int | None], sizes: bool = False
) -> list[tuple[SourceKey, str, Any]]:
    """`sizes`: group 1's blocks are one unit (a window group beside 4-unit full-attention
    blocks, as vLLM's hybrid-sizes), its stores chains of units, some skipping units."""
    src = SourceKey("h")
    held: list[tuple[int, int]] = []
    out: list[tuple[SourceKey, str, Any]] = []
    for what, groups, p, variant, at, count in plan:
        tokens = hybrid_tokens(p, variant)
        events = []
        for group in (0, 1) if groups == 2 else (groups,):
            if sizes and group == 1 and what in ("whole", "partial"):
                event = unit_chain(what == "partial", tokens, at, count, kind, held)
            else:
                event = hybrid_event(what, group, tokens, at, count, kind, held)
            events.append(event)
            if isinstance(event, AllBlocksCleared):
                break
        out.append((src, "batch", (EventBatch(float(len(out)), events, None), False)))
    return out


def unit_chain(
    skip: bool,
    tokens: list[int],
    at: int,
    count: int,
    kind: tuple[str, int | None],
    held: list[tuple[int, int]],
) -> BlockStored:
    """Group 1's store of a chain of one-unit blocks; `skip`: only its last two units are
    cached (a window's `block_mask`), the tokens still cover them all."""
    total = len(tokens) // UNIT
    first = min(at * 3, total - 1)
    units = list(range(first, min(total, first + count * 3)))
    kept = units[-2:] if skip else units
    hashes = [unit_hash(tokens, u) for u in kept]
    parent = unit_hash(tokens, first - 1) if first else None
    chunk = tokens[first * UNIT : (units[-1] + 1) * UNIT]
    held.extend((h, 1) for h in hashes)
    return BlockStored(
        hashes,
        parent,
        chunk,
        UNIT,
        group_idx=1,
        kv_cache_spec_kind=kind[0],
        kv_cache_spec_sliding_window=kind[1],
    )


def hybrid_event(
    what: str,
    group: int,
    tokens: list[int],
    at: int,
    count: int,
    kind: tuple[str, int | None],
    held: list[tuple[int, int]],
) -> Any:
    spec = ("full_attention", None) if group == 0 else kind
    fields: dict[str, Any] = {
        "group_idx": group,
        "kv_cache_spec_kind": spec[0],
        "kv_cache_spec_sliding_window": spec[1],
    }
    k = GROUP_BLOCK // UNIT
    event: Any
    if what == "whole":
        blocks = len(tokens) // GROUP_BLOCK
        first = min(at, blocks - 1)
        last = min(blocks, first + count)
        hashes = [unit_hash(tokens, (j + 1) * k - 1) for j in range(first, last)]
        parent = unit_hash(tokens, first * k - 1) if first else None
        chunk = tokens[first * GROUP_BLOCK : last * GROUP_BLOCK]
        event = BlockStored(hashes, parent, chunk, GROUP_BLOCK, **fields)
        held.extend((h, group) for h in hashes)
    elif what == "partial":
        u = min(at * 2 + count, len(tokens) // UNIT - 1)
        if (u + 1) % k == 0:
            u -= 1  # a block's last unit is a whole block, never a partial entry
        h = unit_hash(tokens, u)
        parent = unit_hash(tokens, u - 1) if u else None
        chunk = tokens[u * UNIT : (u + 1) * UNIT]
        event = BlockStored([h], parent, chunk, UNIT, extra_keys=[None], **fields)
        held.append((h, group))
    elif what == "remove":
        h, g = held[(at * 5 + count) % len(held)] if held else (1, group)
        event = BlockRemoved([h], group_idx=g)
    else:
        held.clear()
        event = AllBlocksCleared()
    return event


HYBRID_PROMPTS = [
    (hybrid_tokens(p, variant)[:n], {})
    for p in range(len(BASE))
    for variant in range(3)
    for n in (UNIT * 3, GROUP_BLOCK + UNIT * 2 + 1, 40)
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hybrid_plan, max_size=40), st.sampled_from(HYBRID_KINDS), st.booleans())
def test_partial_block_entries_agree(
    plan: list[tuple[Any, ...]], kind: tuple[str, int | None], sizes: bool
) -> None:
    """Partial-block entries (one hash unit of a larger block, chained unit by unit),
    groups of smaller blocks placed in the larger blocks' tree (some skipping units), and
    the lookups over them: the same state and answers."""
    pure, fast = feed(hybrid_stream(plan, kind, sizes))
    differential.assert_same(pure, fast, HYBRID_PROMPTS)
    for src in list(pure.sources()):
        pure.drop_source(src)
        fast.drop_source(src)
    assert fast.tree_nodes() == pure.tree_nodes() == 0


def test_partial_hits_are_vllms() -> None:
    """A hand-checked case: block 0 whole in both groups, then block 1's first two units
    as partial entries; the prompt's 40 tokens hit at 24 tokens (vLLM 0.33's Mamba align:
    full attention takes the partial entry inside block 1, Mamba its rightmost hash)."""
    tokens = hybrid_tokens(0, 0)
    plan = [("whole", 2, 0, 0, 0, 1)]
    plan += [("partial", 2, 0, 0, 2, 0)]  # unit 4: block 1's first
    plan += [("partial", 2, 0, 0, 2, 1)]  # unit 5
    for index in feed(hybrid_stream(plan, HYBRID_KINDS[0])):
        (row,) = index.lookup(tokens)
        assert (row.matched_tokens, row.block_size, row.by_group) == (24, UNIT, {0: 6, 1: 6})


def _with_unknown_field(raw_value: bytes) -> bytes:
    """A batch of one BlockStored whose last field is unknown, its value `raw_value`."""
    event = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2, 3, 4]}
    event |= {"block_size": 4, "zz": 0}
    payload = msgspec.msgpack.encode([1.0, [event], 0])
    return payload.replace(b"\xa2zz\x00", b"\xa2zz" + raw_value)


@pytest.mark.parametrize(
    "raw_value",
    [
        b"\xdf\x80\x00\x00\x00",
        b"\xdf\xff\xff\xff\xff",
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\x00\x00\x00\x03",
    ],
)
def test_a_huge_map_or_array_count_is_refused_by_both(raw_value: bytes) -> None:
    """Issue 27 point 2: an unknown field's map of 2^31 entries or more was skipped as if
    whole (2 * n counted in 32 bits wrapped to 0): the compiled index applied the batch
    that the reference refuses as truncated. Both refuse it now (fuzz/corpus has it)."""
    payload = _with_unknown_field(raw_value)
    for index in (ReferenceIndex(), CompiledIndex()):
        with pytest.raises(WireError, match="truncated"):
            index.apply_payload(SourceKey("a"), payload)
        assert (index.entries(), index.sources()) == (0, [])
