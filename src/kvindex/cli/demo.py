"""`kvindex demo` (= `make demo`): a simulated fleet, the service and its dashboard at once.

One process: the simulated vLLM instances publish from a background thread on loopback
ports, and the service follows them exactly as `kvindex serve` would (same `Fleet`, same
app), in the server's event loop. Beside them, a simulated SGLang engine (page size 1,
salted requests, host and disk tiers, a load stream) is found by its URL, as
`--instance NAME=sglang+http://...` finds a real one. Where dnsmasq is installed the vLLM
engines are not named but found, as a fleet's are (`--discover dns:...`): a real dnsmasq on
loopback serves one SRV record per engine, the last engine joining the answer after
JOIN_AFTER seconds (`/v1/instances` shows how each was found and when it came). The
dashboard's lookup box is
offered the prompts the simulation sent recently. Ctrl+C (or SIGTERM, or `--duration`)
stops everything: open dashboard streams end at once, then the server, the ingest and the
publishers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

from kvindex.cli.common import UsageError, positive_int, positive_seconds, run_async
from kvindex.cli.serve import DEFAULT_HTTP, listen, parse_http
from kvindex.cli.signals import Stop, stop_signals
from kvindex.cli.simulate import build_config, describe, open_fleet, sim_arguments

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from kvindex.cli.localdns import LocalDns
    from kvindex.sim import SimConfig, SimulatedPublishers

__all__ = ["add_parser", "run"]

DEMO_DROP = 0.01  # a few live messages lost on the wire, so gaps and replays show
JOIN_AFTER = 20.0  # seconds before the last vLLM engine joins the DNS answer


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="simulated vLLM fleet + kvindex serve + the live dashboard, in one command",
        description="Start simulated vLLM instances, follow them like `kvindex serve`, and "
        "serve the live dashboard; prints its URL. Ctrl+C stops everything.",
    )
    p.add_argument("--instances", type=positive_int, default=4, help="simulated instances (4)")
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        help=f"dashboard and API address (default {DEFAULT_HTTP}, or a free port if busy)",
    )
    p.add_argument(
        "--sglang",
        metavar="N",
        type=_count,
        default=1,
        help="simulated SGLang engines beside them, found by URL (1; 0: none)",
    )
    p.add_argument(
        "--join-after",
        metavar="S",
        type=positive_seconds,
        default=JOIN_AFTER,
        help=f"seconds before the last vLLM engine joins the DNS answer ({JOIN_AFTER:g})",
    )
    p.add_argument(
        "--no-discover",
        action="store_true",
        help="name the vLLM engines instead of finding them through a local dnsmasq",
    )
    sim_arguments(p, rate=40.0, restart=90.0, reset=60.0)
    p.add_argument(
        "--pause-after",
        metavar="S",
        type=positive_seconds,
        help="stop the simulated load after S seconds; the fleet stays up, idle, to explore",
    )
    p.set_defaults(run=run)


def _count(text: str) -> int:
    if not text.isdigit() or int(text) > 64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 0 to 64")
    return int(text)


def _sglang_fleet(args: argparse.Namespace, vllm: SimConfig) -> SimulatedPublishers | None:
    """The SGLang engines beside the vLLM ones (none when the fleet is SGLang already):
    page size 1 (SGLang's default), pools as large in tokens as the vLLM ones'."""
    from kvindex.sim import SimulatedPublishers

    if args.sglang == 0 or vllm.is_sglang:
        return None
    tokens = vllm.gpu_blocks * vllm.block_size
    flags = {**vars(args), "format": "sglang", "page_size": 1, "gpu_blocks": tokens}
    config = replace(build_config(argparse.Namespace(**flags), args.sglang), seed=vllm.seed + 1)
    rate = args.rate * args.sglang / (args.instances + args.sglang)
    return SimulatedPublishers(config, rate=rate, drop=DEMO_DROP)


def _listen(text: str | None) -> socket.socket:
    host, port = parse_http(text or DEFAULT_HTTP)
    try:
        return listen(host, port)
    except UsageError:
        if text is not None:
            raise
        return listen(host, 0)  # the default port is taken: any free one will do


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="kvindex demo: %(levelname)s %(message)s")
    sock = _listen(args.http)
    fleets: list[SimulatedPublishers] = []
    try:
        config = build_config(args, args.instances)
        fleets.append(open_fleet(args, config, base_port=None, drop=DEMO_DROP))
        extra = _sglang_fleet(args, config)
        if extra is not None:
            fleets.append(extra)
    except BaseException:
        for live in fleets:
            live.close()
        sock.close()
        raise
    dns = None
    try:
        for live in fleets:
            print(f"kvindex demo: {describe(live.config, live.rate)}", flush=True)
            for spec in live.specs():
                print(f"  {spec.render()}", flush=True)
        dns = None if args.no_discover else _local_dns(fleets[0], args.join_after)
        app = _app(fleets, sock.getsockname()[0], dns)
        for live in fleets:
            live.start()
        join = (args.join_after, partial(_join, dns, fleets[0])) if dns is not None else None
        with stop_signals("demo") as stop:
            pause = partial(_pause, fleets)
            run_async(_serve(app, sock, stop, args.duration, args.pause_after, pause, join))
    finally:
        for live in fleets:
            live.close()
        if dns is not None:
            dns.close()
    print("kvindex demo: stopped", flush=True)
    return 0


def _pause(fleets: list[SimulatedPublishers]) -> None:
    for live in fleets:
        live.stop()
    print("kvindex demo: simulated load paused; the fleet stays up, idle", flush=True)


def _ports(live: SimulatedPublishers) -> dict[str, int]:
    """Each simulated vLLM engine's KV-event port, by name."""
    return {spec.name: int(spec.endpoint.rpartition(":")[2]) for spec in live.specs()}


def _local_dns(live: SimulatedPublishers, join_after: float) -> LocalDns | None:
    """A dnsmasq naming the vLLM engines (all but the last, which joins later), or None
    where it can't: dnsmasq not installed, DP ranks (replay not on port + 1), SGLang."""
    from kvindex.cli.localdns import SRV_NAME, LocalDns, dnsmasq_binary

    binary = dnsmasq_binary()
    if binary is None or live.config.is_sglang or live.config.dp != 1:
        if binary is None:
            print("kvindex demo: dnsmasq is not installed: the engines are named, not found")
        return None
    ports = _ports(live)
    names = sorted(ports)
    dns = LocalDns(binary)
    try:
        dns.publish({name: ports[name] for name in names[:-1]} if len(names) > 1 else ports)
    except OSError as exc:
        dns.close()
        print(f"kvindex demo: {exc}: the engines are named, not found")
        return None
    later = f"; {names[-1]} joins the answer in {join_after:g} s" if len(names) > 1 else ""
    print(
        f"kvindex demo: the vLLM engines are found through DNS: --discover dns:{SRV_NAME} "
        f"(a dnsmasq on {dns.server}, one SRV record per engine){later}",
        flush=True,
    )
    return dns


def _join(dns: LocalDns, live: SimulatedPublishers) -> None:
    """The last engine joins the DNS answer (the fleet scaled up)."""
    dns.publish(_ports(live))
    print(f"kvindex demo: DNS now names {len(dns.engines)} vLLM engines", flush=True)


def _app(fleets: list[SimulatedPublishers], host: str, dns: LocalDns | None = None) -> FastAPI:
    from kvindex.runtime import Fleet
    from kvindex.runtime.finders import Reconciler
    from kvindex.runtime.finders.dnsfind import DnsFinder, parse_dns
    from kvindex.security.http import HttpGuard, default_allowed_hosts
    from kvindex.service.app import create_app

    found = fleets[0] if dns is not None else None
    fleet = Fleet([spec for live in fleets if live is not found for spec in live.specs()])
    finders = None
    if dns is not None:
        from kvindex.cli.localdns import SRV_NAME

        finders = Reconciler(fleet)
        server = ("127.0.0.1", dns.port)
        finder = DnsFinder(parse_dns(f"dns:{SRV_NAME}"), finders, interval=1.0, server=server)
        finders.finders.append(finder)
    # No token: at least a DNS-rebound name can't read it (see kvindex.security.http).
    guard = HttpGuard(allowed_hosts=tuple(default_allowed_hosts(host)))
    app = create_app(fleet, guard=guard, finders=finders)
    app.state.recent_prompts = partial(_recent_prompts, fleets)
    return app


def _recent_prompts(fleets: list[SimulatedPublishers], limit: int = 12) -> list[dict[str, Any]]:
    """Every simulated fleet's latest prompts, taken in turn (newest first in each)."""
    lists = [live.recent_prompts(limit) for live in fleets]
    mixed = [p for group in zip_longest(*lists) for p in group if p is not None]
    return mixed[:limit]


async def _serve(
    app: FastAPI,
    sock: socket.socket,
    stop: Stop,
    duration: float | None,
    pause_after: float | None,
    pause: Callable[[], None],
    join: tuple[float, Callable[[], None]] | None = None,
) -> None:
    import uvicorn

    loop = asyncio.get_running_loop()
    dashboard = app.state.dashboard
    config = uvicorn.Config(
        app, loop="asyncio", log_level="warning", access_log=False, timeout_graceful_shutdown=3
    )

    def end_streams() -> None:  # from a signal handler: let the loop do it
        loop.call_soon_threadsafe(dashboard.close)

    server = _server(config, stop, end_streams)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        print(f"kvindex demo: dashboard at {_url(sock)}  (Ctrl+C stops)", flush=True)
    if duration is not None:
        loop.call_later(duration, _stop, server, dashboard)
    if pause_after is not None:
        loop.call_later(pause_after, lambda: loop.run_in_executor(None, pause))
    if join is not None:
        after, joining = join
        loop.call_later(after, lambda: loop.run_in_executor(None, joining))
    await task


def _stop(server: uvicorn.Server, dashboard: Any) -> None:
    dashboard.close()
    server.should_exit = True


def _server(config: uvicorn.Config, stop: Stop, on_stop: Callable[[], None]) -> uvicorn.Server:
    from kvindex.cli.serve import make_server

    return make_server(config, stop, on_stop)
