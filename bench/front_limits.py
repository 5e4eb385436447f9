"""What the limits before the token cost the HTTP front (kvindex.security.limits), against
the same protocol without them, in the same run:

    python bench/front_limits.py [--requests N] [--rounds R]

Two servers, each serve's own uvicorn protocol on the same app (an empty fleet, a token,
the fast path): `limited` is the service's `LookupProtocol` (on `LimitedProtocol`),
`bare` the same class with LimitedProtocol's three methods replaced by uvicorn's own (no
head counting, no head deadline, no connection cap). A client process sends N requests
over one keep-alive connection to one, then the other, alternating for R rounds, so both
see the same machine at the same time; what is measured is the server process's CPU time
(user + system, from /proc) per request. Two requests: a plain `POST /v1/lookup`
answered in the protocol (the fast path: the most sensitive to per-request overhead) and
`GET /v1/stats` through the ASGI stack. Prints one JSON object: per request kind, the
median microseconds of CPU per request of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
from typing import Any

TOKEN = "bench-token-0123456789abcdef"
LOOKUP = b'{"token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}'


def _server(kind: str, port_out: Any) -> None:
    import asyncio

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from kvindex.runtime import Fleet
    from kvindex.security.http import HttpGuard
    from kvindex.service.app import create_app
    from kvindex.service.fastpath import lookup_protocol

    guard = HttpGuard(token=TOKEN)
    app = create_app(Fleet([]), guard=guard)
    protocol = lookup_protocol(app.state.lookup_answerer, guard, 1 << 25)
    if kind == "bare":
        bare = {
            name: getattr(HttpToolsProtocol, name)
            for name in ("data_received", "connection_made", "connection_lost")
        }
        protocol = type("BareLookupProtocol", (protocol,), bare)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port_out.put(sock.getsockname()[1])
    config = uvicorn.Config(app, http=protocol, loop="asyncio", log_level="warning")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _request(kind: str) -> bytes:
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    if kind == "lookup":
        return (
            b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + auth
            + b"Content-Length: %d\r\n\r\n" % len(LOOKUP)
            + LOOKUP
        )
    return b"GET /v1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + b"\r\n"


def _send(port: int, kind: str, n: int) -> None:
    """N requests, one at a time, on one connection; each answer read whole."""
    request = _request(kind)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffered = b""
        for _ in range(n):
            sock.sendall(request)
            while b"\r\n\r\n" not in buffered:
                # An answer's head and body may come as two segments: acknowledged at once,
                # the second is not held back behind a delayed ACK (40 ms).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
                buffered += sock.recv(65536)
            head, _, buffered = buffered.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"unexpected answer: {head[:80]!r}")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(buffered) < length:
                buffered += sock.recv(65536)
            buffered = buffered[length:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    servers = {}
    for kind in ("limited", "bare"):
        ports: Any = ctx.Queue()
        proc = ctx.Process(target=_server, args=(kind, ports), daemon=True)
        proc.start()
        servers[kind] = (proc, ports.get(timeout=60))
    try:
        for _, port in servers.values():  # warm both up
            _send(port, "lookup", 500)
            _send(port, "stats", 200)
        results: dict[str, Any] = {}
        for request in ("lookup", "stats"):
            per: dict[str, list[float]] = {"limited": [], "bare": []}
            for _ in range(args.rounds):
                for kind, (proc, port) in servers.items():
                    before = _cpu(proc.pid)
                    _send(port, request, args.requests)
                    per[kind].append((_cpu(proc.pid) - before) / args.requests * 1e6)
            limited, bare = statistics.median(per["limited"]), statistics.median(per["bare"])
            results[request] = {
                "limited_us": round(limited, 2),
                "bare_us": round(bare, 2),
                "ratio": round(limited / bare, 3),
                "rounds_limited_us": [round(v, 2) for v in per["limited"]],
                "rounds_bare_us": [round(v, 2) for v in per["bare"]],
            }
        json.dump({"requests_per_round": args.requests, **results}, sys.stdout, indent=1)
        print()
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.join(10)


if __name__ == "__main__":
    main()
