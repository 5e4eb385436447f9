"""The SGLang venv for live interop tests, built before any test runs (not inside one).

`scripts/sglang-venv.sh` takes about 90 s cold; pytest-timeout would charge that to the
first test needing it. `tests/conftest.py` calls `prepare` once collection is done, and
only when a selected test uses the `sglang_python` fixture; the fixture then reads the
outcome. `KVINDEX_SKIP_SGLANG=1` skips those tests without building anything.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_ENV = "KVINDEX_SKIP_SGLANG"
FIXTURE = "sglang_python"


@dataclass(frozen=True)
class Venv:
    python: str | None = None
    skip: str | None = None
    error: str | None = None


VENV_KEY = pytest.StashKey[Venv]()


def prepare(session: pytest.Session) -> None:
    """Build the venv now if a selected test needs it."""
    if not any(FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        return
    session.config.stash[VENV_KEY] = build()


def build() -> Venv:
    if os.environ.get(SKIP_ENV) == "1":
        return Venv(skip=f"{SKIP_ENV}=1")
    try:
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "sglang-venv.sh")],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except subprocess.TimeoutExpired:
        return Venv(error="scripts/sglang-venv.sh took over 30 minutes")
    if proc.returncode != 0:
        return Venv(error=f"could not build the SGLang venv:\n{proc.stderr[-3000:]}")
    return Venv(python=proc.stdout.strip().splitlines()[-1])


def python(config: pytest.Config) -> str:
    """The venv's python for a test (skips or fails it as the build went)."""
    venv = config.stash.get(VENV_KEY, None) or build()
    if venv.skip:
        pytest.skip(venv.skip)
    if venv.error or venv.python is None:
        pytest.fail(venv.error or "no SGLang venv")
    return venv.python
