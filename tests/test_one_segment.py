"""Each of serve's answers leaves in one TCP segment, whichever way it is answered (the C
lookup thread, the lookup fast path in uvicorn's protocol, the ASGI app), and the front's
sockets have TCP_NODELAY whatever made the listening socket.

An answer whose head and body go in two segments wakes its client twice, and a server
without TCP_NODELAY holds the second behind the client's delayed ACK (~40 ms on Linux:
the stall a plain uvicorn harness on a `socket.socket()` listener showed, asyncio setting
TCP_NODELAY only on sockets whose protocol number says TCP). The client here is an
ordinary one: keep-alive, no TCP_NODELAY, no TCP_QUICKACK. What it costs in time is
`bench/keepalive.py`'s; this file checks the behaviour: the segments that carried data to
the client, counted by the kernel (TCP_INFO's tcpi_data_segs_in).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from clitools import kvindex
from netutil import wait_until

from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

TOKENS = list(range(64))
DATA_SEGS_IN = 152  # struct tcp_info's tcpi_data_segs_in (u32; Linux 4.6 and later)


def data_segments_in(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int(struct.unpack_from("I", info, DATA_SEGS_IN)[0])


def http_request(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def exchange(sock: socket.socket, message: bytes) -> tuple[int, bytes]:
    """One request on a keep-alive connection; (status, the whole answer)."""
    sock.sendall(message)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, "closed"
        got += chunk
    head = got.split(b"\r\n\r\n", 1)[0]
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(got) < len(head) + 4 + length:
        chunk = sock.recv(65536)
        assert chunk, "closed"
        got += chunk
    return int(got.split(b" ", 2)[1]), got


def segments_per_answer(port: int, message: bytes, count: int = 5) -> list[int]:
    """Data segments the client received per answer, on one keep-alive connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        per = []
        for _ in range(count):
            before = data_segments_in(sock)
            status, answer = exchange(sock, message)
            assert status == 200, answer[:200]
            assert len(answer) < 60_000  # within one loopback segment
            per.append(data_segments_in(sock) - before)
        return per


@pytest.fixture(scope="module", params=["on", "off"], ids=["lookup-thread", "python-only"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    pub = Publisher("tcp://127.0.0.1:*")
    proc = kvindex(
        "serve", "--store", "memory", "--http", "127.0.0.1:0",
        "--lookup-thread", request.param, "--instance", f"a={pub.endpoint}",
    )  # fmt: skip
    try:
        found = urlsplit(proc.listening_url()).port or 0
        time.sleep(0.5)  # the SUB socket connects
        pub.publish([BlockStored([1, 2, 3, 4], None, TOKENS, 16)])
        lookup = http_request("POST", "/v1/lookup", json.dumps({"token_ids": TOKENS}).encode())

        def held() -> bool:
            with socket.create_connection(("127.0.0.1", found), timeout=10) as sock:
                return json.loads(exchange(sock, lookup)[1].split(b"\r\n\r\n", 1)[1])["best"] == "a"

        assert wait_until(held, 10)
        yield found
    finally:
        proc.interrupt()
        proc.finish()
        pub.close()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/stats", b""),  # the ASGI app's
        ("GET", "/healthz", b""),
        ("GET", "/v1/instances", b""),
        ("POST", "/v1/lookup", json.dumps({"token_ids": TOKENS}).encode()),  # thread / fast path
        ("POST", "/v1/lookup", json.dumps({"token_ids": TOKENS, "lora_name": 1}).encode()),  # 422
        ("POST", "/v1/lookup/hashes", b'{"block_hashes": ["1", "2"]}'),
    ],
)
def test_each_answer_is_one_segment(port: int, method: str, path: str, body: bytes) -> None:
    message = http_request(method, path, body)
    if b'"lora_name": 1' in body:  # refused by the route: an ASGI error answer
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            before = data_segments_in(sock)
            status, _ = exchange(sock, message)
            assert status == 422
            assert data_segments_in(sock) - before == 1
        return
    assert segments_per_answer(port, message) == [1] * 5


def test_the_front_sets_tcp_nodelay_on_any_listener() -> None:
    """The service's protocol on a listener made by `socket.socket()` (protocol number 0,
    where asyncio leaves Nagle on) and asyncio's own loop: its sockets have TCP_NODELAY."""
    import uvicorn

    from kvindex.security.limits import Limits, limited_protocol

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        raise AssertionError("no request is sent")

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    config = uvicorn.Config(app, http=limited_protocol(Limits()), loop="asyncio", lifespan="off")
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve([listener]),))
    thread.start()
    try:
        assert wait_until(lambda: server.started, 10)
        with socket.create_connection(listener.getsockname(), timeout=10):
            assert wait_until(lambda: len(server.server_state.connections) == 1, 10)
            (protocol,) = server.server_state.connections
            accepted = protocol.transport.get_extra_info("socket")
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        server.should_exit = True
        thread.join(15)
        loop.close()
        listener.close()
