"""Driver processes (scripts run with the vLLM venv's python) as the interop tests see them."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Driver:
    """One vLLM engine stand-in: the real KVCacheManager + ZmqEventPublisher in a subprocess."""

    proc: subprocess.Popen[str]
    out: Path
    ready: dict[str, Any] = field(default_factory=dict)

    def wait_ready(self, timeout: float = 240, stall: float = 45) -> dict[str, Any]:
        """Until the driver says it is bound. Importing vLLM and torch takes seconds of CPU,
        minutes of wall time on a loaded machine (120 s ran out at load average 8-18):
        the wait goes on while the driver uses CPU, up to `timeout`, and fails once it has
        used none for `stall` seconds (a hang: blocked, not importing)."""
        return self._wait_for("ready", timeout, stall)

    def wait_done(self, timeout: float = 180) -> dict[str, Any]:
        self._wait_for("done", timeout)
        return json.loads(self.out.read_text())

    def cpu_seconds(self) -> float:
        """CPU time the driver used so far (user + system; 0 once it is gone)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _wait_for(self, event: str, timeout: float, stall: float | None = None) -> dict[str, Any]:
        assert self.proc.stdout is not None
        start = time.monotonic()
        deadline = start + timeout
        cpu, progress_at = self.cpu_seconds(), start
        while time.monotonic() < deadline:
            if stall is not None:
                now, used = time.monotonic(), self.cpu_seconds()
                if used > cpu:
                    cpu, progress_at = used, now
                elif now - progress_at > stall:
                    raise AssertionError(
                        f"driver used no CPU for {stall:.0f} s before {event!r} (a hang; "
                        f"{cpu:.1f} CPU s in {now - start:.0f} s): {self.stderr()[-2000:]}"
                    )
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if msg.get("event") == event:
                    if event == "ready":
                        self.ready = msg
                    return msg
            elif self.proc.poll() is not None:
                break
        raise AssertionError(
            f"driver never said {event!r} in {time.monotonic() - start:.0f} s: "
            f"{self.stderr()[-2000:]}"
        )

    def stderr(self) -> str:
        try:
            return self.out.with_name(self.out.name + ".stderr").read_text(errors="replace")
        except OSError:
            return ""

    def go(self) -> None:
        """Release a driver started with --wait-go."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def spawn(vllm_python: str, script: Path, out: Path, *args: str) -> Driver:
    """Start one driver script with the vLLM venv's python (no PYTHONHASHSEED: vLLM seeds
    its NONE_HASH from it, and the references assume vLLM's default)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    # stderr to a file: vLLM's warnings must never fill a pipe nobody reads.
    with out.with_name(out.name + ".stderr").open("w") as err:
        proc = subprocess.Popen(
            [vllm_python, str(script), "--out", str(out), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    return Driver(proc, out)
