"""Hostile wire input: every malformed frame or payload is counted per instance and
skipped; the subscriber and the service never crash or stall, and what is well-formed
around it is applied exactly."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from netutil import wait_until
from pubsub import joined
from service_workload import TestClient

from kvindex.index import FleetIndex
from kvindex.runtime import Fleet
from kvindex.service.app import create_app
from kvindex.subscriber import (
    DecodeFailed,
    Delivery,
    InstanceSpec,
    Item,
    Lost,
    Malformed,
    ReplayPolicy,
    ReplayRefused,
    SourceKey,
    Subscriber,
)
from kvindex.wire import BlockStored, EventBatch, WireError, decode_batch
from kvindex.wire.events import MAX_HASH_BYTES
from kvindex.wire.publisher import Publisher, encode_batch

pytestmark = pytest.mark.timeout(60)

FAST = ReplayPolicy(first_reply_timeout=0.4, idle_timeout=0.3, deadline=5.0, max_attempts=2)
enc = msgspec.msgpack.encode
TS = 1_700_000_000.0


def stored_map(**fields: Any) -> dict[str, Any]:
    event = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2, 3, 4]}
    event["block_size"] = 4
    event.update(fields)
    return event


def deep(depth: int) -> bytes:
    """A msgpack array nested `depth` deep (each level one byte: fixarray of 1)."""
    return b"\x91" * depth + b"\x01"


GOOD = {"type": "BlockRemoved", "block_hashes": [7]}
# (payload, decode errors it costs): whole-payload errors cost 1 and skip the batch; a bad
# event costs 1 and the rest of its batch is applied.
HOSTILE: list[tuple[str, bytes, int]] = [
    ("garbage", b"\xc1\xc1\xc1", 1),
    ("empty", b"", 1),
    ("truncated", encode_batch([BlockStored([1, 2], None, list(range(8)), 4)])[:-3], 1),
    ("not an array", enc({"ts": 1}), 1),
    # A broken clock is not a broken batch: its events apply (lag and age ignore it).
    ("ts nan", enc([math.nan, [GOOD]]), 0),
    ("ts inf", enc([-math.inf, [GOOD]]), 0),
    ("ts text", enc(["now", [GOOD]]), 1),
    ("nested batch", b"\x92\xcb" + enc(TS)[1:] + deep(100_000), 1),
    ("nested extra_keys", enc([TS, [GOOD]])[:-1] + b"", 0),  # placeholder, replaced below
    ("unknown type", enc([TS, [{"type": "BlockMoved", "x": 1}, GOOD]]), 0),
    ("wrong field types", enc([TS, [stored_map(block_size="4"), GOOD]]), 1),
    ("token text", enc([TS, [stored_map(token_ids=["a"]), GOOD]]), 1),
    ("hash float", enc([TS, [{"type": "BlockRemoved", "block_hashes": [1.5]}, GOOD]]), 1),
    ("hash text", enc([TS, [{"type": "BlockRemoved", "block_hashes": ["ab"]}, GOOD]]), 1),
    ("hash bool", enc([TS, [{"type": "BlockRemoved", "block_hashes": [True]}, GOOD]]), 1),
    ("hash empty", enc([TS, [{"type": "BlockRemoved", "block_hashes": [b""]}, GOOD]]), 1),
    ("hash huge", enc([TS, [{"type": "BlockRemoved", "block_hashes": [b"x" * 129]}, GOOD]]), 1),
    ("hash list", enc([TS, [{"type": "BlockRemoved", "block_hashes": [[1]]}, GOOD]]), 1),
    ("parent float", enc([TS, [stored_map(parent_block_hash=0.5), GOOD]]), 1),
    ("array event short", enc([TS, [["BlockStored"], GOOD]]), 1),
    ("event not a container", enc([TS, [5, GOOD]]), 1),
    (
        "string not utf-8",
        enc([TS, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "QQQ"}, GOOD]]).replace(
            b"\xa3QQQ", b"\xa3\xff\xfe\xfd"
        ),
        1,
    ),
]
HOSTILE[8] = (
    "nested extra_keys",
    b"\x92\xcb"
    + enc(TS)[1:]
    + b"\x92"
    + enc(stored_map())[:0]
    + b"\x83\xa4typ\x65\xabBlockStored\xacblock_hashes\x91\x01\xaaextra_keys"
    + deep(100_000)
    + enc(GOOD),
    1,
)


@pytest.mark.parametrize(("name", "payload", "errors"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_decoder_refuses_or_skips_without_raising_anything_else(
    name: str, payload: bytes, errors: int
) -> None:
    try:
        batch = decode_batch(payload)
    except WireError:
        assert errors == 1, name
        return
    assert batch.malformed_events == errors, (name, batch)
    assert any(getattr(e, "block_hashes", None) == [7] for e in batch.events), name


@pytest.mark.parametrize(
    "hashes",
    [[b"\x01"], [b"\xab\xcd\xef"], [b"\x00" * 33], [b"\xff" * MAX_HASH_BYTES], [2**64 - 1]],
)
def test_hashes_of_odd_widths_are_kept_as_they_came(hashes: list[int | bytes]) -> None:
    (event,) = decode_batch(enc([TS, [{"type": "BlockRemoved", "block_hashes": hashes}]])).events
    assert event.block_hashes == hashes  # type: ignore[union-attr]


def test_partial_tokens_still_cache_the_blocks() -> None:
    """Not malformed: a BlockStored whose tokens don't cover block_size x hashes (hash-only
    offload events, sliding-window groups) caches its blocks; only the prefix tree can't
    take them."""
    payload = enc([TS, [stored_map(block_hashes=[1, 2, 3], token_ids=[1, 2, 3, 4, 5])]])
    batch = decode_batch(payload)
    assert batch.malformed_events == 0
    index = FleetIndex()
    index.apply(SourceKey("a"), batch)
    assert index.block_hashes("a") == {1, 2, 3}
    assert index.lookup([1, 2, 3, 4, 5, 6, 7, 8])[0].matched_blocks == 0


def test_hostile_events_never_stop_the_rest_of_their_batch() -> None:
    """Events the decoder accepts but no sane engine sends: token ids past 64 bits, odd
    extra keys, a hash reused for other tokens. Each batch is applied whole."""
    index, a = FleetIndex(), SourceKey("a")
    batches = [
        [BlockStored([1], None, [2**64 - 1, 1, 2, 3], 4), BlockStored([2], None, [], 0)],
        [BlockStored([3], None, [1, 2, 3, 4], 4, lora_name="x", extra_keys=[5]), BlockStored([4])],
        [BlockStored([5], None, [1, 1, 1, 1], 4), BlockStored([5], None, [9, 9, 9, 9], 4)],
        [BlockStored([6], None, [1] * 8, -4), BlockStored([7], None, [1] * 8, 2**62)],
    ]
    for events in batches:
        index.apply(a, EventBatch(TS, list(events)))  # type: ignore[arg-type]
    assert index.block_hashes("a") == {1, 2, 3, 4, 5, 6, 7}
    assert index.lookup([1, 1, 1, 1])[0].matched_blocks == 0  # hash 5 now means 9 9 9 9
    assert index.lookup([9, 9, 9, 9])[0].matched_blocks == 1
    index.drop_source(a)
    assert index.tree_nodes() == 0 and index.entries() == 0


# -- on the wire, through the service --------------------------------------------------


def test_service_counts_and_skips_every_hostile_payload() -> None:
    with Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub:
        # The default replay policy: nothing here is about replay timing, and FAST's 0.4 s
        # for a first reply is short for a loaded CI machine (a check that times out
        # declares its range lost: fewer decode errors counted, for another reason).
        fleet = Fleet([InstanceSpec("a", pub.endpoint, pub.replay_endpoint)])
        with TestClient(create_app(fleet), raise_server_exceptions=False) as client:

            def instance() -> dict[str, Any]:
                return client.get("/v1/instances").json()["instances"][0]  # type: ignore[no-any-return]

            assert wait_until(lambda: instance()["status"] == "live")
            time.sleep(0.1)
            for _, payload, _ in HOSTILE:
                pub.publish_payload(payload)
            for frames in ([b""], [b"", b"\x00" * 8], [b"", b"\x00" * 9, b"x"], [b"", b"", b""]):
                pub.send_raw(frames)
            pub.send_raw([b"", b"\x00" * 8, b"x", b"extra"])
            pub.publish([BlockStored([99], None, [9, 9, 9, 9], 4)])
            last = pub.next_seq - 1
            assert wait_until(lambda: instance()["last_seq"] == last, 10)
            a = instance()
            counted = {k: a[k] for k in ("decode_errors", "lost_batches", "status")}
            expected = {"decode_errors": sum(e for _, _, e in HOSTILE), "lost_batches": 0}
            assert counted == {**expected, "status": "live"}, a  # the whole view, if not
            for path in ("/healthz", "/v1/stats", "/metrics", "/v1/instances/a/blocks"):
                assert client.get(path).status_code == 200, path
            assert fleet.ingest.errors == 0
            blocks = client.get("/v1/instances/a/blocks").json()["block_hashes"]
            assert "99" in blocks and "1" not in blocks  # only the hostile stores' hashes
            stats = fleet.subscriber.stats(SourceKey("a"))
            assert stats.malformed_messages == 5
            assert client.post("/v1/lookup", json={"token_ids": [9] * 4}).json()["best"] == "a"


# -- sizes -----------------------------------------------------------------------------


def collect(sub: Subscriber, until: Any, timeout: float = 10) -> list[Item]:
    items: list[Item] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(items):
        items += sub.poll(0.05)
    return items


def test_payload_over_the_decode_limit_is_skipped_and_counted() -> None:
    with (
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub,
        Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST, max_payload=1000) as sub,
    ):
        joined(pub, sub)
        pub.publish_payload(encode_batch([BlockStored([1], None, [1] * 2000, 4)]))  # ~2 KB
        pub.publish([BlockStored([1])])
        items = collect(sub, lambda it: any(isinstance(i, Delivery) for i in it))
        failed = [i for i in items if isinstance(i, DecodeFailed)]
        assert [f.seq for f in failed] == [0] and "exceeds" in failed[0].error
        assert [i.seq for i in items if isinstance(i, Delivery)] == [1]
        assert sub.stats(SourceKey("vllm")).decode_errors == 1


def test_message_over_zmq_maxmsgsize_drops_the_link_not_the_subscriber() -> None:
    """Past ZMQ_MAXMSGSIZE (the decode limit + 4 KiB), libzmq closes the connection
    instead of buffering the message: memory stays bounded. The subscriber reconnects,
    and the batch it can't receive (its replay is refused the same way) is reported lost;
    the batches after it are delivered."""
    with (
        Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", subscriptions=True) as pub,
        Subscriber(pub.endpoint, replay=pub.replay_endpoint, policy=FAST, max_payload=1000) as sub,
    ):
        joined(pub, sub)
        pub.publish([BlockStored([0])])
        pub.publish_payload(b"\x00" * 100_000)  # seq 1
        stop = threading.Event()

        def keep_publishing() -> None:
            while not stop.is_set():
                pub.publish([BlockStored([2])])
                time.sleep(0.05)

        feeder = threading.Thread(target=keep_publishing, daemon=True)
        feeder.start()
        try:
            items = collect(sub, lambda it: any(isinstance(i, Lost) for i in it), 20)
            items += collect(sub, lambda it: len([i for i in it if isinstance(i, Delivery)]) > 3)
        finally:
            stop.set()
            feeder.join()
        lost = [i for i in items if isinstance(i, Lost)]
        assert lost and lost[0].first == 1
        seqs = [i.seq for i in items if isinstance(i, Delivery)]
        assert seqs[0] == 0 and 1 not in seqs and len(seqs) > 3
        assert seqs == sorted(seqs)
        assert sub.status(SourceKey("vllm")) == "incomplete"


def test_malformed_replay_replies_are_counted_and_end_the_replay_at_once() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()

    def answer_badly() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            client = router.recv_multipart()[0]
            for frames in ([b"x"], [b"nonempty", b"\x00" * 8, b"p"], [b"", b"\x01", b"p"]):
                router.send_multipart([client, *frames])
            router.send_multipart([client, b"", b"\x00" * 8, b"\xc1"])  # bad payload, seq 0

    thread = threading.Thread(target=answer_badly, daemon=True)
    thread.start()
    try:
        with (
            Publisher("tcp://127.0.0.1:*", subscriptions=True) as pub,
            Subscriber(pub.endpoint, replay=replay, policy=FAST) as sub,
        ):
            items = joined(pub, sub)
            pub.drop = lambda seq: seq == 0  # a gap, if the late-join replay did not fill it
            pub.publish([BlockStored([1])])
            pub.publish([BlockStored([2])])
            items += collect(sub, lambda it: any(isinstance(i, Delivery) for i in it))
            items += collect(sub, lambda it: False, 0.5)
            # The first reply that is no reply ends the replay: counted, refused, and the
            # endpoint is left alone (the gap is lost at once, not after timeouts).
            assert len([i for i in items if isinstance(i, Malformed)]) == 1
            stats = sub.stats(SourceKey("vllm"))
            assert stats.malformed_messages == 1 and stats.replay_refusals == 1
            assert [i.reason for i in items if isinstance(i, ReplayRefused)] == [
                "a reply that is no replay reply (replay reply of 1 frames, expected 3 or 4)"
            ]
            assert [(i.first, i.last) for i in items if isinstance(i, Lost)] == [(0, 0)]
            assert [i.seq for i in items if isinstance(i, Delivery)] == [1]
            assert sub.status(SourceKey("vllm")) == "incomplete"
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)
