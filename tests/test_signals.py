"""Every long-running command stops on real signals: promptly, exit 0, no traceback, ports
freed, state written; a second signal ends it at once.

Two ways of sending, as issue 14 asks: to the process group, as a terminal's Ctrl+C (and
`kill -- -PGID`) does, and to the parent alone, as systemd, Kubernetes or `kill PID` do.
Batches flow while the signal arrives, so it lands in the middle of real work.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from clitools import Proc, kvindex
from netutil import free_port, free_ports

from kvindex.recording import BatchRec, Writer, records
from kvindex.security.curve import generate_keys
from kvindex.subscriber import SourceKey
from kvindex.wire import BlockStored
from kvindex.wire.publisher import Publisher, encode_batch

pytestmark = pytest.mark.timeout(60)

STOP_WITHIN = 10.0  # seconds from the signal to the exit (most take well under one)


@dataclass(frozen=True)
class How:
    """How the signal is sent."""

    sig: int
    group: bool  # the process group (a terminal) or the parent alone (a supervisor)

    def __str__(self) -> str:
        return f"{signal.Signals(self.sig).name}-{'group' if self.group else 'parent'}"

    def send(self, proc: Proc) -> None:
        if self.group:
            proc.signal_group(self.sig)
        else:
            proc.interrupt(self.sig)


TERMINAL = How(signal.SIGINT, group=True)  # Ctrl+C
SUPERVISOR = How(signal.SIGTERM, group=False)  # systemd, Kubernetes, kill PID
EVERY_WAY = [
    TERMINAL,
    SUPERVISOR,
    How(signal.SIGTERM, group=True),
    How(signal.SIGINT, group=False),
]


class Flowing:
    """A publisher that keeps publishing (a batch every 10 ms) until closed."""

    def __init__(self) -> None:
        self.pub = Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(0.01):
            self.pub.publish([BlockStored([i], None, list(range(16)), 16)])
            i += 1

    @property
    def spec(self) -> str:
        return f"{self.pub.endpoint},replay={self.pub.replay_endpoint}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close()


@pytest.fixture
def flowing() -> Iterator[Flowing]:
    f = Flowing()
    try:
        yield f
    finally:
        f.close()


def stop_and_check(proc: Proc, how: How) -> float:
    """Send the signal; the process must exit 0 within STOP_WITHIN s, with no traceback.
    Returns how long it took."""
    sent = time.monotonic()
    how.send(proc)
    code = proc.finish(STOP_WITHIN)
    took = time.monotonic() - sent
    assert code == 0, (code, proc.err[-10:])
    assert not any("Traceback" in line for line in proc.err), proc.err
    return took


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# -- watch, record, relay, replay -----------------------------------------------------------


@pytest.mark.parametrize("how", [TERMINAL, SUPERVISOR], ids=str)
def test_watch_stops_with_its_summary(flowing: Flowing, how: How) -> None:
    proc = kvindex(
        "watch", flowing.pub.endpoint, "--replay", flowing.pub.replay_endpoint, group=True
    )
    proc.wait_for(proc.out, lambda line: line.startswith("#"))
    stop_and_check(proc, how)
    assert proc.out[-1].startswith("summary: "), proc.out[-3:]


@pytest.mark.parametrize("how", [TERMINAL, SUPERVISOR], ids=str)
def test_record_stops_with_everything_written(flowing: Flowing, how: How, tmp_path: Path) -> None:
    out = tmp_path / "r.kvr"
    # A long flush interval: what the file holds at the end was written by the stop itself.
    proc = kvindex(
        "record", "--instance", f"a={flowing.spec}", "--out", str(out),
        "--flush-interval", "600", group=True,
    )  # fmt: skip
    proc.wait_for(proc.err, lambda line: line.startswith("recording "))
    time.sleep(0.5)
    stop_and_check(proc, how)
    summary = proc.wait_for(proc.err, lambda line: line.startswith("recorded "))
    batches = [r for r in records(out) if isinstance(r, BatchRec)]
    assert batches and f"recorded {len(batches)} batches" in summary


@pytest.mark.parametrize("how", [TERMINAL, SUPERVISOR], ids=str)
def test_relay_stops_and_frees_its_ports(flowing: Flowing, how: How, tmp_path: Path) -> None:
    keys = generate_keys(tmp_path, "relay")
    port, replay_port = free_port(), free_port()
    proc = kvindex(
        "relay", "--from", flowing.spec,
        "--bind", f"tcp://127.0.0.1:{port}", "--replay-bind", f"tcp://127.0.0.1:{replay_port}",
        "--server-key", str(keys.secret), "--allow-any", group=True,
    )  # fmt: skip
    proc.wait_for(proc.out, lambda line: "serving" in line)
    stop_and_check(proc, how)
    assert port_is_free(port) and port_is_free(replay_port)


def recording(path: Path, batches: int, spacing: float) -> None:
    """A recording of one source whose batches are `spacing` seconds apart."""
    with Writer(path) as w:
        w.session(["a=tcp://127.0.0.1:1"])
        for i in range(batches):
            ts = 1e9 + i * spacing
            events = [BlockStored([i], None, list(range(16)), 16)]
            w.batch(SourceKey("a"), i, encode_batch(events, ts), received=ts)


@pytest.mark.parametrize("how", [TERMINAL, SUPERVISOR], ids=str)
def test_replay_stops_mid_file_and_frees_its_ports(how: How, tmp_path: Path) -> None:
    path = tmp_path / "r.kvr"
    recording(path, 600, spacing=0.05)  # 30 s at the recorded pace
    pub, rep = free_ports(1), free_ports(1)
    proc = kvindex(
        "replay", str(path), "--pub", f"tcp://127.0.0.1:{pub}",
        "--replay-endpoint", f"tcp://127.0.0.1:{rep}", "--wait", "0", group=True,
    )  # fmt: skip
    proc.wait_for(proc.out, lambda line: line.startswith("follow it with"))
    time.sleep(0.5)
    stop_and_check(proc, how)
    assert port_is_free(pub) and port_is_free(rep)
    name = signal.Signals(how.sig).name
    assert re.fullmatch(
        rf"replay stopped at batch \d+ of 600 \(a seq \d+\) after [\d.]+ s: {name}", proc.out[-1]
    ), proc.out[-3:]


# -- serve ---------------------------------------------------------------------------------


def serve(flowing: Flowing, store: str, *extra: str) -> tuple[Proc, int]:
    port = free_port()
    proc = kvindex(
        "serve", "--instance", f"a={flowing.spec}", "--store", store,
        "--http", f"127.0.0.1:{port}", *extra, group=True,
    )  # fmt: skip
    proc.listening_url(timeout=20)
    return proc, port


def get(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("how", EVERY_WAY, ids=str)
def test_serve_memory_store_stops_and_frees_its_port(flowing: Flowing, how: How) -> None:
    proc, port = serve(flowing, "memory")
    assert b'"status":"ok"' in get(port, "/healthz")
    stop_and_check(proc, how)
    assert port_is_free(port)


@pytest.mark.parametrize("how", [TERMINAL, SUPERVISOR, How(signal.SIGTERM, group=True)], ids=str)
def test_serve_sqlite_store_stops_and_frees_its_port(
    flowing: Flowing, how: How, tmp_path: Path
) -> None:
    proc, port = serve(flowing, f"sqlite:///{tmp_path / 'kv.sqlite'}")
    try:
        time.sleep(0.5)
        stop_and_check(proc, how)
        assert port_is_free(port)
    finally:
        proc.kill()


def test_a_second_signal_ends_a_stop_that_hangs(flowing: Flowing) -> None:
    proc, port = serve(flowing, "memory")
    # A request whose body never comes: a graceful stop waits for it (uvicorn, 5 s).
    held = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        held.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.3)
        proc.interrupt(signal.SIGTERM)
        proc.wait_for(proc.err, lambda line: "SIGTERM: stopping" in line)
        time.sleep(0.5)
        assert proc.proc.poll() is None  # still waiting for the request
        sent = time.monotonic()
        proc.interrupt(signal.SIGTERM)
        assert proc.finish(STOP_WITHIN) == 128 + signal.SIGTERM
        assert time.monotonic() - sent < 2.0
        assert any("SIGTERM again: stopping now" in line for line in proc.err), proc.err
    finally:
        held.close()
        proc.kill()


def test_a_background_job_keeps_ignoring_sigint(flowing: Flowing) -> None:
    """A shell starts a script's `cmd &` with SIGINT ignored; that stays so (Unix
    practice: the terminal's Ctrl+C is not for it), and SIGTERM still stops it."""
    proc = kvindex("watch", flowing.pub.endpoint, "--json", background=True)
    proc.wait_for(proc.out, lambda line: '"seq"' in line)
    proc.interrupt(signal.SIGINT)
    seen = len(proc.out)
    time.sleep(0.5)
    assert proc.proc.poll() is None and len(proc.out) > seen  # still following
    stop_and_check(proc, SUPERVISOR)
