"""`kvindex simulate`: a fleet of simulated vLLM (or SGLang) instances publishing real KV
events.

Each instance (and DP rank) is a vLLM-compatible publisher (PUB + replay ROUTER, the wire
format of the chosen vLLM generation) driven by a chat workload over a bounded block pool
(see `kvindex.sim`). The instance specs are printed first, ready for `kvindex serve`.
`--format sglang` makes them SGLang 0.5.23 engines: its event fields and media, page size
1 (its default) or `--page-size`, salted requests, a load stream per rank and a
`/server_info` to be found by (`NAME=sglang+http://HOST:PORT`).
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
DEFAULT_GPU_TOKENS = 2048 * 16  # a pool's size in tokens unless --gpu-blocks says otherwise


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
    p.add_argument(
        "--format",
        choices=("0.33", "0.23", "sglang"),
        default="0.33",
        help="wire format: vLLM 0.33 or 0.23, or SGLang 0.5.23 (found by sglang+http://)",
    )
    p.add_argument(
        "--page-size",
        type=positive_int,
        help="tokens per block (16; SGLang: 1, its default)",
    )
    p.add_argument("--hashes", choices=("int", "bytes"), help="block hash type (int)")
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
    p.add_argument(
        "--gpu-blocks",
        type=positive_int,
        help="blocks per GPU pool (32,768 tokens' worth: 2048 at page size 16)",
    )
    p.add_argument("--duration", metavar="S", type=positive_seconds, help="stop after S seconds")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="run simulated vLLM (or SGLang) instances that publish real KV-cache events",
        description="Simulated vLLM instances (PUB + replay ROUTER each, vLLM's wire format) "
        "driven by a multi-turn chat workload; prints their specs for `kvindex serve`. "
        "--format sglang: SGLang engines (load stream, /server_info for discovery).",
    )
    p.add_argument("--instances", type=positive_int, default=3, help="instances (3)")
    p.add_argument(
        "--base-port",
        type=_port,
        default=DEFAULT_BASE_PORT,
        help=f"first port ({DEFAULT_BASE_PORT}); instance i uses base + 2*dp*i + ... "
        "(SGLang: base + (3*dp+1)*i + ...); 0 = free",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--drop", type=_fraction, default=0.0, help="share of live sends lost (0)")
    sim_arguments(p, rate=20.0, restart=180.0, reset=120.0)
    p.set_defaults(run=run)


def build_config(args: argparse.Namespace, instances: int) -> SimConfig:
    from kvindex.sim import SimConfig

    def batches(seconds: float) -> int:
        return 0 if seconds == 0 else max(1, round(seconds * args.rate))

    sglang = args.format == "sglang"
    if sglang and args.hashes == "bytes":
        raise UsageError("--hashes bytes: SGLang publishes int hashes only")
    page_size = args.page_size or (1 if sglang else 16)
    if page_size > 1024:
        raise UsageError(f"--page-size {page_size}: at most 1024 tokens per block")
    gpu_blocks = args.gpu_blocks or max(8, DEFAULT_GPU_TOKENS // page_size)
    if gpu_blocks < 8:
        raise UsageError("--gpu-blocks must be at least 8")
    return SimConfig(
        instances=instances,
        dp=args.dp,
        format=args.format,
        hashes=args.hashes or "int",
        seed=args.seed,
        block_size=page_size,
        gpu_blocks=gpu_blocks,
        cpu_blocks=4 * gpu_blocks,
        disk_blocks=8 * gpu_blocks if sglang else 0,  # HiCache's storage under its host tier
        restart_every=batches(args.restart_every),
        reset_every=batches(args.reset_every),
        name_prefix="sglang" if sglang else "vllm",
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
    ranks = f" x {config.dp} DP ranks" if config.dp > 1 else ""
    if config.is_sglang:
        return (
            f"{config.instances} simulated SGLang instance(s){ranks}, SGLang 0.5.23 wire "
            f"format, page size {config.block_size}, {rate:g} batches/s"
        )
    return (
        f"{config.instances} simulated vLLM instance(s){ranks}, vLLM {config.format} wire "
        f"format, {config.hashes} hashes, {rate:g} batches/s"
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
