"""What every case shares: the block size, timing and percentile helpers, the machine the
bench runs on, resident memory, and a throwaway Redis server."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "BLOCK",
    "best_of",
    "cache_dir",
    "machine_info",
    "median",
    "percentile",
    "redis_server",
    "rss_bytes",
    "trim_heap",
]

BLOCK = 16  # tokens per block, vLLM's default


def best_of(run: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    """The fastest of `repeats` runs of `run` (which returns its own timed seconds), and all
    of them. Throughput cases take the best run: on a shared machine every disturbance
    makes a run slower, never faster, so the minimum is the least noisy estimate."""
    runs = [run() for _ in range(max(1, repeats))]
    return min(runs), runs


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The `q`-quantile (0..1) of already sorted values, nearest rank."""
    if not sorted_values:
        raise ValueError("no values")
    rank = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[rank])


def median(values: Sequence[float]) -> float:
    return percentile(sorted(values), 0.5)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`), so an RSS
    delta measured from here counts what is allocated next, not what reuses pages freed
    before (a no-op where there is no glibc)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def rss_bytes() -> int:
    """This process's resident set size now (not the peak: deltas must be able to shrink)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def machine_info() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def cache_dir() -> Path:
    """Where generated workloads are kept between runs (KVINDEX_BENCH_CACHE overrides)."""
    default = Path.home() / ".cache" / "kvindex-tests" / "bench"
    return Path(os.environ.get("KVINDEX_BENCH_CACHE", default))


@contextmanager
def redis_server(directory: Path) -> Iterator[str | None]:
    """A throwaway `redis-server` on a free loopback port, or None if it isn't installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)]
    args += ["--save", "", "--appendonly", "no", "--logfile", str(directory / "redis.log")]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, 10.0)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_for_port(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
