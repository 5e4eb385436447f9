"""Shared fixtures. Helpers live in netutil.py (tests/ is on sys.path)."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import Phase, settings

sys.path.insert(0, str(Path(__file__).parent))

import enginevenv
from netutil import free_port, reap_tracked

pytest_plugins = ["skipsummary"]  # the run's last lines say what it skipped and why

# CI's profile (.ci/run sets KVINDEX_HYPOTHESIS=ci): a failing example is reported as found,
# not shrunk (CI's shrink of one sharded differential failure ran 5 minutes, past the
# test's timeout), with the blob that reproduces it (`@reproduce_failure`), which a
# developer then shrinks with the default profile.
settings.register_profile("ci", phases=[p for p in Phase if p is not Phase.shrink], print_blob=True)
settings.load_profile(os.environ.get("KVINDEX_HYPOTHESIS", "default"))


def pytest_collection_finish(session: pytest.Session) -> None:
    # Venvs of engines' own code are built here, before any (timed) test starts.
    enginevenv.prepare(session)


@pytest.fixture(autouse=True)
def _reap_tracked() -> Iterator[None]:
    yield
    reap_tracked()


@pytest.fixture(autouse=True, scope="module")
def _freeze_what_outlives_a_module() -> Iterator[None]:
    """After each test file: its garbage collected, then what is still alive (the session's
    objects: modules, hypothesis, fixtures) frozen, never scanned again. Without it the
    cyclic GC rescans the whole session's objects over and over: 232 of 551 s spent in it
    over the first 45 files here, 6 of 348 s with it. Unfrozen at the end (below)."""
    yield
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Everything frozen goes back to the collector, and its garbage is freed before the
    # process exits (LeakSanitizer, `make sanitize`, reports what is left).
    gc.unfreeze()
    gc.collect()


@pytest.fixture
def port() -> int:
    return free_port()


class RedisServer:
    """A real `redis-server` (Debian's package) on a free loopback port, its data in a
    temp dir (append-only file, so a stop and start keeps it), for the Redis store tests."""

    def __init__(self, workdir: Path) -> None:
        import shutil

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.dir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.dir), "--appendonly", "yes", "--save", ""]
        args += ["--protected-mode", "no", "--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        """A clean shutdown (SIGTERM): Redis flushes its append-only file first."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for a whole module (tests that flush it between uses)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()
