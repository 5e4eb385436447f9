"""Test helpers: free loopback ports, waiting for a condition, reaping started processes."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

# Every child a test registered (`track`): conftest's autouse `reap_tracked` kills those
# still running after each test, so a failing test leaves no `serve` behind.
_TRACKED: list[subprocess.Popen[str]] = []


def track(proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
    _TRACKED.append(proc)
    return proc


def serve_line(proc: subprocess.Popen[str], context: Callable[[], object] = str) -> str:
    """The first line a `serve` started with stdout piped prints ("listening on URL ...").
    Anything else kills it and fails with `context()`; the process is tracked, so a test
    that fails later leaves nothing behind either."""
    track(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on " not in line:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"serve did not start: {line!r} {context()}")
    return line


def serve_url(proc: subprocess.Popen[str], context: Callable[[], object] = str) -> str:
    """The base URL of `serve_line` (trailing slash included)."""
    return serve_line(proc, context).split("listening on ")[1].split()[0]


def reap_tracked() -> None:
    while _TRACKED:
        proc = _TRACKED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The ports the last runs handed out: nothing holds them until the test binds, so the
# kernel may offer one again, and a test asking for two runs got overlapping ones.
# (a dict as an ordered set: the oldest go first past HANDED_KEPT)
_HANDED: dict[int, None] = {}
HANDED_KEPT = 1024


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports after it (for DP ranks), none of them in
    a run handed out lately."""
    for _ in range(200):
        base = free_port()
        if base + n >= 65535 or not _HANDED.keys().isdisjoint(range(base, base + n)):
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            _hand_out(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def _hand_out(ports: range) -> None:
    for port in ports:
        _HANDED[port] = None
    while len(_HANDED) > HANDED_KEPT:
        del _HANDED[next(iter(_HANDED))]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
