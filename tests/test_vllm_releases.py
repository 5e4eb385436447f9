"""The wire format of real vLLM releases, checked against the shared KV-events facts.

Each release's own ``kv_events.py`` (fetched by ``vllm_releases``) builds and encodes
the batches, and for a few releases its real ``ZmqEventPublisher`` sends them over
loopback TCP to a plain SUB and answers a DEALER replay request.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import vllm_releases as vr
import zmq

pytestmark = pytest.mark.interop

END_SEQ = b"\xff" * 8
RECV_TIMEOUT_MS = 5_000
PUBLISHER_RELEASES = ["0.9.0", "0.25.0", "0.26.0", "0.33.0"]

# Fields in wire order, with the release that appended each (from the facts file).
STORED_FIELDS = [
    ("0.9.0", "block_hashes"),
    ("0.9.0", "parent_block_hash"),
    ("0.9.0", "token_ids"),
    ("0.9.0", "block_size"),
    ("0.9.0", "lora_id"),
    ("0.10.2", "medium"),
    ("0.14.0", "lora_name"),
    ("0.17.0", "extra_keys"),
    ("0.20.0", "group_idx"),
    ("0.22.0", "kv_cache_spec_kind"),
    ("0.22.0", "kv_cache_spec_sliding_window"),
    ("0.26.0", "locality"),
    ("0.29.0", "ownership"),
    ("0.30.0", "session_id"),
    ("0.33.0", "lookahead_token_ids"),
]
REMOVED_FIELDS = [
    ("0.9.0", "block_hashes"),
    ("0.10.2", "medium"),
    ("0.20.0", "group_idx"),
    ("0.26.0", "locality"),
    ("0.29.0", "ownership"),
]
# BlockStored array length, tag included, as the facts file states it.
STORED_ARRAY_LEN = {"0.9.0": 6, "0.10.2": 7, "0.14.0": 8, "0.17.0": 9, "0.20.0": 10, "0.22.0": 12}

# A value for every field any release knows; each release keeps the ones it has.
FULL_STORED: dict[str, Any] = {
    "block_hashes": [2**64 - 1, 17],
    "parent_block_hash": -(2**63),
    "token_ids": list(range(32)),
    "block_size": 16,
    "lora_id": 3,
    "medium": "GPU",
    "lora_name": "adapter-a",
    "extra_keys": [("adapter-a",), None],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 128,
    "locality": "LOCAL",
    "ownership": "tier-2",
    "session_id": "session-1",
    "lookahead_token_ids": [[32, 33], [34, 35]],
}
FULL_REMOVED: dict[str, Any] = {
    "block_hashes": [17],
    "medium": "GPU",
    "group_idx": 1,
    "locality": "LOCAL",
    "ownership": "tier-2",
}


def vt(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def fields_in(version: str, table: list[tuple[str, str]]) -> tuple[str, ...]:
    return tuple(name for since, name in table if vt(since) <= vt(version))


def stored_array_len(version: str) -> int:
    return max(n for since, n in STORED_ARRAY_LEN.items() if vt(since) <= vt(version))


def is_map_form(version: str) -> bool:
    return vt(version) >= (0, 24)


def load(version: str) -> types.ModuleType:
    try:
        return vr.load_release(version)
    except vr.ReleaseUnavailable as exc:
        pytest.skip(f"vllm {version} sources unavailable (PyPI unreachable, no cache): {exc}")


@pytest.fixture(params=vr.RELEASES, scope="module")
def mod(request: pytest.FixtureRequest) -> types.ModuleType:
    return load(request.param)


def untyped(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload)


def check_event(
    version: str, wire: Any, tag: str, names: tuple[str, ...], values: dict[str, Any]
) -> None:
    if is_map_form(version):
        assert isinstance(wire, dict)
        assert wire == {"type": tag, **{name: values[name] for name in names}}
    else:
        assert isinstance(wire, list)
        assert wire == [tag, *(values[name] for name in names)]


# ------------------------------------------------------------------ schema per release


def test_struct_fields_match_facts(mod: types.ModuleType) -> None:
    version = mod.VLLM_VERSION
    assert vr.field_names(mod.BlockStored) == fields_in(version, STORED_FIELDS)
    assert vr.field_names(mod.BlockRemoved) == fields_in(version, REMOVED_FIELDS)
    assert vr.field_names(mod.AllBlocksCleared) == ()
    dp = ("data_parallel_rank",) if vt(version) >= (0, 9, 1) else ()
    assert vr.field_names(mod.KVEventBatch) == ("ts", "events", *dp)


def test_full_batch_wire_layout(mod: types.ModuleType) -> None:
    version = mod.VLLM_VERSION
    stored = vr.make_stored(mod, **FULL_STORED)
    removed = vr.make_removed(mod, **FULL_REMOVED)
    dp_rank = 2 if vr.has_dp_rank(mod) else None
    batch = vr.make_batch(mod, 12.5, [stored, removed, vr.make_cleared(mod)], dp_rank)
    payload = vr.encode_batch(mod, batch)

    wire = untyped(payload)
    assert isinstance(wire, list)  # EventBatch is array_like in every release
    assert wire[0] == 12.5
    assert wire[2:] == ([2] if dp_rank is not None else [])
    wire_stored, wire_removed, wire_cleared = wire[1]
    stored_names = vr.field_names(mod.BlockStored)
    # msgpack has no tuples: extra_keys entries come back as lists.
    expected = {**FULL_STORED, "extra_keys": [["adapter-a"], None]}
    check_event(version, wire_stored, "BlockStored", stored_names, expected)
    check_event(
        version, wire_removed, "BlockRemoved", vr.field_names(mod.BlockRemoved), FULL_REMOVED
    )
    check_event(version, wire_cleared, "AllBlocksCleared", (), {})
    if not is_map_form(version):
        assert len(wire_stored) == stored_array_len(version)
    # The release's own typed decoder reads it back.
    assert msgspec.msgpack.decode(payload, type=mod.KVEventBatch) == batch


def test_minimal_events(mod: types.ModuleType) -> None:
    """Only required fields set: arrays keep every position (msgspec ignores
    omit_defaults for array_like), maps drop defaulted fields but keep required Nones."""
    version = mod.VLLM_VERSION
    stored = vr.make_stored(mod, block_hashes=[5], parent_block_hash=None, lora_id=None)
    wire = untyped(vr.encode_batch(mod, vr.make_batch(mod, 1.0, [stored])))[1][0]
    required = [f.name for f in msgspec.structs.fields(mod.BlockStored) if f.required]
    if is_map_form(version):
        assert set(wire) == {"type", *required}
        assert wire["parent_block_hash"] is None
        assert wire["lora_id"] is None
    else:
        assert len(wire) == stored_array_len(version)
        assert wire[2] is None  # parent_block_hash
        assert wire[len(required) + 1 :] == [None] * (len(wire) - len(required) - 1)


def test_batch_dp_rank(mod: types.ModuleType) -> None:
    if not vr.has_dp_rank(mod):
        with pytest.raises(ValueError):
            vr.make_batch(mod, 1.0, [], dp_rank=0)
        assert untyped(vr.encode_batch(mod, vr.make_batch(mod, 1.0, []))) == [1.0, []]
        return
    # A None rank is still sent positionally; the publisher replaces it by its own.
    assert untyped(vr.encode_batch(mod, vr.make_batch(mod, 1.0, []))) == [1.0, [], None]
    assert untyped(vr.encode_batch(mod, vr.make_batch(mod, 1.0, [], dp_rank=0))) == [1.0, [], 0]


def test_bytes_hashes(mod: types.ModuleType) -> None:
    digest = bytes(range(32))
    stored = vr.make_stored(mod, block_hashes=[digest], parent_block_hash=b"\x01" * 32)
    batch = vr.make_batch(mod, 1.0, [stored, vr.make_removed(mod, block_hashes=[digest])])
    payload = vr.encode_batch(mod, batch)
    if vt(mod.VLLM_VERSION) < (0, 10, 2):
        # list[int] hashes: the release's own decoder rejects bytes.
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(payload, type=mod.KVEventBatch)
        return
    decoded = msgspec.msgpack.decode(payload, type=mod.KVEventBatch)
    assert decoded.events[0].block_hashes == [digest]
    assert decoded.events[0].parent_block_hash == b"\x01" * 32
    assert decoded.events[1].block_hashes == [digest]
    wire_stored = untyped(payload)[1][0]
    hashes = wire_stored["block_hashes"] if is_map_form(mod.VLLM_VERSION) else wire_stored[1]
    assert hashes == [digest]  # msgpack bin, not str


# ------------------------------------------------------------------------ the helpers


def _stub_names() -> dict[str, Any]:
    return {
        name: module
        for name, module in sys.modules.items()
        if name.split(".")[0] in ("vllm", "pydantic")
    }


def test_releases_load_in_isolation() -> None:
    before = _stub_names()
    try:
        old = vr.load_release("0.9.0", reload=True)
        new = vr.load_release("0.33.0", reload=True)
    except vr.ReleaseUnavailable as exc:
        pytest.skip(str(exc))
    assert _stub_names() == before
    assert old.BlockStored is not new.BlockStored
    assert sorted(old.VLLM_IMPORTS) == ["vllm.config", "vllm.logger"]
    assert "vllm.utils.network_utils" in new.VLLM_IMPORTS
    # 0.33's real config module was loaded (with its own __post_init__).
    assert new.KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"


def test_cached_source_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        vr.fetch_source("0.9.0")
    except vr.ReleaseUnavailable as exc:
        pytest.skip(str(exc))

    def no_network(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("network used although the source is cached")

    monkeypatch.setattr(vr, "_http_get", no_network)
    assert (vr.fetch_source("0.9.0") / "kv_events.py").is_file()


def test_unreachable_index_raises_release_unavailable(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVINDEX_TEST_CACHE", str(tmp_path))
    monkeypatch.setattr(vr, "SIMPLE_INDEX_URL", "http://127.0.0.1:9/simple/vllm/")
    monkeypatch.setattr(vr, "_INDEX", {})
    for _ in range(2):  # the second call fails from the remembered error
        with pytest.raises(vr.ReleaseUnavailable, match="cannot fetch"):
            vr.fetch_source("0.9.0")
    assert not (tmp_path / "kv_events" / "0.9.0").exists()


# -------------------------------------------------------------------- real publishers


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def recv(sock: zmq.Socket[Any]) -> list[bytes]:
    if not sock.poll(RECV_TIMEOUT_MS):
        raise AssertionError("no message within the timeout")
    return sock.recv_multipart()


def publish_until_received(
    mod: types.ModuleType, pub: Any, sub: zmq.Socket[Any]
) -> tuple[int, bytes]:
    """Publish probes until the SUB sees one (the subscription takes a moment to
    reach the PUB); returns that first (seq, payload)."""
    deadline = time.monotonic() + RECV_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        pub.publish(vr.make_batch(mod, 0.5, [vr.make_cleared(mod)]))
        if sub.poll(50):
            _, seq, payload = sub.recv_multipart()
            return int.from_bytes(seq, "big"), payload
    raise AssertionError("the SUB socket never received a probe")


def request_replay(
    ctx: zmq.Context[Any], endpoint: str, start: int, frames: int
) -> list[tuple[int, bytes]]:
    """One replay request on a fresh DEALER; the (seq, payload) replies in order."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while True:
        reply = recv(dealer)
        assert len(reply) == frames, reply
        assert reply[0] == b""
        if reply[-2] == END_SEQ:
            assert reply[-1] == b""
            assert frames == 3 or reply[1] == b""  # the marker's topic is always empty
            dealer.close()
            return replies
        replies.append((int.from_bytes(reply[-2], "big"), reply[-1]))


