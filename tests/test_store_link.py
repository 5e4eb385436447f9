"""The service's link to a store worker (kvindex.store.link), on real sockets: it never
blocks, keeps what the worker has not made durable within its bound, and past the bound
drops batches as one LostMark per publisher's run (the store then says it is incomplete
rather than hold a state with a hole in it)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvindex.store.link import PIPE_GROUPS, WorkerLink
from kvindex.store.protocol import (
    AppliedBatch,
    AppliedBatches,
    ControlRequest,
    LostMark,
    OutgoingGroup,
    PackedBatches,
    RestartMark,
    SaveInstance,
    WorkerReport,
    decode_frames,
    decode_group,
    group_frames,
    pack_payloads,
)

pytestmark = pytest.mark.timeout(60)


def test_a_worker_that_takes_nothing_never_blocks_and_memory_stays_bounded() -> None:
    link = WorkerLink("the test worker", max_bytes=1 << 20)
    link.open()  # no worker connected: every send finds no peer
    try:
        payload = b"x" * 1000
        started = time.monotonic()
        for seq in range(20_000):  # 20 MB of batches
            link.post(AppliedBatch("a", 0, seq, payload), len(payload))
        link.flush()
        assert time.monotonic() - started < 5  # never waited on the missing worker
        kept = link._kept_bytes
        assert kept <= (1 << 20) + 70 * 1024  # the bound, plus the group that crossed it
        assert link.dropped_batches > 15_000
        health = link.health("test://")
        assert not health.up and "batches are dropped" in (health.reason or "")
        # The worker catches up: room again, and the next batch comes after a LostMark
        # for the run that was dropped.
        last_kept = link._kept[-1].id
        link._take(WorkerReport(last_kept))
        link.post(AppliedBatch("a", 0, 20_000, payload), len(payload))
        link.flush()
        group = decode_frames(link._kept[-1].frames)
        first_dropped = 20_000 - link.dropped_batches
        assert group.messages == [
            LostMark("a", 0, first_dropped, 19_999),
            AppliedBatch("a", 0, 20_000, payload),
        ]
    finally:
        link.close(1)


def test_groups_go_to_a_worker_in_order_and_come_again_after_a_restart() -> None:
    link = WorkerLink("the test worker")
    base = link.open()
    ctx = zmq.Context.instance()
    worker = ctx.socket(zmq.PULL)
    worker.setsockopt(zmq.RCVHWM, PIPE_GROUPS)  # as a worker does
    worker.connect(f"{base}/in")
    try:
        time.sleep(0.2)  # connected
        # Payloads large enough that the two pipes' high-water marks, not the kernel's
        # socket buffer (which holds thousands of tiny messages), bound what is in flight.
        payload = bytes(64 << 10)
        for seq in range(4 * PIPE_GROUPS):
            link.post(AppliedBatch("a", 0, seq, payload), 1)
            link.flush()
        got = []
        while worker.poll(500):
            got.append(decode_frames(worker.recv_multipart()).id)
        sent = link._sent
        assert got == list(range(1, len(got) + 1)) and len(got) == sent  # in order
        assert sent < 4 * PIPE_GROUPS  # the rest wait in the link, not in ZMQ
        link._take(WorkerReport(10))  # durable up to group 10
        assert link._kept[0].id == 11
        link._sent = link._committed  # what a restart does: everything not durable again
        with link._lock:
            link._send_waiting()
        again = decode_frames(worker.recv_multipart())
        assert again.id == 11
    finally:
        worker.close(linger=0)
        link.close(1)


def test_batches_in_bulk_are_dropped_past_the_bound_as_one_lost_run() -> None:
    """The C path's batches come as one PackedBatches per publisher and read (their payloads
    packed by the C receive): past the bound all of its batches are counted dropped, and
    once there is room again the publisher's next batch comes after one LostMark covering
    every seq of the dropped messages; the worker reads it as an AppliedBatches."""
    link = WorkerLink("the test worker", max_bytes=1 << 20)
    link.open()
    try:
        payload = b"x" * 1000
        packed = pack_payloads([payload] * 100)
        for first in range(0, 20_000, 100):  # 20 MB of batches, 100 a message
            link.post(PackedBatches("a", 0, first, msgspec.Raw(packed), 100), len(packed))
        link.flush()
        assert link.dropped_batches % 100 == 0 and link.dropped_batches > 15_000
        link._take(WorkerReport(link._kept[-1].id))
        two = pack_payloads([payload, b"y"])
        link.post(PackedBatches("a", 0, 20_000, msgspec.Raw(two), 2), len(two))
        link.flush()
        group = decode_frames(link._kept[-1].frames)
        assert group.messages == [
            LostMark("a", 0, 20_000 - link.dropped_batches, 19_999),
            AppliedBatches("a", 0, 20_000, [payload, b"y"]),
        ]
    finally:
        link.close(1)


@pytest.mark.parametrize("messages", [1, 3, 17, 70_000])
def test_a_group_in_frames_is_the_group_encoded_whole(messages: int) -> None:
    """`group_frames` sends each PackedBatches's payloads as a frame of its own, the very
    buffer it was given (the C receive's, not copied), the rest encoded between them:
    joined, the frames are byte for byte what the group encodes to whole, so the worker
    reads exactly what it read before, whatever the messages and their number."""
    encode = msgspec.msgpack.Encoder().encode
    out: list = []
    buffers = []
    for i in range(messages):
        kind = i % 5
        if kind == 0:
            payloads = [bytes([i % 256]) * (i % 7), b"z" * 300]
            packed = memoryview(pack_payloads(payloads))
            buffers.append(packed)
            out.append(PackedBatches(f"e{i}", i % 3, 2**64 - 10 + i % 3, msgspec.Raw(packed), 2))
        elif kind == 1:
            out.append(AppliedBatch("a", 1, i, b"p" * (i % 11)))
        elif kind == 2:
            out.append(RestartMark("a", 0))
        elif kind == 3:
            out.append(LostMark("b", 2, i, i + 5))
        elif i < 100:
            out.append(SaveInstance(f"e{i}", "tcp://127.0.0.1:5557"))
        else:
            out.append(ControlRequest("sync", i))
    frames = group_frames(encode, 42, out)
    assert b"".join(frames) == encode(OutgoingGroup(42, out))
    assert len(frames) == 2 * len(buffers) + 1
    for frame, buffer in zip(frames[1::2], buffers, strict=True):
        assert isinstance(frame, memoryview)  # the buffer given, not a copy of it
        assert frame.tobytes() == buffer.tobytes()
    group = decode_frames(frames)
    assert group == decode_group(encode(OutgoingGroup(42, out)))
    first = group.messages[0]
    assert isinstance(first, AppliedBatches) and first.payloads == [b"", b"z" * 300]
