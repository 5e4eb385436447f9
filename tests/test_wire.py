"""Decoding every payload generation: positional arrays (<= 0.23) and maps (>= 0.24)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvindex.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BigramBlockStored,
    BlockRemoved,
    BlockStored,
    UnknownEvent,
    WireError,
    decode_batch,
    parse_hash,
    parse_live,
    parse_replay,
    render_hash,
)
from kvindex.wire.frames import END_SEQ, END_SEQ_BYTES
from kvindex.wire.publisher import encode_batch

enc = msgspec.msgpack.encode

STORED_FIELDS = [
    [1, 2],  # block_hashes
    None,  # parent_block_hash
    list(range(32)),  # token_ids
    16,  # block_size
    None,  # lora_id
    "GPU",  # medium (0.10.2)
    "adapter",  # lora_name (0.14)
    [["adapter"], None],  # extra_keys (0.17)
    1,  # group_idx (0.20)
    "full_attention",  # kv_cache_spec_kind (0.22)
    None,  # kv_cache_spec_sliding_window (0.22)
]


@pytest.mark.parametrize("length", [6, 7, 8, 9, 10, 12])
def test_positional_block_stored_of_every_length(length: int) -> None:
    event = ["BlockStored", *STORED_FIELDS[: length - 1]]
    assert len(event) == length
    batch = decode_batch(enc([1.5, [event], 2]))
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [1, 2]
    assert stored.token_ids == list(range(32))
    assert stored.block_size == 16
    assert stored.medium == ("GPU" if length >= 7 else None)
    assert stored.lora_name == ("adapter" if length >= 8 else None)
    assert stored.group_idx == (1 if length >= 10 else None)
    assert stored.kv_cache_spec_kind == ("full_attention" if length >= 12 else None)
    assert batch.data_parallel_rank == 2


def test_positional_array_longer_than_known_is_accepted() -> None:
    event = ["BlockStored", *STORED_FIELDS, "LOCAL", "owner", "session", [[1, 2]], "future"]
    (stored,) = decode_batch(enc([0.0, [event]])).events
    assert isinstance(stored, BlockStored)
    assert stored.locality == "LOCAL"
    assert stored.lookahead_token_ids == [[1, 2]]


def test_batch_without_dp_rank_090() -> None:
    batch = decode_batch(enc([2.0, [["BlockRemoved", [7]], ["AllBlocksCleared"]]]))
    assert batch.data_parallel_rank is None
    removed, cleared = batch.events
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [7]
    assert isinstance(cleared, AllBlocksCleared)


def test_map_events_with_absent_optional_fields_and_unknown_keys() -> None:
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [b"\x01" * 32],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 16,
            "medium": "CPU",
            "brand_new_field": [1, {"x": 2}],
        },
        {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 2},
        {"type": "AllBlocksCleared"},
    ]
    batch = decode_batch(enc([3.0, events, 0]))
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [b"\x01" * 32]
    assert stored.medium == "CPU" and stored.lora_name is None
    assert isinstance(removed, BlockRemoved) and removed.group_idx == 2
    assert isinstance(cleared, AllBlocksCleared)
    assert batch.malformed_events == 0


def test_signed_unsigned_and_bytes_hashes_stay_distinct() -> None:
    hashes = [-(2**63), -1, 0, 2**63, 2**64 - 1, b"\xff" * 8]
    (stored,) = decode_batch(enc([0.0, [["BlockStored", hashes, -5, [], 16, None]]])).events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == hashes
    assert stored.parent_block_hash == -5


def test_unknown_event_type_is_kept_and_counted_not_fatal() -> None:
    events = [{"type": "BlockMoved", "x": 1}, {"type": "BlockRemoved", "block_hashes": [1]}]
    batch = decode_batch(enc([0.0, events]))
    unknown, removed = batch.events
    assert isinstance(unknown, UnknownEvent) and unknown.type_name == "BlockMoved"
    assert isinstance(removed, BlockRemoved)
    assert batch.unknown_events == 1 and batch.malformed_events == 0


def test_malformed_event_is_skipped_and_counted() -> None:
    events = [
        ["BlockStored", "not-a-list", None, [], 16, None],
        ["BlockRemoved", [1.5]],  # a float is no hash
        ["BlockRemoved", [4]],
    ]
    batch = decode_batch(enc([0.0, events]))
    assert batch.malformed_events == 2
    assert [type(e) for e in batch.events] == [type(decode_batch(enc([0, [events[2]]])).events[0])]


def _sglang_stored(tokens: list, **fields: object) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": [-7, 9],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        **fields,
    }


def test_sglang_bigram_pages_decode_as_pairs_beside_ordinary_events() -> None:
    """SGLang's EAGLE bigram pages (token ids as pairs) are BlockStored events whose pairs
    are kept aside (`token_pairs`) and whose `token_ids` stay empty (held by hash); the
    ordinary events of the same batch decode as ever; nothing is malformed."""
    events = [
        _sglang_stored([[1, 2], [2, 3]], cache_salt="tenant-a", session_id="s1"),
        _sglang_stored([1, 2]),
        {"type": "BlockRemoved", "block_hashes": [-7], "medium": "GPU"},
    ]
    batch = decode_batch(enc([1.0, events, 1]))
    assert batch.malformed_events == 0 and batch.unknown_events == 0
    bigram, plain, removed = batch.events
    assert isinstance(bigram, BigramBlockStored) and isinstance(bigram, BlockStored)
    assert bigram.token_pairs == [(1, 2), (2, 3)] and bigram.token_ids == []
    assert bigram.block_hashes == [-7, 9] and bigram.block_size == 1
    assert (bigram.cache_salt, bigram.session_id, bigram.medium) == ("tenant-a", "s1", "GPU")
    assert type(plain) is BlockStored and plain.token_ids == [1, 2]
    assert isinstance(removed, BlockRemoved)


@pytest.mark.parametrize("tokens", [[[1, 2, 3]], [[1]], [[1, "x"]], [[1, 2], 3]])
def test_token_lists_that_are_neither_ids_nor_pairs_stay_malformed(tokens: list) -> None:
    batch = decode_batch(enc([1.0, [_sglang_stored(tokens)]]))
    assert batch.events == [] and batch.malformed_events == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        enc("text"),
        enc({"ts": 1}),
        enc([1.0]),
        enc(["x", []]),
        enc([1.0, "no"]),
        b"\x92\xcb\x00",
    ],
)
def test_garbage_payload_raises_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_payload_size_limit() -> None:
    decoder = BatchDecoder(max_payload=100)
    with pytest.raises(WireError, match="exceeds"):
        decoder.decode(enc([0.0, [["BlockRemoved", list(range(100))]]]))


def test_decoder_switches_generation_both_ways() -> None:
    decoder = BatchDecoder()
    arrays = enc([0.0, [["BlockRemoved", [1]]]])
    maps = enc([0.0, [{"type": "BlockRemoved", "block_hashes": [1]}]])
    for payload in (arrays, maps, maps, arrays, arrays):
        (event,) = decoder.decode(payload).events
        assert isinstance(event, BlockRemoved) and event.block_hashes == [1]


hash_values = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1), st.binary(min_size=1, max_size=32)
)
stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(hash_values, min_size=1, max_size=8),
    parent_block_hash=st.none() | hash_values,
    token_ids=st.lists(st.integers(0, 2**31), max_size=64),
    block_size=st.sampled_from([1, 16, 32]),
    medium=st.none() | st.sampled_from(["GPU", "CPU"]),
    lora_name=st.none() | st.text(max_size=8),
    group_idx=st.none() | st.integers(0, 3),
)
removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hash_values, min_size=1, max_size=8),
    medium=st.none() | st.sampled_from(["GPU", "CPU"]),
)
any_events = st.lists(
    st.one_of(stored_events, removed_events, st.just(AllBlocksCleared())), max_size=20
)


@given(any_events, st.sampled_from(["maps", "arrays"]), st.none() | st.integers(0, 7))
def test_roundtrip_any_batch(events: list, generation: str, dp: int | None) -> None:
    payload = encode_batch(events, ts=1.0, dp_rank=dp, generation=generation)  # type: ignore[arg-type]
    batch = BatchDecoder().decode(payload)
    assert batch.data_parallel_rank == dp
    assert [msgspec.structs.asdict(e) for e in batch.events] == [
        msgspec.structs.asdict(e) for e in events
    ]


@given(st.binary(max_size=200))
def test_decoder_never_raises_anything_but_wire_error(data: bytes) -> None:
    try:
        decode_batch(data)
    except WireError:
        pass


def test_live_frames() -> None:
    frame = parse_live([b"", (5).to_bytes(8, "big"), b"payload"])
    assert frame.seq == 5 and frame.payload == b"payload"
    with pytest.raises(WireError):
        parse_live([b"", b"\x00" * 4, b"x"])
    with pytest.raises(WireError):
        parse_live([b"only"])


def test_replay_frames_both_layouts_and_marker() -> None:
    seq = (9).to_bytes(8, "big")
    assert parse_replay([b"", seq, b"p"]).seq == 9  # vLLM <= 0.25
    assert parse_replay([b"", b"topic", seq, b"p"]).payload == b"p"  # vLLM >= 0.26
    assert parse_replay([b"", END_SEQ_BYTES, b""]).seq == END_SEQ
    assert parse_replay([b"", b"", END_SEQ_BYTES, b""]).seq == END_SEQ
    with pytest.raises(WireError):
        parse_replay([b"x", seq, b"p"])
    with pytest.raises(WireError):
        parse_replay([seq])


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (-(2**63), "-9223372036854775808"),
        (2**64 - 1, "18446744073709551615"),
        (b"\x00\xab", "00ab"),
    ],
)
def test_hash_rendering(value: int | bytes, text: str) -> None:
    assert render_hash(value) == text
    assert parse_hash(text) == value


def test_parse_hash_rejects_junk() -> None:
    for bad in ("", "xyz", "ABCD", "1.5", "-", "1234567890123456789012345"):
        with pytest.raises(ValueError):
            parse_hash(bad)
