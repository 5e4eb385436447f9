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


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports after it (for DP ranks)."""
    for _ in range(200):
        base = free_port()
        if base + n >= 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
