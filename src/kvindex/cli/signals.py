"""How the long-running commands stop: SIGINT (Ctrl+C) and SIGTERM (`kill`, a supervisor).

The first signal asks the command to finish: it sets a flag that the command's loop checks
between two short waits, and runs the callbacks of loops that are not ours (uvicorn's), so
the command flushes what it holds, closes its sockets, frees its ports and exits 0. A
second signal, for a finish that hangs, ends the process at once (exit 128 + the signal's
number) with one line saying so.

Both ways of sending work alike: to the process group (a terminal's Ctrl+C) or to the
parent alone (systemd, Kubernetes, `kill PID`). A command started with SIGINT ignored (a
shell script's background job) keeps ignoring it, as Unix tools do; SIGTERM still works.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "Stop", "stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop:
    """Whether a stop was asked for (`stop()` is true once a signal came), and a way to
    sleep that a signal cuts short (`stop.wait(seconds)`)."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.signal: int | None = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def __call__(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str:
        """What stopped the command, for its last line ("SIGINT", "SIGTERM")."""
        return "" if self.signal is None else signal.Signals(self.signal).name

    def wait(self, seconds: float | None) -> bool:
        """Sleep up to `seconds` (None: until a stop); True if a stop was asked for."""
        return self._event.wait(seconds)

    def request(self) -> None:
        """Stop as a first signal would (a command's own limit, a test)."""
        if self._event.is_set():
            return
        self._event.set()
        for callback in list(self._callbacks):
            callback()

    @contextlib.contextmanager
    def calling(self, callback: Callable[[], None]) -> Iterator[None]:
        """Run `callback` on the first signal (at once, if it already came) while inside."""
        self._callbacks.append(callback)
        try:
            if self():
                callback()
            yield
        finally:
            self._callbacks.remove(callback)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler (runs in the main thread, between two bytecodes)."""
        name = signal.Signals(signum).name
        if self():
            _say(f"kvindex {self.command}: {name} again: stopping now, without cleaning up")
            os._exit(128 + signum)
        self.signal = signum
        _say(f"kvindex {self.command}: {name}: stopping (send it again to stop at once)")
        self.request()


def _say(line: str) -> None:
    # os.write, not print: a handler may run while the interpreter is inside a print.
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


@contextlib.contextmanager
def stop_signals(command: str) -> Iterator[Stop]:
    """Handle SIGINT and SIGTERM as described above while inside; the previous handlers
    come back on the way out."""
    stop = Stop(command)
    previous: dict[int, Any] = {}
    for sig in STOP_SIGNALS:
        if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
            continue  # started as a background job: stay deaf to the terminal's Ctrl+C
        previous[sig] = signal.signal(sig, stop.handle)
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
