"""Fixtures for interop with vLLM 0.33.0's own code, run in its own venv (see README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM venv's python, built on first use (cached under ~/.cache/kvindex-tests)."""
    if os.environ.get("KVINDEX_SKIP_VLLM") == "1":
        pytest.skip("KVINDEX_SKIP_VLLM=1")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm-venv.sh")],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if proc.returncode != 0:
        pytest.fail(f"could not build the vLLM venv:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


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
        import select
        import time

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
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise AssertionError(f"driver never said {event!r}: {err[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def start_driver(vllm_python: str, tmp_path: Path) -> Iterator[Any]:
    drivers: list[Driver] = []

    def start(name: str, pub: str, replay: str, *args: str) -> Driver:
        out = tmp_path / f"{name}-{len(drivers)}.json"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        proc = subprocess.Popen(
            [vllm_python, str(DRIVER), "--pub", pub, "--replay", replay, "--out", str(out), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        driver = Driver(proc, out)
        drivers.append(driver)
        return driver

    yield start
    for d in drivers:
        d.stop()
