"""Running kvindex commands and example scripts as real subprocesses, for the CLI tests.

Output is read by background threads into lists, so a test can wait for a line to appear
while the process keeps running (and a full pipe never blocks the child).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def child_env() -> dict[str, str]:
    # Plain text whatever the CI's terminal settings: no forced colours or terminal mode.
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env["NO_COLOR"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _as_foreground_job() -> None:
    # What a terminal's foreground job gets: SIGINT at its default, whatever the test
    # runner inherited (a background job's shell starts its children with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _as_background_job() -> None:
    # What a shell script's `cmd &` gets: SIGINT ignored, so Ctrl+C spares it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Proc:
    """A child process whose stdout and stderr lines are collected as they come.

    `group=True` runs it in a process group of its own, as a shell runs a job: then
    `signal_group` reaches it and its children the way a terminal's Ctrl+C does;
    `background=True` starts it as a script's background job (SIGINT ignored)."""

    def __init__(
        self,
        argv: list[str],
        cwd: Path = ROOT,
        *,
        group: bool = False,
        background: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**child_env(), **(env or {})},
            process_group=0 if group else None,
            preexec_fn=_as_background_job if background else _as_foreground_job,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream: IO[str], lines: list[str]) -> None:
        try:
            for line in stream:
                lines.append(line.rstrip("\n"))
        except (ValueError, OSError):
            pass  # the test closed the pipe on purpose

    def listening_url(self, timeout: float = 30.0) -> str:
        """The base URL `serve` says it listens on (as printed, trailing slash included);
        the process is killed if it never says so, so a failed start leaves nothing behind."""
        try:
            line = self.wait_for(self.out, lambda s: "listening on" in s, timeout=timeout)
        except AssertionError:
            self.kill()
            raise
        return line.split("listening on ")[1].split()[0]

    def wait_for(
        self, lines: list[str], predicate: Callable[[str], bool], timeout: float = 10.0
    ) -> str:
        """The first line (of `lines`: self.out or self.err) that matches, waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(lines):
                if predicate(line):
                    return line
            if self.proc.poll() is not None and not any(t.is_alive() for t in self._threads):
                break
            time.sleep(0.01)
        raise AssertionError(
            f"no matching line from {self.argv[-3:]} within {timeout} s\n"
            f"stdout: {self.out[-20:]}\nstderr: {self.err[-20:]}"
        )

    def finish(self, timeout: float = 10.0) -> int:
        """Wait for the process to end (killing it after `timeout`) and its output to drain."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"{self.argv} still running after {timeout} s\n"
                f"stdout: {self.out[-20:]}\nstderr: {self.err[-20:]}"
            ) from None
        for t in self._threads:
            t.join(5)
        return rc

    def interrupt(self, sig: int = signal.SIGINT) -> None:
        self.proc.send_signal(sig)

    def signal_group(self, sig: int = signal.SIGINT) -> None:
        """Signal the whole process group (needs `group=True`), as a terminal does."""
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def kvindex(
    *args: str, group: bool = False, background: bool = False, env: dict[str, str] | None = None
) -> Proc:
    """`python -m kvindex ARGS`; `env`: variables added to the child's environment."""
    argv = [sys.executable, "-m", "kvindex", *args]
    return Proc(argv, group=group, background=background, env=env)


def example(script: str, *args: str) -> Proc:
    return Proc([sys.executable, str(EXAMPLES / script), *args])
