"""`kvindex serve`'s lookups answered in uvicorn's protocol (service.fastpath.lookup_protocol),
over real sockets: the same answers as the FastAPI route, and every guard, limit, deadline
and HTTP/1.1 rule kept (anything the protocol does not take is the stack's, as before)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
from clitools import Proc, kvindex
from netutil import wait_until

from kvindex.index import COMPILED
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher

pytestmark = pytest.mark.timeout(60)

# Token lookups are read and answered in C (`parse_lookup_body`, `Fleet.lookup_json`) only
# with the compiled core: under KVINDEX_PURE=1 (or a build without a compiler) the protocol
# hands every one to the FastAPI route by design, and kvindex_lookup_compiled_requests
# stays 0. The tests that count what C answered need the core; the rest run on both.
needs_core = pytest.mark.skipif(
    not COMPILED,
    reason="counts token lookups answered in C (kvindex_lookup_compiled_requests): the "
    "compiled core's path; the pure reference hands them all to the route by design",
)

TOKEN = "a-token-of-sixteen-chars"
BS = 16
TOKENS = [(7 * i) % 997 for i in range(BS * 6)]


@dataclass
class Served:
    proc: Proc
    host: str
    port: int

    def connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    proc = kvindex(
        "serve", "--store", "memory", "--http", "127.0.0.1:0", "--token", TOKEN,
        "--request-timeout", "1", "--max-body-bytes", "200000",
        "--instance", f"a={pub.endpoint},replay={pub.replay_endpoint}",
        "--instance", "b=tcp://127.0.0.1:9,dp=2",
    )  # fmt: skip
    try:
        url = urlsplit(proc.listening_url(timeout=10))
        served = Served(proc, url.hostname or "127.0.0.1", url.port or 0)
        time.sleep(0.5)  # the SUB socket connects
        pub.publish([BlockStored(list(range(1, 7)), None, TOKENS, BS)])
        assert wait_until(lambda: lookup(served, {"token_ids": TOKENS})[1]["best"] == "a", 10)
        yield served
    finally:
        proc.interrupt()
        proc.finish()
        pub.close()


def request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\n"
    defaults = {"Host": "127.0.0.1", "Authorization": f"Bearer {TOKEN}"}
    for name, value in {**defaults, **(headers or {})}.items():
        if value:
            head += f"{name}: {value}\r\n"
    if "Transfer-Encoding" not in (headers or {}):
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def read_response(sock: socket.socket, pending: bytearray) -> tuple[int, dict[str, str], bytes]:
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        pending += chunk
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        rest += chunk
    pending[:] = rest[length:]
    return int(lines[0].split()[1]), headers, rest[:length]


def lookup(served: Served, body: Any, raw: bytes | None = None, **headers: str) -> tuple[int, Any]:
    with served.connect() as sock:
        data = raw if raw is not None else json.dumps(body).encode()
        sock.sendall(request("POST", "/v1/lookup", data, headers))
        status, _, answer = read_response(sock, bytearray())
        return status, json.loads(answer)


def the_route(tokens: list[int]) -> bytes:
    """The same lookup as a body the protocol leaves to FastAPI's route: the key spelled
    with a JSON escape (the route reads it as token_ids)."""
    return b'{"token\\u005fids": ' + json.dumps(tokens).encode() + b"}"


def compiled_lookups(served: Served) -> float:
    with served.connect() as sock:
        sock.sendall(request("GET", "/metrics"))
        text = read_response(sock, bytearray())[2].decode()
    line = next(s for s in text.splitlines() if s.startswith("kvindex_lookup_compiled_requests_"))
    return float(line.split()[-1])


@needs_core
@pytest.mark.parametrize("cut", [0, 1, 3, 6])
def test_the_protocol_answers_as_the_route_does(served: Served, cut: int) -> None:
    tokens = [*TOKENS[: cut * BS], 5, 5, 5]
    before = compiled_lookups(served)
    fast = lookup(served, {"token_ids": tokens})
    assert compiled_lookups(served) == before + 1
    route = lookup(served, None, raw=the_route(tokens))
    assert compiled_lookups(served) == before + 1  # the route's answer, for comparison
    assert fast == route
    assert fast[0] == 200
    rows = {row["name"]: row for row in fast[1]["instances"]}
    assert rows["a"]["matched_blocks"] == cut
    assert rows["b"]["ranks"] == [
        {"rank": 0, "matched_blocks": 0},
        {"rank": 1, "matched_blocks": 0},
    ]


def test_the_token_is_still_required(served: Served) -> None:
    status, answer = lookup(served, {"token_ids": TOKENS}, Authorization="")
    assert status == 401 and "error" in answer
    status, _ = lookup(served, {"token_ids": TOKENS}, Authorization="Bearer not-the-token-at-all")
    assert status == 401


@needs_core
def test_a_host_not_served_is_refused_as_the_stack_does(served: Served) -> None:
    """The Host allow-list (DNS rebinding) holds on the protocol's path too."""
    before = compiled_lookups(served)
    status, answer = lookup(served, {"token_ids": TOKENS}, Host="rebound.example:8080")
    assert status == 400 and "rebound.example" in answer["error"]
    assert lookup(served, {"token_ids": TOKENS}, Host="localhost:1")[0] == 200
    assert compiled_lookups(served) == before + 1


