"""Issue 28, finding 5: limits before the token (kvindex.security.limits). A real serve
with a token on 127.0.0.1: a header flood, many headers, a slow head, a connection storm
and a stalled TLS handshake are each answered within their limit, before any 401, with
the server's memory bounded; the C lookup thread (it hands a head it can't finish to
Python's protocol) on and off."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from clitools import Proc, kvindex
from netutil import wait_until
from test_http_security import self_signed

pytestmark = pytest.mark.timeout(120)

TOKEN = "query-token-0123456789abcdef"
HEAD = b"GET /v1/instances HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def serve(*args: str) -> tuple[Proc, str, int]:
    proc = kvindex(
        "serve", "--store", "memory", "--http", "127.0.0.1:0", "--token", TOKEN,
        "--max-header-bytes", "16384", "--header-timeout", "1", *args,
    )  # fmt: skip
    url = proc.listening_url()
    return proc, url, int(url.rstrip("/").rsplit(":", 1)[1])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def answer(sock: socket.socket, timeout: float = 10) -> bytes:
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


@pytest.fixture(params=["on", "off"], ids=["lookup-thread", "python-only"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Proc, str, int]]:
    proc, url, port = serve("--lookup-thread", request.param, "--max-connections", "30")
    try:
        yield proc, url, port
    finally:
        proc.interrupt()
        assert proc.finish(15) == 0


def test_a_head_over_the_limit_is_431_before_the_token(server: tuple[Proc, str, int]) -> None:
    _, url, port = server
    for flood in (
        HEAD + b"X-Long: " + b"a" * 100_000 + b"\r\n\r\n",  # one long header line
        HEAD + b"".join(b"X-%d: v\r\n" % i for i in range(20_000)) + b"\r\n",  # many headers
    ):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            try:
                sock.sendall(flood)
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed as the limit was reached: the answer was written first
            got = answer(sock)
        assert got.startswith(b"HTTP/1.1 431"), got[:200]
        assert b"16384 bytes" in got
    # the server goes on; a head within the limit reaches the token check
    with httpx.Client(base_url=url, timeout=10) as c:
        big_but_fine = {"X-Fine": "b" * 8000}
        assert c.get("/v1/instances", headers=big_but_fine).status_code == 401
        r = c.get("/v1/instances", headers={**big_but_fine, "Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200


def test_one_connection_streaming_a_huge_header_leaves_memory_flat(
    server: tuple[Proc, str, int],
) -> None:
    proc, _, port = server
    before = rss_kib(proc.proc.pid)
    sent = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(HEAD + b"X-Stream: ")
        chunk = b"z" * 65536
        try:
            while sent < 100 * 1024 * 1024:  # 100 MB, if the server kept reading
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert sent < 16 * 1024 * 1024, f"the server read {sent} bytes of one header"
    grown = rss_kib(proc.proc.pid) - before
    assert grown < 20 * 1024, f"serve grew {grown} KiB"


def test_a_slow_head_is_408_and_an_idle_connection_closed(server: tuple[Proc, str, int]) -> None:
    _, _, port = server
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(HEAD)  # and never the rest
        got = answer(sock)
    took = time.monotonic() - start
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert took < 5, took  # 1 s (+ the lookup thread's 1 s before it hands over)
    with socket.create_connection(("127.0.0.1", port)) as idle:
        start = time.monotonic()
        assert answer(idle) == b""  # nothing sent: closed without an answer
        # (the lookup thread holds a connection that sent nothing for its keep-alive, 5 s)
        assert time.monotonic() - start < 7


def test_a_connection_storm_gets_503_past_the_cap(server: tuple[Proc, str, int]) -> None:
    proc, url, port = server
    before = rss_kib(proc.proc.pid)
    with ExitStack() as stack:
        socks = []
        for _ in range(60):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
            sock.sendall(HEAD)  # half a head: each holds its connection
            socks.append(sock)
        answers = [answer(sock, timeout=6) for sock in socks]
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(refused) >= 25 and len(refused) + len(timed_out) == 60, [a[:40] for a in answers]
    assert b"over 30 connections" in refused[0] and b"retry-after: 1" in refused[0]
    assert rss_kib(proc.proc.pid) - before < 20 * 1024
    with httpx.Client(base_url=url, timeout=10) as c:  # the storm over, it answers
        assert wait_until(lambda: c.get("/healthz").status_code == 200, timeout=10)


def test_a_stalled_tls_handshake_is_closed(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    proc, url, port = serve(
        "--tls-cert", str(cert), "--tls-key", str(key), "--tls-handshake-timeout", "1"
    )
    try:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"\x16\x03\x01")  # the start of a ClientHello, then nothing
            assert answer(raw, timeout=20) == b""
        took = time.monotonic() - start
        assert took < 5, took
        verify = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=url, verify=verify, timeout=10) as c:
            assert c.get("/healthz").status_code == 200
    finally:
        proc.interrupt()
        assert proc.finish(15) == 0
