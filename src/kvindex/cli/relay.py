"""`kvindex relay`: republish one local vLLM publisher over CURVE (see kvindex.relay)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from kvindex.cli.common import UsageError, positive_int, positive_seconds
from kvindex.cli.signals import Stop, stop_signals

if TYPE_CHECKING:
    from kvindex.relay import Relay

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "relay",
        help="republish a local vLLM publisher over CURVE (encrypted, authenticated)",
        description="Follow a vLLM publisher (bound to localhost) gap-free and republish it, "
        "seqs and payloads unchanged, on a CURVE PUB and replay ROUTER that only allowed "
        "client keys may use.",
    )
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="PUB[,replay=EP][,topic=T]",
        help="the vLLM publisher, e.g. tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558",
    )
    p.add_argument("--bind", required=True, metavar="EP", help="CURVE PUB, e.g. tcp://*:6557")
    p.add_argument("--replay-bind", metavar="EP", help="CURVE replay ROUTER, e.g. tcp://*:6558")
    p.add_argument("--server-key", required=True, metavar="FILE", help="relay's secret key")
    allow = p.add_mutually_exclusive_group(required=True)
    allow.add_argument(
        "--allow",
        nargs="+",
        action="extend",
        metavar="KEY",
        help="client public keys (Z85 text or key files) allowed in",
    )
    allow.add_argument(
        "--allow-any", action="store_true", help="let any CURVE client in (encryption only)"
    )
    p.add_argument(
        "--buffer-steps",
        type=positive_int,
        default=10_000,
        metavar="N",
        help="batches the relay keeps for its own replay endpoint (default: 10000)",
    )
    p.add_argument("--duration", type=positive_seconds, metavar="S", help="stop after S seconds")
    p.set_defaults(run=run)


def _build(args: argparse.Namespace) -> Relay:
    from kvindex.relay import Relay
    from kvindex.security.curve import (
        KeyFileError,
        check_private,
        read_public_key,
        read_secret_key,
    )
    from kvindex.subscriber import InstanceSpec, SpecError

    try:
        upstream = InstanceSpec.parse(f"upstream={args.source}")
        if upstream.dp != 1:
            raise SpecError("a relay follows one DP rank: run one relay per rank")
        check_private(args.server_key)
        _, secret = read_secret_key(args.server_key)
        allow = None if args.allow_any else [read_public_key(k) for k in args.allow]
    except (SpecError, KeyFileError) as exc:
        raise UsageError(str(exc)) from None
    return Relay(
        upstream,
        args.bind,
        replay_bind=args.replay_bind,
        server_secret=secret,
        allow=allow,
        buffer_steps=args.buffer_steps,
    )


def run(args: argparse.Namespace) -> int:
    import zmq

    try:
        relay = _build(args)
    except zmq.ZMQError as exc:
        raise UsageError(f"can't start the relay: {exc}") from None
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        with stop_signals("relay") as stop:
            _loop(relay, args.source, stop, deadline)
    except zmq.ZMQError as exc:
        raise UsageError(f"can't bind {args.bind}: {exc}") from None
    finally:
        relay.close()
    return 0


def _loop(relay: Relay, source: str, stop: Stop, deadline: float | None) -> None:
    from kvindex.subscriber import Delivery

    announced = False
    while not stop() and (deadline is None or time.monotonic() < deadline):
        for item in relay.step(0.1):
            if not isinstance(item, Delivery):
                print(f"kvindex relay: {item.describe()}", file=sys.stderr, flush=True)
        if relay.bound and not announced:
            announced = True
            replay = relay.replay_endpoint or "none"
            print(
                f"kvindex relay: serving {relay.endpoint} (replay {replay}) from {source}",
                flush=True,
            )
