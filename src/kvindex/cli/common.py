"""What every command shares: the usage-error type and argument checkers."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = [
    "EXIT_USAGE",
    "UsageError",
    "non_negative_seconds",
    "positive_float",
    "positive_int",
    "positive_seconds",
    "silence_stdout",
]

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with what the user asked for: reported as one line, exit code 2."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_float(text: str) -> float:
    """A number above 0 (a speed, a rate)."""
    value = _number(text, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def positive_seconds(text: str) -> float:
    """A duration in seconds, above 0."""
    value = _number(text, "a number of seconds")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def non_negative_seconds(text: str) -> float:
    """A duration in seconds, 0 or more."""
    value = _number(text, "a number of seconds")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or a positive number of seconds")
    return value


def silence_stdout() -> None:
    """The reader of stdout went away (`| head`): point stdout at /dev/null, so that the
    interpreter's last flush does not fail again (a BrokenPipeError traceback at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop for the HTTP servers when it is installed (a request costs ~75 us
    less than on asyncio's own loop, measured in docs/performance.md), unless
    KVINDEX_LOOP=asyncio asks for the standard one; None: asyncio's."""
    if os.environ.get("KVINDEX_LOOP", "auto") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_async(main: Coroutine[Any, Any, None]) -> None:
    """`asyncio.run(main)` on the loop `event_loop_factory` picks."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(main)
