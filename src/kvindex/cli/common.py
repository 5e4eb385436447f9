"""What every command shares: the usage-error type and argument checkers."""

from __future__ import annotations

import argparse

__all__ = ["EXIT_USAGE", "UsageError", "positive_float", "positive_int"]

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


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value
