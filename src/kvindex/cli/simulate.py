"""`kvindex simulate`: a fleet of simulated vLLM instances publishing real KV events.

Each instance (and DP rank) is a vLLM-compatible publisher (PUB + replay ROUTER, the wire
format of the chosen vLLM generation) driven by a chat workload over a bounded block pool
(see `kvindex.sim`). The instance specs are printed first, ready for `kvindex serve`.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from kvindex.cli.common import UsageError, positive_float, positive_int, positive_seconds
from kvindex.cli.signals import stop_signals

if TYPE_CHECKING:
    from kvindex.sim import SimConfig, SimulatedPublishers

__all__ = ["add_parser", "build_config", "open_fleet", "run", "sim_arguments"]

DEFAULT_BASE_PORT = 5557


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 0 and below 1")
    return value


def _seconds_or_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 (never) or a positive number")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 picks free ones)")
    return int(text)


def sim_arguments(p: argparse.ArgumentParser, *, rate: float, restart: float, reset: float) -> None:
    """The workload flags `simulate` and `demo` share."""
    p.add_argument("--rate", type=positive_float, default=rate, help=f"batches/s ({rate:g})")
    p.add_argument("--format", choices=("0.33", "0.23"), default="0.33", help="vLLM wire format")
    p.add_argument("--hashes", choices=("int", "bytes"), default="int", help="block hash type")
    p.add_argument("--dp", type=positive_int, default=1, help="DP ranks per instance (1)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument(
        "--restart-every",
        metavar="S",
        type=_seconds_or_zero,
        default=restart,
        help=f"mean seconds between engine restarts, 0 = never ({restart:g})",
    )
    p.add_argument(
        "--reset-every",
        metavar="S",
        type=_seconds_or_zero,
        default=reset,
        help=f"mean seconds between prefix-cache resets, 0 = never ({reset:g})",
    )
    p.add_argument("--gpu-blocks", type=positive_int, default=2048, help="blocks per pool (2048)")
    p.add_argument("--duration", metavar="S", type=positive_seconds, help="stop after S seconds")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="run simulated vLLM instances that publish real KV-cache events",
        description="Simulated vLLM instances (PUB + replay ROUTER each, vLLM's wire format) "
        "driven by a multi-turn chat workload; prints their specs for `kvindex serve`.",
    )
    p.add_argument("--instances", type=positive_int, default=3, help="instances (3)")
    p.add_argument(
        "--base-port",
        type=_port,
        default=DEFAULT_BASE_PORT,
        help=f"first port ({DEFAULT_BASE_PORT}); instance i uses base + 2*dp*i + ...; 0 = free",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--drop", type=_fraction, default=0.0, help="share of live sends lost (0)")
    sim_arguments(p, rate=20.0, restart=180.0, reset=120.0)
    p.set_defaults(run=run)


def build_config(args: argparse.Namespace, instances: int) -> SimConfig:
    from kvindex.sim import SimConfig

    def batches(seconds: float) -> int:
        return 0 if seconds == 0 else max(1, round(seconds * args.rate))

    if args.gpu_blocks < 8:
        raise UsageError("--gpu-blocks must be at least 8")
    return SimConfig(
        instances=instances,
        dp=args.dp,
        format=args.format,
        hashes=args.hashes,
        seed=args.seed,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=4 * args.gpu_blocks,
        restart_every=batches(args.restart_every),
        reset_every=batches(args.reset_every),
    )


def open_fleet(
    args: argparse.Namespace, config: SimConfig, *, base_port: int | None, drop: float
) -> SimulatedPublishers:
    """Bind the publishers; a port that can't be had is a usage error."""
    import zmq

    from kvindex.sim import PortsBusy, SimulatedPublishers

    host = getattr(args, "host", "127.0.0.1")
    try:
        return SimulatedPublishers(
            config, rate=args.rate, host=host, base_port=base_port, drop=drop
        )
    except (PortsBusy, zmq.ZMQError) as exc:
        raise UsageError(f"can't open the publishers: {exc}") from None


def describe(config: SimConfig, rate: float) -> str:
    return (
        f"{config.instances} simulated vLLM instance(s)"
        + (f" x {config.dp} DP ranks" if config.dp > 1 else "")
        + f", vLLM {config.format} wire format, {config.hashes} hashes, {rate:g} batches/s"
    )


def run(args: argparse.Namespace) -> int:
    config = build_config(args, args.instances)
    live = open_fleet(args, config, base_port=args.base_port or None, drop=args.drop)
    specs = [spec.render() for spec in live.specs()]
    print(f"kvindex simulate: {describe(config, args.rate)}")
    for spec in specs:
        print(f"  {spec}")
    print("follow them with:")
    print("  kvindex serve " + " ".join(f"--instance {spec}" for spec in specs), flush=True)
    started = time.monotonic()
    try:
        with stop_signals("simulate") as stop:
            live.start()
            stop.wait(args.duration)
    finally:
        live.close()
    took = time.monotonic() - started
    sim = live.sim
    print(
        f"kvindex simulate: published {live.published} batches in {took:.1f} s "
        f"({sim.restarts} restart(s), {sim.resets} reset(s))",
        flush=True,
    )
    return 0
