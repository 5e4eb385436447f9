"""The bench's side of its child processes: starting, talking to and stopping them.

Children talk to the bench in JSON lines (commands on stdin, answers on stdout; stderr goes
to a log file in the work directory) and are always stopped in a `finally` (end of stdin,
SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvindex.bench.e2e.probes import BenchError, http_json

__all__ = ["Child", "Publishers", "Serve", "bench_child", "child", "healthz_ok", "publishers"]


class Child:
    """A child process; its stdout is read line by line on a thread, stderr goes to a log."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_path = log
        self._log: IO[str] = log.open("w")
        self.started = time.time()
        try:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                cwd=cwd,
                env=env,
            )
        except OSError:
            self._log.close()
            raise
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in stdout:
                self.lines.put(line)
        self.lines.put(None)

    @property
    def name(self) -> str:
        return self.log_path.stem

    def send(self, command: dict[str, Any]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()
        except OSError as exc:
            raise BenchError(f"{self.name} is gone ({exc}); {self.tail()}") from None

    def line(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=max(0.01, timeout))
        except queue.Empty:
            raise BenchError(f"{self.name}: no answer in {timeout:.0f} s; {self.tail()}") from None
        if line is None:
            self.lines.put(None)  # stays at its end
            code = self.proc.wait(10)
            raise BenchError(f"{self.name} exited with {code}; {self.tail()}")
        return line

    def expect(self, op: str, timeout: float) -> dict[str, Any]:
        """The next JSON line whose `op` is `op` (other lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.line(deadline - time.monotonic())
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict) and message.get("op") == op:
                    return message

    def tail(self) -> str:
        with contextlib.suppress(ValueError):
            self._log.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return "its stderr: " + (" | ".join(lines[-4:]) if lines else "(empty)")

    def stop(self, grace: float = 30.0) -> int | None:
        """End of stdin, SIGTERM (a graceful stop), SIGKILL after `grace` seconds."""
        proc = self.proc
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._reader.join(5)
        self._log.close()
        return proc.returncode


@contextlib.contextmanager
def child(
    args: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[Child]:
    c = Child(args, log, cwd, env)
    try:
        yield c
    finally:
        c.stop()


def bench_child(role: str, *args: str) -> list[str]:
    """The command line that runs `programs.child_main([role, *args])` in a fresh
    interpreter."""
    code = "import sys; from kvindex.bench.e2e.programs import child_main; child_main(sys.argv[1:])"
    return [sys.executable, "-c", code, role, *args]


# -- the publisher child ---------------------------------------------------------------------


@dataclass(slots=True)
class Publishers:
    """The publisher child: one vLLM-like publisher per instance, sending on command."""

    child: Child
    endpoints: list[tuple[str, str]]  # (PUB, replay ROUTER) per instance

    def burst(self, timeout: float, count: int | None = None, file: Path | None = None) -> Any:
        """Send the next `count` items (all that are left if None; or a file's items) at
        full speed. Answers the first and last send's times and each next seq."""
        where = None if file is None else str(file)
        self.child.send({"op": "burst", "count": count, "file": where})
        return self.child.expect("burst", timeout)

    def paced(self, batch_rate: float, seconds: float, markers: int = 0, every: float = 1) -> None:
        command = {"op": "paced", "rate": batch_rate, "seconds": seconds, "markers": markers}
        self.child.send(command | {"marker_every": every})
        self.child.expect("started", 30)

    def stats(self) -> dict[str, Any]:
        self.child.send({"op": "stats"})
        return self.child.expect("stats", 30)


@contextlib.contextmanager
def publishers(workdir: Path, items: Path, instances: int, tag: str) -> Iterator[Publishers]:
    args = bench_child("publish", str(items), str(instances))
    with child(args, workdir / f"publisher-{tag}.log") as c:
        endpoints = c.expect("endpoints", 60)["endpoints"]
        yield Publishers(c, [(str(a), str(b)) for a, b in endpoints])


# -- kvindex serve ---------------------------------------------------------------------------


@dataclass(slots=True)
class Serve:
    child: Child
    url: str = ""
    banner: str = ""

    def wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.url:
            line = self.child.line(deadline - time.monotonic())
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].split()[0].rstrip("/")
                self.banner = line.strip()
        return self.url


@contextlib.contextmanager
def serve(
    workdir: Path,
    names: Sequence[str],
    endpoints: Sequence[tuple[str, str]],
    store: str,
    tag: str,
    http: str = "127.0.0.1:0",
    wait: bool = True,
    spec_options: str = "",
    options: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[Serve]:
    """`kvindex serve` following `names` at `endpoints`; `spec_options` ends every instance
    spec (e.g. `,model=M`), `options` are more flags."""
    args = [sys.executable, "-m", "kvindex", "serve", "--http", http, "--store", store]
    for name, (pub, replay) in zip(names, endpoints, strict=True):
        args += ["--instance", f"{name}={pub},replay={replay}{spec_options}"]
    args += options
    with child(args, workdir / f"serve-{tag}.log", cwd=workdir, env=env) as c:
        s = Serve(c)
        if wait:
            s.wait_url(60)
        yield s


def healthz_ok(url: str, c: Child) -> bool:
    if c.proc.poll() is not None:
        raise BenchError(f"serve exited with {c.proc.returncode}; {c.tail()}")
    try:
        return bool(http_json(url, "/healthz").get("status") == "ok")
    except (OSError, BenchError, http.client.HTTPException):
        return False