@pytest.mark.parametrize("topic", ["", "kv-topic"])
@pytest.mark.parametrize("version", PUBLISHER_RELEASES)
def test_real_publisher_live_and_replay(
    version: str, topic: str, zmq_ctx: zmq.Context[Any]
) -> None:
    mod = load(version)
    pub_endpoint, replay_endpoint = vr.free_tcp_endpoint(), vr.free_tcp_endpoint()
    reply_frames = 4 if vt(version) >= (0, 26) else 3
    with vr.running_publisher(mod, pub_endpoint, replay_endpoint, 100, topic) as pub:
        sub = zmq_ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_endpoint)
        first, probe = publish_until_received(mod, pub, sub)

        sent = [
            vr.make_batch(mod, 1.0, [vr.make_stored(mod, **FULL_STORED)]),
            vr.make_batch(mod, 2.0, [vr.make_removed(mod, **FULL_REMOVED)]),
        ]
        for batch in sent:
            pub.publish(batch)
        live = {first: probe}  # seq -> payload, probes included
        while not live or untyped(live[max(live)])[0] != 2.0:
            frames = recv(sub)
            assert len(frames) == 3
            assert frames[0] == topic.encode()
            live[int.from_bytes(frames[1], "big")] = frames[2]
        seqs = sorted(live)
        assert seqs == list(range(first, first + len(seqs)))
        assert [untyped(live[s])[0] for s in seqs[-2:]] == [1.0, 2.0]
        # 0.9.1+: publish() stamps its rank (0) into batches that carry none.
        batch_len = 3 if vr.has_dp_rank(mod) else 2
        assert all(len(untyped(live[s])) == batch_len for s in seqs)
        assert all(untyped(live[s])[2:] in ([], [0]) for s in seqs)
        assert live[seqs[-2]] == vr.encode_batch(mod, sent[0])

        replayed = request_replay(zmq_ctx, replay_endpoint, 0, reply_frames)
        assert [s for s, _ in replayed] == list(range(seqs[-1] + 1))
        assert all(live[s] == payload for s, payload in replayed if s in live)

        tail = request_replay(zmq_ctx, replay_endpoint, seqs[-1], reply_frames)
        assert tail == [(seqs[-1], live[seqs[-1]])]
        sub.close()


def test_publisher_binds_loopback_not_wildcard(zmq_ctx: zmq.Context[Any]) -> None:
    mod = load("0.33.0")
    endpoint = vr.free_tcp_endpoint()
    with vr.running_publisher(mod, endpoint) as pub:
        assert pub._pub.getsockopt_string(zmq.LAST_ENDPOINT) == endpoint
