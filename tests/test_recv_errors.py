"""The C receive (`kvindex.subscriber._recv.recv_live`) when libzmq says something else
than "no message now" (issue 27 point 6).

An EINTR (a signal arriving during the call) is retried, as pyzmq does; any other error
ends the call with the messages already taken off the socket, and is raised on the
socket's next call. Before, both dropped up to the whole call's messages and raised. The
errors are injected where libzmq's would come from (`fail_after`: the n-th receive from
now fails with that errno); the socket and messages are real.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator

import pytest
import zmq

_recv = pytest.importorskip("kvindex.subscriber._recv", reason="the C receive is not built")
if not _recv.available():
    pytest.skip("pyzmq's libzmq was not found", allow_module_level=True)


@pytest.fixture
def sub() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:  # type: ignore[type-arg]
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(10):  # until the subscription is through
            assert time.monotonic() < deadline
            pub.send_multipart([b"t", (0).to_bytes(8, "big"), b"hello"])
        while sub.poll(0):
            sub.recv_multipart()
        yield pub, sub
    finally:
        _recv.fail_after(0, 0)
        pub.close(0)
        sub.close(0)
        ctx.term()


def _send(pub: zmq.Socket, sub: zmq.Socket, seqs: range) -> None:  # type: ignore[type-arg]
    for seq in seqs:
        pub.send_multipart([b"t", seq.to_bytes(8, "big"), b"p%d" % seq])
    assert sub.poll(5000)
    time.sleep(0.2)  # every message queued on the SUB side


def test_eintr_is_retried_mid_message(sub: tuple[zmq.Socket, zmq.Socket]) -> None:  # type: ignore[type-arg]
    pub, s = sub
    _send(pub, s, range(1, 6))
    _recv.fail_after(2 * 3 + 2, errno.EINTR)  # 3 frames a message: message 3, its seq frame
    got = _recv.recv_live(s.underlying, 100)
    assert got == [(seq, b"p%d" % seq) for seq in range(1, 6)]


def test_an_error_after_some_messages_returns_them_then_raises(
    sub: tuple[zmq.Socket, zmq.Socket],  # type: ignore[type-arg]
) -> None:
    pub, s = sub
    _send(pub, s, range(1, 6))
    _recv.fail_after(2 * 3 + 1, errno.EFAULT)  # 3 frames a message: message 3, its first
    assert _recv.recv_live(s.underlying, 100) == [(1, b"p1"), (2, b"p2")]
    with pytest.raises(OSError) as raised:
        _recv.recv_live(s.underlying, 100)
    assert raised.value.errno == errno.EFAULT
    assert _recv.recv_live(s.underlying, 100) == [(seq, b"p%d" % seq) for seq in range(3, 6)]


def test_an_error_with_nothing_read_raises_at_once(
    sub: tuple[zmq.Socket, zmq.Socket],  # type: ignore[type-arg]
) -> None:
    pub, s = sub
    _send(pub, s, range(1, 3))
    _recv.fail_after(1, errno.EFAULT)
    with pytest.raises(OSError):
        _recv.recv_live(s.underlying, 100)
    assert _recv.recv_live(s.underlying, 100) == [(1, b"p1"), (2, b"p2")]
