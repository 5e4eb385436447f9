"""A publisher that can't be followed is said so, in one line, with the likely cause:
an unresolvable host, nothing listening, something that doesn't speak ZMQ, a CURVE
handshake refused either way. Once, then about once a minute; never a flood; and
`/v1/instances` shows the reason."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from clitools import kvindex
from netutil import free_port, wait_until
from service_workload import TestClient
from zmq.auth.thread import ThreadAuthenticator

from kvindex.runtime import Fleet
from kvindex.security.curve import generate_keys, read_secret_key, server_setup
from kvindex.service.app import create_app
from kvindex.subscriber import (
    Connection,
    InstanceSpec,
    Item,
    SourceKey,
    Subscriber,
    Unreachable,
)
from kvindex.subscriber.linkwatch import LinkWatch
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

E = zmq  # event names read better as E.EVENT_...
MISMATCH = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)


# -- the diagnosis, event by event ---------------------------------------------------------


def feed(link: LinkWatch, events: list[tuple[int, int]], now: float) -> list[str]:
    said = [link.on_event(event, value, now) for event, value in events]
    return [s for s in said if s]


def test_no_attempt_ever_starting_is_an_unresolvable_host() -> None:
    link = LinkWatch("tcp://kv.example.invalid:5557", curve=False, since=0.0)
    assert feed(link, [(E.EVENT_CONNECT_RETRIED, 100)] * 5, 1.0) == []
    assert link.on_tick(2.9) is None  # within the grace
    said = link.on_tick(3.0)
    assert said is not None and "can't resolve 'kv.example.invalid'" in said
    assert link.problem == said


def test_attempts_that_fail_are_nothing_listening_and_repeat_once_a_minute() -> None:
    link = LinkWatch("tcp://127.0.0.1:1", curve=False, since=0.0)
    refused = [(E.EVENT_CONNECT_DELAYED, 115), (E.EVENT_CONNECT_RETRIED, 100)]
    feed(link, refused * 20, 1.0)
    said = [t for t in (link.on_tick(x / 10) for x in range(0, 1300)) if t]  # 130 s
    assert len(said) == 3  # at 3 s, 63 s and 123 s
    assert all("nothing accepts connections there" in s for s in said)


def test_tcp_without_a_handshake_is_not_a_zmq_port() -> None:
    link = LinkWatch("tcp://127.0.0.1:8000", curve=False, since=0.0)
    feed(link, [(E.EVENT_CONNECT_DELAYED, 0), (E.EVENT_CONNECTED, 9), (E.EVENT_DISCONNECTED, 9)], 1)
    said = link.on_tick(3.5)
    assert said is not None and "does not speak ZMQ" in said


@pytest.mark.parametrize(
    ("curve", "event", "value", "words"),
    [
        (False, E.EVENT_HANDSHAKE_FAILED_PROTOCOL, MISMATCH, "requires CURVE"),
        (True, E.EVENT_HANDSHAKE_FAILED_PROTOCOL, MISMATCH, "does not use CURVE"),
        (True, E.EVENT_HANDSHAKE_FAILED_AUTH, 400, "refused our CURVE client key"),
    ],
)
def test_a_failed_handshake_is_said_at_once_and_not_again_each_retry(
    curve: bool, event: int, value: int, words: str
) -> None:
    link = LinkWatch("tcp://127.0.0.1:6557", curve=curve, since=0.0)
    attempt = [(E.EVENT_CONNECTED, 9), (event, value), (E.EVENT_DISCONNECTED, 9)]
    said = feed(link, attempt, 0.1) + feed(link, attempt * 50, 1.0)
    assert len(said) == 1 and words in said[0]
    assert link.on_tick(30.0) is None  # not before a minute
    assert link.on_tick(61.0) == said[0]


def test_a_handshake_failing_without_detail_waits_for_the_grace() -> None:
    """ZMQ may report a failure without detail before the specific one of the same
    attempt: the specific one wins; alone, it is said when the grace is over."""
    link = LinkWatch("tcp://127.0.0.1:6557", curve=True, since=0.0)
    attempt = [(E.EVENT_CONNECTED, 9), (E.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32)]
    assert feed(link, attempt * 10, 1.0) == []
    said = link.on_tick(3.0)
    assert said is not None and "the server's public key" in said
    plain = LinkWatch("tcp://127.0.0.1:6557", curve=False, since=0.0)
    first = [
        (E.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32),
        (E.EVENT_HANDSHAKE_FAILED_PROTOCOL, MISMATCH),
    ]
    said_now = feed(plain, [*first, (E.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32)], 0.5)
    assert len(said_now) == 1 and "requires CURVE" in said_now[0]
    assert plain.on_tick(61.0) == said_now[0]


def test_a_handshake_cut_every_time_is_said_as_the_likely_mismatch() -> None:
    """Where the side that finds the mechanisms differ resets the connection before the
    other read its greeting, every attempt ends in a cut (EPIPE, no detail): a plain
    subscriber at a CURVE relay is told it likely requires CURVE, a CURVE subscriber both
    of its likely faults; a mismatch ZMQ names later is not said again as news."""
    cut = [(E.EVENT_CONNECTED, 9), (E.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32)]
    plain = LinkWatch("tcp://127.0.0.1:6557", curve=False, since=0.0)
    assert feed(plain, cut * 20, 1.0) == []
    said = plain.on_tick(3.0)
    assert said is not None and "requires CURVE" in said and "curve=KEY" in said
    mismatch = [(E.EVENT_HANDSHAKE_FAILED_PROTOCOL, MISMATCH)]
    assert feed(plain, mismatch, 5.0) == []  # foretold: no second line
    assert plain.problem is not None and "the publisher requires CURVE" in plain.problem
    assert plain.on_tick(63.0) == plain.problem  # the exact words, at the usual pace
    curve = LinkWatch("tcp://127.0.0.1:6557", curve=True, since=0.0)
    assert feed(curve, cut * 20, 1.0) == []
    said = curve.on_tick(3.0)
    assert said is not None and "the server's public key" in said
    assert "does not use CURVE" in said
    reset = LinkWatch("tcp://127.0.0.1:6557", curve=False, since=0.0)
    feed(reset, [(E.EVENT_CONNECTED, 9), (E.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 104)], 1.0)
    said = reset.on_tick(3.0)
    assert said is not None and "requires CURVE" in said  # ECONNRESET: a cut too
    other = LinkWatch("tcp://127.0.0.1:6557", curve=False, since=0.0)
    feed(other, [(E.EVENT_CONNECTED, 9), (E.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 5)], 1.0)
    assert other.on_tick(3.0) == "ZMTP handshake failed (error 5)"  # not a cut: no guess
    assert feed(other, mismatch, 5.0) != []  # nothing foretold it: news


def test_a_link_that_comes_up_clears_the_problem_and_a_drop_starts_the_grace_again() -> None:
    link = LinkWatch("tcp://127.0.0.1:5557", curve=False, since=0.0)
    feed(link, [(E.EVENT_CONNECT_DELAYED, 0), (E.EVENT_CONNECT_RETRIED, 100)], 0.5)
    assert link.on_tick(3.0) is not None
    feed(link, [(E.EVENT_CONNECTED, 9), (E.EVENT_HANDSHAKE_SUCCEEDED, 0)], 4.0)
    assert link.problem is None and link.next_deadline is None
    feed(link, [(E.EVENT_DISCONNECTED, 9)], 10.0)
    assert link.next_deadline == 13.0
    assert link.on_tick(12.0) is None
    assert link.on_tick(13.0) is not None


# -- real sockets --------------------------------------------------------------------------


def follow(spec: InstanceSpec, seconds: float) -> tuple[list[Item], Subscriber]:
    sub = Subscriber(instances=[spec])
    items: list[Item] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        items.extend(sub.poll(0.05))
    return items, sub


def problems(items: list[Item]) -> list[Unreachable]:
    return [i for i in items if isinstance(i, Unreachable)]


@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        ("tcp://kvindex-test.invalid:5557", "can't resolve 'kvindex-test.invalid'"),
        (f"tcp://127.0.0.1:{free_port()}", "nothing accepts connections there"),
    ],
)
def test_subscriber_says_why_it_cannot_follow(endpoint: str, words: str) -> None:
    items, sub = follow(InstanceSpec("v", endpoint), 4.0)
    with sub:
        said = problems(items)
        assert len(said) == 1 and words in said[0].reason, said
        assert said[0].endpoint == endpoint and said[0].seconds >= 3
        assert sub.stats(SourceKey("v")).problem == said[0].reason


def test_something_else_on_the_port_is_named() -> None:
    with socket.socket() as http:  # accepts, then answers no ZMTP greeting
        http.bind(("127.0.0.1", 0))
        http.listen(16)
        spec = InstanceSpec("v", f"tcp://127.0.0.1:{http.getsockname()[1]}")
        items, sub = follow(spec, 4.0)
        sub.close()
    said = problems(items)
    assert len(said) == 1 and "does not speak ZMQ" in said[0].reason, said


class _Allow:
    def __init__(self, key: str) -> None:
        self.key = key.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class CurvePublisher:
    """A Publisher behind CURVE + ZAP, as `kvindex relay` serves: one client key allowed."""

    def __init__(self, tmp: Path) -> None:
        self.server = generate_keys(tmp, "server")
        self.client = generate_keys(tmp, "client")
        self.stranger = generate_keys(tmp, "stranger")
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback("kvindex", _Allow(self.client.public_key))
        secret = read_secret_key(self.server.secret)[1]
        self.pub = Publisher(
            "tcp://127.0.0.1:*", None, context=self.ctx, setup=server_setup(secret)
        )

    def spec(self, curve: bool = True, client: Path | None = None) -> InstanceSpec:
        text = f"r={self.pub.endpoint}"
        if curve:
            text += f",curve={self.server.public_key},client_key={client or self.client.secret}"
        return InstanceSpec.parse(text)

    def close(self) -> None:
        self.pub.close()
        self.auth.stop()
        self.ctx.destroy(linger=0)


@pytest.fixture
def curve_pub(tmp_path: Path) -> Iterator[CurvePublisher]:
    p = CurvePublisher(tmp_path)
    try:
        yield p
    finally:
        p.close()


def test_a_plain_subscriber_at_a_curve_publisher_is_told_once_without_a_flood(
    curve_pub: CurvePublisher,
) -> None:
    items, sub = follow(curve_pub.spec(curve=False), 4.0)  # past the grace (a cut's time)
    sub.close()
    said = problems(items)
    assert len(said) == 1 and "requires CURVE" in said[0].reason, said
    assert not [i for i in items if isinstance(i, Connection)]  # no connected/disconnected


def test_a_key_not_on_the_allow_list_is_told_once(curve_pub: CurvePublisher) -> None:
    items, sub = follow(curve_pub.spec(client=curve_pub.stranger.secret), 2.0)
    sub.close()
    said = problems(items)
    assert len(said) == 1 and "refused our CURVE client key" in said[0].reason, said


def test_the_allowed_key_connects_without_a_word(curve_pub: CurvePublisher) -> None:
    items, sub = follow(curve_pub.spec(), 1.0)
    sub.close()
    assert problems(items) == []
    assert [i.connected for i in items if isinstance(i, Connection)] == [True]


def test_a_curve_subscriber_at_a_plain_publisher_is_told_once() -> None:
    with Publisher("tcp://127.0.0.1:*", None) as pub:
        server = zmq.curve_keypair()[0].decode()
        items, sub = follow(InstanceSpec.parse(f"r={pub.endpoint},curve={server}"), 4.0)
        sub.close()
    said = problems(items)
    assert len(said) == 1 and "does not use CURVE" in said[0].reason, said


def test_watch_at_a_curve_publisher_without_curve_says_so_in_one_line(
    curve_pub: CurvePublisher,
) -> None:
    proc = kvindex("watch", curve_pub.pub.endpoint, "--json", "--duration", "5")
    assert proc.finish(20) == 0
    notices = [line for line in proc.err if not line.startswith("summary:")]
    assert len(notices) == 1 and "requires CURVE" in notices[0], proc.err


# -- the service -----------------------------------------------------------------------------


def test_instances_show_the_reason_and_serve_logs_it() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with TestClient(create_app(Fleet([InstanceSpec("gone", endpoint)]))) as client:

        def problem() -> object:
            return client.get("/v1/instances").json()["instances"][0]["problem"]

        assert problem() is None  # not diagnosed yet: within the grace
        assert wait_until(lambda: problem() is not None, timeout=10)
        text = problem()
        assert isinstance(text, str) and "nothing accepts connections there" in text
        body = client.get("/v1/instances").json()["instances"][0]
        assert body["status"] == "connecting" and body["ranks"][0]["problem"] == text

    port = free_port()
    proc = kvindex(
        "serve", "--store", "memory", "--http", f"127.0.0.1:{port}",
        "--instance", f"gone={endpoint}",
    )  # fmt: skip
    try:
        line = proc.wait_for(proc.err, lambda x: "can't follow" in x, timeout=15)
        assert line.startswith("kvindex serve: WARNING gone: can't follow " + endpoint), line
    finally:
        proc.interrupt()
        assert proc.finish() == 0
