"""What an ordinary keep-alive client waits for an answer, by how the answer is written:

    python bench/keepalive.py [--requests N] [--rounds R]

Four servers of the same app (an empty fleet, kvindex's FastAPI app), each a child process
on a listener made by `socket.socket()` (protocol number 0: asyncio then leaves Nagle on)
and asyncio's loop, as a plain uvicorn harness has them, and a real `kvindex serve`:

- `uvicorn`: uvicorn's own httptools protocol: no TCP_NODELAY on these sockets, and an
  answer's head and body in two writes; the second waits for the client's delayed ACK.
- `two_writes`: the service's protocol (TCP_NODELAY set on every connection), with the
  ASGI answer's two writes kept apart (`LookupProtocol._one_write` a no-op): no stall,
  but two segments, the client woken twice.
- `service`: the service's protocol as it is: TCP_NODELAY, one write per answer.
- `serve`: `kvindex serve` (uvloop, the C lookup thread, which hands the GET to Python).

The client is http.client with keep-alive, N requests back to back per round (a GET
`/v1/stats` through the ASGI app, a plain `POST /v1/lookup` answered in the protocol or
the thread), the servers alternating round by round. Prints one JSON object: per server
and request, the median of the rounds' median and mean milliseconds per request, and the
data segments the client received per answer (TCP_INFO's tcpi_data_segs_in).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

LOOKUP = json.dumps({"token_ids": list(range(64))}).encode()
DATA_SEGS_IN = 152  # struct tcp_info's tcpi_data_segs_in


def _server(kind: str, port_out: Any) -> None:
    import asyncio

    import uvicorn

    from kvindex.runtime import Fleet
    from kvindex.security.http import HttpGuard
    from kvindex.service.app import create_app
    from kvindex.service.fastpath import lookup_protocol

    guard = HttpGuard()
    app = create_app(Fleet([]), guard=guard)
    protocol: Any = "httptools"
    if kind != "uvicorn":
        protocol = lookup_protocol(app.state.lookup_answerer, guard, 1 << 25)
    if kind == "two_writes":
        keep_apart = {"_one_write": lambda self: None}  # uvicorn's two writes
        protocol = type("TwoWrites", (protocol,), keep_apart)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port_out.put(sock.getsockname()[1])
    config = uvicorn.Config(app, http=protocol, loop="asyncio", log_level="warning")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


def _serve() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex", "serve", "--store", "memory", "--http", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            url = line.split("listening on ")[1].split()[0]
            return proc, int(url.rstrip("/").rsplit(":", 1)[1])
    raise SystemExit("serve did not start")


def _segments(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int(struct.unpack_from("I", info, DATA_SEGS_IN)[0])


def _round(port: int, request: str, n: int) -> tuple[float, float, float]:
    """(median ms, mean ms, data segments per answer) over n requests on one connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    method, path, body = ("GET", "/v1/stats", None)
    if request == "lookup":
        method, path, body = ("POST", "/v1/lookup", LOOKUP)
    headers = {"Content-Type": "application/json"} if body else {}
    conn.request("GET", "/healthz")  # connected, and the first answer out of the way
    conn.getresponse().read()
    assert conn.sock is not None
    before = _segments(conn.sock)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        times.append(time.perf_counter() - start)
        assert response.status == 200, response.status
    segments = (_segments(conn.sock) - before) / n
    conn.close()
    return statistics.median(times) * 1e3, statistics.fmean(times) * 1e3, segments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    servers: dict[str, Any] = {}
    procs: list[Any] = []
    try:
        for kind in ("uvicorn", "two_writes", "service"):
            ports: Any = ctx.Queue()
            proc = ctx.Process(target=_server, args=(kind, ports), daemon=True)
            proc.start()
            procs.append(proc)
            servers[kind] = ports.get(timeout=60)
        serve, servers["serve"] = _serve()
        procs.append(serve)
        time.sleep(0.5)
        rows: dict[str, dict[str, list[tuple[float, float, float]]]] = {
            kind: {"stats": [], "lookup": []} for kind in servers
        }
        for _ in range(args.rounds):
            for request in ("stats", "lookup"):
                for kind, port in servers.items():
                    rows[kind][request].append(_round(port, request, args.requests))
        out: dict[str, Any] = {"requests": args.requests, "rounds": args.rounds}
        for kind, by in rows.items():
            out[kind] = {
                request: {
                    "median_ms": round(statistics.median(r[0] for r in got), 3),
                    "mean_ms": round(statistics.median(r[1] for r in got), 3),
                    "segments_per_answer": round(statistics.median(r[2] for r in got), 2),
                }
                for request, got in by.items()
            }
        print(json.dumps(out, indent=1))
    finally:
        for proc in procs:
            if isinstance(proc, subprocess.Popen):
                proc.terminate()
                proc.wait(10)
            else:
                proc.kill()
                proc.join(5)
    os._exit(0)


if __name__ == "__main__":
    main()
