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

    def wait_ready(self, timeout: float = 120) -> dict[str, Any]:
        return self._wait_for("ready", timeout)

    def wait_done(self, timeout: float = 180) -> dict[str, Any]:
        self._wait_for("done", timeout)
        return json.loads(self.out.read_text())

    def _wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
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
        raise AssertionError(f"driver never said {event!r}: {self.stderr()[-2000:]}")

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
