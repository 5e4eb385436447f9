"""What every bench child program shares: its one-line JSON messages to the parent, and
a pace for its steps. (Apart from `programs.py`, which starts the children: the routing
case's child imports these, and `programs.py` imports that child.)"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["paced_steps", "say"]


def say(message: dict[str, Any]) -> None:
    """One JSON line to the parent, flushed at once (the parent waits for it)."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def paced_steps(count: int, interval: float) -> Iterator[int]:
    """0 .. count-1, one every `interval` seconds (at once after a step that ran late)."""
    clock = time.perf_counter
    next_at = clock()
    for i in range(count):
        pause = next_at - clock()
        if pause > 0:
            time.sleep(pause)
        next_at = max(next_at + interval, clock())
        yield i
