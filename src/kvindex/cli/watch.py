"""`kvindex watch`: follow one vLLM publisher and print every batch, once, in order.

Human mode prints one line per batch (and the notices between them) with `rich`; `--json`
prints one JSON object per event on stdout and keeps everything else (notices, the final
summary) on stderr, so stdout can be piped to `jq` or a file as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
from rich.console import Console
from rich.text import Text

from kvindex.cli.common import UsageError, positive_int, positive_seconds, silence_stdout
from kvindex.cli.render import batch_line, delivery_records
from kvindex.cli.signals import Stop, stop_signals
from kvindex.subscriber import (
    Connection,
    DecodeFailed,
    Delivery,
    Gap,
    InstanceSpec,
    Lost,
    Malformed,
    Notice,
    Replayed,
    Restarted,
    SpecError,
    Subscriber,
    Unreachable,
    Unverified,
)
from kvindex.wire.events import KNOWN_TYPES

__all__ = ["add_parser", "run"]

# The longest the loop blocks in one poll: bounds how late `--duration` is noticed.
_POLL_SECONDS = 0.25

_NOTICE_STYLES: dict[type[Notice], str] = {
    Gap: "bold yellow",
    Replayed: "bold cyan",
    Restarted: "bold red",
    Lost: "bold red",
    Unverified: "bold magenta",
    DecodeFailed: "red",
    Malformed: "red",
    Connection: "dim",
    Unreachable: "bold yellow",
}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "watch",
        help="follow one publisher and print its events",
        description="Follow one vLLM KV-event publisher and print every batch once, in order "
        "(gaps are filled from the replay endpoint).",
    )
    p.add_argument("endpoint", metavar="ENDPOINT", help="PUB endpoint, e.g. tcp://10.0.0.5:5557")
    p.add_argument("--replay", metavar="ENDPOINT", help="replay (ROUTER) endpoint")
    p.add_argument("--topic", default="", help="topic to subscribe to (default: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per event on stdout")
    p.add_argument("--dp", type=positive_int, default=1, metavar="N", help="DP ranks (ports +0..)")
    p.add_argument("--name", default="vllm", help="instance name in the output (default: vllm)")
    p.add_argument("--curve", metavar="KEY", help="CURVE server public key (or key file)")
    p.add_argument("--client-key", metavar="FILE", help="CURVE client secret key file")
    p.add_argument("--max-batches", type=positive_int, metavar="N", help="stop after N batches")
    p.add_argument("--duration", type=positive_seconds, metavar="S", help="stop after S seconds")
    p.set_defaults(run=run)


@dataclass(slots=True)
class Tally:
    """What was shown: the summary's own counts (the subscriber's stats give the rest)."""

    started: float = field(default_factory=time.monotonic)
    batches: int = 0
    replayed: int = 0
    events: Counter[str] = field(default_factory=Counter)

    def add(self, delivery: Delivery) -> None:
        self.batches += 1
        self.replayed += delivery.replayed
        self.events.update(event.type_name for event in delivery.batch.events)


class Output(Protocol):
    def delivery(self, delivery: Delivery) -> None: ...
    def notice(self, notice: Notice) -> None: ...
    def summary(self, text: str) -> None: ...


def _notice_text(notice: Notice) -> Text:
    style = _NOTICE_STYLES.get(type(notice), "bold")
    return Text(f"▶ {notice.source!r}: {notice.describe()}", style=style)


class HumanOutput:
    """Everything on stdout, readable, in the order it happened."""

    def __init__(self) -> None:
        # soft_wrap: a long batch stays one line (the terminal wraps it, rich doesn't cut it).
        self.console = Console(soft_wrap=True, highlight=False)

    def delivery(self, delivery: Delivery) -> None:
        self.console.print(batch_line(delivery))

    def notice(self, notice: Notice) -> None:
        self.console.print(_notice_text(notice))

    def summary(self, text: str) -> None:
        self.console.print(Text(text, style="bold"))


class JsonOutput:
    """Events as JSON lines on stdout; anything else on stderr."""

    def __init__(self) -> None:
        self.stdout = sys.stdout.buffer
        self.stderr = Console(stderr=True, soft_wrap=True, highlight=False)
        self.encoder = msgspec.json.Encoder()
        self.buffer = bytearray()

    def delivery(self, delivery: Delivery) -> None:
        buf = self.buffer
        buf.clear()
        for record in delivery_records(delivery):
            self.encoder.encode_into(record, buf, -1)
            buf.extend(b"\n")
        if buf:
            self.stdout.write(buf)
            self.stdout.flush()  # per batch, so a pipe sees each batch as it arrives

    def notice(self, notice: Notice) -> None:
        self.stderr.print(_notice_text(notice))

    def summary(self, text: str) -> None:
        self.stderr.print(text)


def _summary(sub: Subscriber, tally: Tally) -> str:
    stats = [sub.stats(source) for source in sub.sources()]
    gaps = sum(s.gaps for s in stats)
    lost = sum(s.lost_batches for s in stats)
    restarts = sum(s.publisher_restarts for s in stats)
    errors = sum(s.decode_errors for s in stats)
    malformed = sum(s.malformed_messages for s in stats)
    # The three known types always appear (zeros included), then any unknown tag seen.
    names = sorted(KNOWN_TYPES, reverse=True) + sorted(set(tally.events) - KNOWN_TYPES)
    events = ", ".join(f"{name} {tally.events[name]}" for name in names)
    text = (
        f"summary: {tally.batches} batches in {time.monotonic() - tally.started:.1f} s; "
        f"events: {events}; gaps {gaps}, replayed {tally.replayed}, lost {lost}, "
        f"restarts {restarts}, decode errors {errors}"
    )
    return text + (f", malformed messages {malformed}" if malformed else "")


def _follow(
    sub: Subscriber, out: Output, tally: Tally, args: argparse.Namespace, stop: Stop
) -> None:
    """Show what the subscriber yields until --max-batches, --duration or a stop signal."""
    deadline = None if args.duration is None else tally.started + args.duration
    while not stop():
        timeout = _POLL_SECONDS
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout <= 0:
                return
        for item in sub.poll(timeout):
            if isinstance(item, Delivery):
                out.delivery(item)
                tally.add(item)
                if args.max_batches is not None and tally.batches >= args.max_batches:
                    return
            else:
                out.notice(item)


def _with_curve(spec: InstanceSpec, curve: str | None, client_key: str | None) -> InstanceSpec:
    options = "" if curve is None else f",curve={curve}"
    options += "" if client_key is None else f",client_key={client_key}"
    parsed = InstanceSpec.parse(f"{spec.name}={spec.endpoint}{options}")
    return dataclasses.replace(spec, curve=parsed.curve, client_key=parsed.client_key)


def _open(args: argparse.Namespace) -> Subscriber:
    try:
        spec = InstanceSpec(args.name, args.endpoint, args.replay, args.topic, args.dp)
        if args.curve is not None or args.client_key is not None:
            spec = _with_curve(spec, args.curve, args.client_key)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    try:
        return Subscriber(instances=[spec])
    except zmq.ZMQError as exc:
        raise UsageError(f"can't follow {args.endpoint}: {exc}") from None


def _watch(sub: Subscriber, out: Output, tally: Tally, args: argparse.Namespace) -> bool:
    """Follow until a limit, Ctrl+C or SIGTERM (either ends it with the summary); False if
    stdout was closed under us."""
    try:
        with stop_signals("watch") as stop:
            _follow(sub, out, tally, args, stop)
    except BrokenPipeError:
        silence_stdout()
        return False
    return True


def run(args: argparse.Namespace) -> int:
    sub = _open(args)
    out: Output = JsonOutput() if args.json else HumanOutput()
    tally = Tally()
    with sub:
        stdout_open = _watch(sub, out, tally, args)
        summary = _summary(sub, tally)  # before closing: the stats go with the sources
    # With --json the summary goes to stderr, which is still there after `| head`.
    if stdout_open or args.json:
        out.summary(summary)
    return 0
