"""Where an empty GET's time goes in `kvindex serve`, layer by layer (issue 13 item 3).

    python scripts/http_floor.py [--seconds 5] [--loop asyncio|uvloop]

Each variant is an HTTP server in its own process, configured as `kvindex serve` configures
uvicorn (httptools, access log off): a bare ASGI callable; Starlette with one route;
FastAPI with one route; kvindex's app (`service.app.create_app`, no instances) without and
with its middlewares; `kvindex serve --store memory` itself; and Dynamo's standalone
indexer (`GET /health`) when `ai-dynamo-runtime` is installed. For each, one keep-alive
client sends GETs back to back for `--seconds` and reports the round trip's p50 and the
server process's CPU per request (user + system, from /proc: what the request costs the
server, the kernel's loopback work included). The difference between two lines is what
that layer adds. A second table calls each app in process (an ASGI call with a prepared
scope, no server, no socket): the framework's own share. Nothing here is asserted; on a
shared machine run it when the load is low (`uptime`), and twice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

BODY = b'{"status":"ok"}'


# -- the variants (run with --serve VARIANT PORT LOOP) -----------------------------------


Receive = Callable[..., Any]


async def _raw(scope: dict[str, Any], receive: Receive, send: Callable[..., Any]) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    headers = [(b"content-type", b"application/json"), (b"content-length", b"15")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


def _starlette() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def healthz(request: Request) -> Response:
        return Response(BODY, media_type="application/json")

    return Starlette(routes=[Route("/healthz", healthz)])


def _fastapi() -> Any:
    from fastapi import FastAPI
    from starlette.responses import Response

    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(BODY, media_type="application/json")

    return app


def _kvindex(middleware: bool) -> Any:
    from kvindex.runtime import Fleet
    from kvindex.service.app import create_app

    app = create_app(Fleet([]))
    if not middleware:
        app.user_middleware.clear()  # LookupPriority, RequestDeadline, BodyLimit
    return app


APPS: dict[str, Callable[[], Any]] = {
    "raw ASGI callable": lambda: _raw,
    "Starlette, one route": _starlette,
    "FastAPI, one route": _fastapi,
    "kvindex app, no middleware": lambda: _kvindex(False),
    "kvindex app": lambda: _kvindex(True),
}


def serve_variant(name: str, port: int, loop: str) -> None:
    import uvicorn

    config = uvicorn.Config(
        APPS[name](),
        host="127.0.0.1",
        port=port,
        loop=loop,
        http="httptools",
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run()


# -- measuring -----------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, path: str, pid: int, seconds: float) -> tuple[float, float, int]:
    """(p50 round trip, server CPU per request, requests) of back-to-back GETs."""
    from kvindex.bench.e2e.probes import Client

    client = Client(url)
    request = client.prepare("GET", path)
    for _ in range(200):  # warm up
        client.send(request)
    times: list[float] = []
    cpu0, end = _cpu_seconds(pid), time.monotonic() + seconds
    clock = time.perf_counter
    while time.monotonic() < end:
        start = clock()
        client.send(request)
        times.append(clock() - start)
    cpu = _cpu_seconds(pid) - cpu0
    client.close()
    return statistics.median(times), cpu / len(times), len(times)


def _started(args: list[str], url: str, path: str) -> subprocess.Popen[bytes]:
    from kvindex.bench.e2e.probes import Client

    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            client = Client(url, timeout=2)
            client.send(client.prepare("GET", path))
            client.close()
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit(f"{' '.join(args)} did not answer {path}") from None
            time.sleep(0.1)


def run(seconds: float, loop: str) -> None:
    from kvindex.bench.e2e.probes import free_port

    rows: list[tuple[str, str]] = [(name, "/healthz") for name in APPS]
    rows += [("kvindex serve --store memory", "/healthz")]
    try:
        import importlib.util

        if importlib.util.find_spec("dynamo.indexer") is not None:
            rows.append(("Dynamo standalone indexer", "/health"))
    except (ImportError, ValueError):
        pass
    print(f"GET, one keep-alive connection, {seconds:g} s each, loop {loop}")
    print(f"{'variant':34} {'p50 round trip':>15} {'server CPU/request':>19} {'requests':>9}")
    for name, path in rows:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if name == "kvindex serve --store memory":
            args = [sys.executable, "-m", "kvindex", "serve", "--store", "memory"]
            args += ["--http", f"127.0.0.1:{port}"]
        elif name.startswith("Dynamo"):
            args = [sys.executable, "-m", "dynamo.indexer", "--port", str(port)]
        else:
            args = [sys.executable, __file__, "--serve", name, str(port), loop]
        proc = _started(args, url, path)
        try:
            p50, cpu, count = measure(url, path, proc.pid, seconds)
        finally:
            proc.terminate()
            proc.wait(10)
        print(f"{name:34} {p50 * 1e6:12.0f} us {cpu * 1e6:16.1f} us {count:9,}")


def in_process(calls: int = 5_000) -> None:
    """Each app's own cost per GET: `calls` ASGI calls, best of 3 rounds."""
    import asyncio

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/healthz",
        "raw_path": b"/healthz",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    async def rounds(app: Any) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                await app(dict(scope), receive, send)
            best = min(best, (time.perf_counter() - start) / calls)
        return best

    print(f"\nthe same apps called in process ({calls:,} ASGI calls, best of 3)")
    for name, make in APPS.items():
        print(f"{name:34} {asyncio.run(rounds(make())) * 1e6:12.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument(
        "--serve", nargs=3, metavar=("VARIANT", "PORT", "LOOP"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve:
        name, port, loop = args.serve
        serve_variant(name, int(port), loop)
    else:
        run(args.seconds, args.loop)
        in_process()


if __name__ == "__main__":
    main()