def test_limits_and_bad_bodies_are_the_stacks(served: Served) -> None:
    big = json.dumps({"token_ids": [1] * 120_000}).encode()  # over --max-body-bytes
    assert lookup(served, None, raw=big)[0] == 413
    status, answer = lookup(served, None, raw=b'{"token_ids": [1.5]}')
    assert status == 422 and "token_ids" in answer["error"]
    assert lookup(served, None, raw=b"{")[0] == 400


def test_a_body_in_many_pieces_and_past_uvicorns_read_buffer(served: Served) -> None:
    """A body over 64 KiB (uvicorn pauses reading past that for an ASGI cycle) sent in
    small pieces: answered, no stall."""
    tokens = TOKENS + [123456] * 20_000
    body = json.dumps({"token_ids": tokens}).encode()
    assert len(body) > 65536
    with served.connect() as sock:
        data = request("POST", "/v1/lookup", body)
        for i in range(0, len(data), 7000):
            sock.sendall(data[i : i + 7000])
            time.sleep(0.001)
        status, _, answer = read_response(sock, bytearray())
    assert status == 200
    assert {r["name"]: r["matched_blocks"] for r in json.loads(answer)["instances"]}["a"] == 6


def test_keep_alive_and_pipelining_keep_the_order(served: Served) -> None:
    """Several requests in one write, lookups and others mixed: answered in order, on one
    connection that stays open."""
    first = request("POST", "/v1/lookup", json.dumps({"token_ids": TOKENS[:BS]}).encode())
    other = request("GET", "/v1/instances")
    second = request("POST", "/v1/lookup", json.dumps({"token_ids": TOKENS}).encode())
    routed = request("POST", "/v1/lookup", the_route(TOKENS[: 2 * BS]))
    with served.connect() as sock:
        sock.sendall(first + other + second + routed + second)
        pending = bytearray()
        answers = [read_response(sock, pending) for _ in range(5)]
        sock.sendall(first)  # still open
        answers.append(read_response(sock, pending))
    assert [a[0] for a in answers] == [200] * 6
    assert "status" in json.loads(answers[1][2])["instances"][0]  # /v1/instances' rows
    del answers[1]
    matched = [
        {r["name"]: r["matched_blocks"] for r in json.loads(a[2])["instances"]}["a"]
        for a in answers
    ]
    assert matched == [1, 6, 2, 6, 1]


def test_connection_close_and_http_1_0(served: Served) -> None:
    body = json.dumps({"token_ids": TOKENS}).encode()
    with served.connect() as sock:
        sock.sendall(request("POST", "/v1/lookup", body, {"Connection": "close"}))
        status, headers, _ = read_response(sock, bytearray())
        assert status == 200 and headers.get("connection") == "close"
        assert sock.recv(1) == b""  # closed after the answer
    with served.connect() as sock:
        sock.sendall(request("POST", "/v1/lookup", body).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        status, _, answer = read_response(sock, bytearray())
        assert status == 200 and json.loads(answer)["best"] == "a"


def test_a_chunked_body_is_the_stacks(served: Served) -> None:
    body = json.dumps({"token_ids": TOKENS}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with served.connect() as sock:
        sock.sendall(request("POST", "/v1/lookup", chunked, {"Transfer-Encoding": "chunked"}))
        status, _, answer = read_response(sock, bytearray())
    assert status == 200 and json.loads(answer)["best"] == "a"


def test_a_body_that_never_ends_gets_408_and_a_close(served: Served) -> None:
    with served.connect() as sock:
        data = request("POST", "/v1/lookup", json.dumps({"token_ids": TOKENS}).encode())
        sock.sendall(data[:-10])  # the last bytes never come
        started = time.monotonic()
        status, headers, answer = read_response(sock, bytearray())
        assert status == 408 and "not received in 1" in json.loads(answer)["error"]
        assert headers.get("connection") == "close"
        assert sock.recv(1) == b""
        assert time.monotonic() - started < 5


def test_lookups_by_hash_are_answered_in_the_protocol_too(served: Served) -> None:
    """Block hashes 1..6 are instance a's chain: the protocol's answer counts them, and a
    refused token or Host, a bad hash or a body over the item limit is the stack's answer."""

    def by_hashes(body: bytes, **headers: str) -> tuple[int, Any]:
        with served.connect() as sock:
            sock.sendall(request("POST", "/v1/lookup/hashes", body, headers))
            status, _, answer = read_response(sock, bytearray())
            return status, json.loads(answer)

    status, answer = by_hashes(json.dumps({"block_hashes": ["1", "2", "3", "9"]}).encode())
    rows = {row["name"]: row for row in answer["instances"]}
    assert status == 200 and answer["best"] == "a" and rows["a"]["matched_blocks"] == 3
    assert by_hashes(b'{"block_hashes": ["1"]}', Authorization="")[0] == 401
    assert by_hashes(b'{"block_hashes": ["1"]}', Host="rebound.example")[0] == 400
    status, answer = by_hashes(b'{"block_hashes": ["zz"]}')
    assert status == 400 and "zz" in answer["error"]
    assert by_hashes(b'{"block_hashes": 1}')[0] == 422
